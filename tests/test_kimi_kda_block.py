"""The trainer's Kimi Delta Attention layer (``models.kimi_linear.kda_block``) on CPU: against an independent float64
layer (projections, short convs, the per-channel gate, the delta rule, the sigmoid-gated norm), gradients against
float64 autograd, and a packed batch == each sequence alone, bit for bit.

Tolerances (bf16 weights and activations against float64 with no roundings): outputs within 2e-2 of the largest
reference value; every weight's (and the input's) gradient with cosine >= 0.999 and relative L2 error <= 5% against
float64's. Measured (2026-12-05): 0.63% / 0.58% of the largest value; worst gradient rel 1.4%, cos 0.99992.
"""

import pytest
import torch

from vllm_bi.gdn.naive import naive_causal_conv1d, naive_kda
from vllm_bi.models.kimi_linear import KDA_NORM_EPS, KDA_WEIGHTS, KimiDeltaAttention, kda_block

D, H, K, W = 64, 2, 16, 4
P = H * K


def _layer(seed=0, lower_bound=None):
    g = torch.Generator().manual_seed(seed)
    layer = KimiDeltaAttention(D, H, K, W, lower_bound)
    scale = {"q_conv1d.weight": 0.4, "k_conv1d.weight": 0.4, "v_conv1d.weight": 0.4, "f_b_proj.weight": 0.3,
             "g_b_proj.weight": 0.3, "dt_bias": 0.3}
    t = {}
    for name, p in layer.weights().items():
        t[name] = torch.randn(p.shape, generator=g) * scale.get(name, D**-0.5)
    t["A_log"] = torch.log(torch.rand(1, 1, H, 1, generator=g) * 8 + 1)
    t["o_norm.weight"] = 1 + 0.1 * torch.randn(K, generator=g)
    layer.load(t)
    return layer


def _reference(x, cu, w, lower_bound):
    """Float64, one sequence at a time, written from the layer's definition."""
    lin = lambda t, m: t @ m.double().T  # noqa: E731
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        xs, T = x[s:e].double(), e - s
        zero = torch.zeros(W - 1, P, dtype=torch.float64)
        q, k, v = (naive_causal_conv1d(lin(xs, w[f"{n}_proj.weight"]), w[f"{n}_conv1d.weight"].reshape(P, W), zero)
                   for n in "qkv")
        forget = lin(lin(xs, w["f_a_proj.weight"]), w["f_b_proj.weight"]).view(T, H, K)
        gate = lin(lin(xs, w["g_a_proj.weight"]), w["g_b_proj.weight"]).view(T, H, K)
        o, _ = naive_kda(q.view(T, H, K), k.view(T, H, K), v.view(T, H, K), w["A_log"].reshape(H), forget,
                         lin(xs, w["b_proj.weight"]), w["dt_bias"], torch.zeros(H, K, K, dtype=torch.float64),
                         lower_bound)
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + KDA_NORM_EPS) * w["o_norm.weight"].double()
        y = y * torch.sigmoid(gate)
        outs.append(lin(y.reshape(T, P), w["o_proj.weight"]))
    return torch.cat(outs)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_block_matches_float64_and_its_gradients(lower_bound):
    layer = _layer(lower_bound=lower_bound)
    cu = [0, 30, 50]
    x = torch.randn(50, D, generator=torch.Generator().manual_seed(9)).bfloat16().requires_grad_(True)
    y = layer(x, cu)
    w64 = {n: p.detach().double().requires_grad_(True) for n, p in layer.weights().items()}
    x64 = x.detach().double().requires_grad_(True)
    ref = _reference(x64, cu, w64, lower_bound)
    assert y.dtype == torch.bfloat16 and y.shape == (50, D)
    err = float((y.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())
    assert err <= 2e-2, err
    probe = torch.randn(50, D, generator=torch.Generator().manual_seed(3))
    (y.float() * probe).sum().backward()
    (ref * probe.double()).sum().backward()
    for name, p in [*layer.weights().items(), ("x", x)]:
        h = w64[name].grad if name != "x" else x64.grad
        gr = p.grad.double()
        cos = float(torch.nn.functional.cosine_similarity(gr.flatten(), h.flatten(), dim=0))
        rel = float((gr - h).norm() / h.norm())
        assert cos >= 0.999 and rel <= 0.05, (name, cos, rel)


def test_kda_block_packed_equals_each_sequence_alone_and_the_control_differs():
    """Three sequences packed == each run alone, bit for bit (zero conv and recurrent states per sequence, row-local
    ops). Control: the same rows run as one sequence (the states carried across the boundary) give the second and
    third sequences other bits, so the comparison can fail."""
    layer = _layer(seed=1, lower_bound=-5.0)
    lens = [7, 1, 12]
    cu = [0, 7, 8, 20]
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        packed = layer(x, cu)
        for s, e in zip(cu[:-1], cu[1:]):
            assert torch.equal(layer(x[s:e], [0, e - s]), packed[s:e]), (s, e)
        joined = layer(x, [0, 20])
    assert torch.equal(joined[:7], packed[:7])
    assert not torch.equal(joined[8:], packed[8:]), "control: carrying the state across sequences changes nothing?"
    assert sum(lens) == 20


def test_kda_layer_refuses_a_checkpoint_it_does_not_fit():
    layer = KimiDeltaAttention(D, H, K, W)
    t = {n: torch.zeros(p.shape) for n, p in layer.weights().items()}
    del t["f_b_proj.weight"]
    with pytest.raises(KeyError, match="f_b_proj.weight"):
        layer.load(t)
    t["f_b_proj.weight"] = torch.zeros(P + 1, K)
    with pytest.raises(ValueError, match=r"f_b_proj.weight has shape \(33, 16\)"):
        layer.load(t)
    assert len(KDA_WEIGHTS) == 15
