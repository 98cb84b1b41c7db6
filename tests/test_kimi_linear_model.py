"""The trainer's Kimi Linear (``models.kimi_linear.KimiLinearForCausalLM``) on a tiny random-weight checkpoint
(``tiny_models.build_tiny_kimi_linear``: KDA and no-rotary MLA layers, a dense MLP then a sigmoid-routed MoE with a
shared expert): against an independent float64 forward of the same weights, a packed batch == each sequence alone
bit for bit, gradients against float64 autograd, and the checkpoint round trip and refusals.

Tolerances (bf16 against float64 with no roundings, four layers): next-token logprobs within 0.1 nats; every
parameter's gradient with cosine >= 0.99 and relative L2 error <= 10% (tensors of fewer than 16 elements: cosine
>= 0.95). Measured (2026-12-05, printed with ``-s``): a gap of 0.053 nats (logits 2.6% of the largest, growing with
depth: 0.5% after one layer, 1.2% after two, no routing flip); the worst of 99 gradients cos 0.998, rel 6.6% (a
KDA beta projection).
"""

import json

import pytest
import torch

from vllm_bi.gdn.naive import naive_causal_conv1d, naive_kda
from vllm_bi.models.kimi_linear import KDA_NORM_EPS, KimiConfig, KimiLinearForCausalLM
from vllm_bi.tiny_models import build_tiny_kimi_linear, kimi_linear_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_kimi_linear(str(tmp_path_factory.mktemp("kimi")))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(c: KimiConfig, W: dict, ids: torch.Tensor) -> torch.Tensor:
    """Float64 logits of one sequence, written from the architecture's definition."""
    lin = lambda t, m: t @ m.T  # noqa: E731
    T = ids.shape[0]
    h = W["model.embed_tokens.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        x = _rms(h, W[f"{p}.input_layernorm.weight"], c.rms_norm_eps)
        a = f"{p}.self_attn"
        if c.is_kda(i):
            H, K, P = c.kda_heads, c.kda_head_dim, c.kda_heads * c.kda_head_dim
            zero = torch.zeros(c.conv_size - 1, P, dtype=torch.float64)
            q, k, v = (naive_causal_conv1d(lin(x, W[f"{a}.{n}_proj.weight"]), W[f"{a}.{n}_conv1d.weight"].reshape(P, -1),
                                           zero).view(T, H, K) for n in "qkv")
            forget = lin(lin(x, W[f"{a}.f_a_proj.weight"]), W[f"{a}.f_b_proj.weight"]).view(T, H, K)
            o, _ = naive_kda(q, k, v, W[f"{a}.A_log"].reshape(H), forget, lin(x, W[f"{a}.b_proj.weight"]),
                             W[f"{a}.dt_bias"], torch.zeros(H, K, K, dtype=torch.float64), c.gate_lower_bound)
            gate = lin(lin(x, W[f"{a}.g_a_proj.weight"]), W[f"{a}.g_b_proj.weight"]).view(T, H, K)
            y = _rms(o, W[f"{a}.o_norm.weight"], KDA_NORM_EPS) * torch.sigmoid(gate)
            mixed = lin(y.reshape(T, P), W[f"{a}.o_proj.weight"])
        else:
            NH, nope, rope, dv, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                     c.kv_lora_rank)
            q = lin(x, W[f"{a}.q_proj.weight"]).view(T, NH, nope + rope)
            kv_a = lin(x, W[f"{a}.kv_a_proj_with_mqa.weight"])
            kv = lin(_rms(kv_a[:, :r], W[f"{a}.kv_a_layernorm.weight"], c.rms_norm_eps),
                     W[f"{a}.kv_b_proj.weight"]).view(T, NH, nope + dv)
            k = torch.cat([kv[..., :nope], kv_a[:, None, r:].expand(T, NH, rope)], -1)
            s = torch.einsum("thd,uhd->htu", q, k) * (nope + rope) ** -0.5
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("htu,uhd->thd", torch.softmax(s, -1), kv[..., nope:])
            mixed = lin(o.reshape(T, NH * dv), W[f"{a}.o_proj.weight"])
        h = h + mixed
        x = _rms(h, W[f"{p}.post_attention_layernorm.weight"], c.rms_norm_eps)

        def mlp(t, g, u, d):
            return lin(torch.nn.functional.silu(lin(t, g)) * lin(t, u), d)

        if c.is_moe(i):
            m = f"{p}.block_sparse_moe"
            scores = torch.sigmoid(lin(x, W[f"{m}.gate.weight"]))
            top = torch.topk(scores + W[f"{m}.gate.e_score_correction_bias"], c.top_k, dim=-1).indices
            wts = scores.gather(1, top)
            wts = wts / wts.sum(-1, keepdim=True) * c.routed_scaling_factor
            out = torch.zeros_like(x)
            for t in range(T):
                for j in range(c.top_k):
                    e = int(top[t, j])
                    out[t] += wts[t, j] * mlp(x[t], W[f"{m}.experts.{e}.w1.weight"], W[f"{m}.experts.{e}.w3.weight"],
                                              W[f"{m}.experts.{e}.w2.weight"])
            out = out + mlp(x, *(W[f"{m}.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")))
        else:
            out = mlp(x, *(W[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
        h = h + out
    return lin(_rms(h, W["model.norm.weight"], c.rms_norm_eps), W["lm_head.weight"])


def test_kimi_linear_matches_float64_and_its_gradients(ckpt):
    model = KimiLinearForCausalLM.from_pretrained(ckpt)
    ids = torch.randint(1, 512, (40,), generator=torch.Generator().manual_seed(5))
    lp = model.token_logprobs(ids, [0, 40])[:-1]
    W = {n: t.double().requires_grad_(True) for n, t in model.hf_state_dict().items()}
    ref_lp = torch.log_softmax(_reference(model.c, W, ids), -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
    gap = float((lp.detach().double() - ref_lp.detach()).abs().max())
    print(f"max logprob gap to float64: {gap:.4f}")
    assert gap <= 0.1, gap
    (-lp.mean()).backward()
    (-ref_lp.mean()).backward()
    ours = model.hf_state_dict()
    grads = model.hf_state_dict(grads=True)  # our gradients under the checkpoint's names (experts split as there)
    assert set(grads) == set(ours)
    worst, checked = (1.0, 0.0, ""), 0
    for name, g in grads.items():
        h = W[name].grad
        if h is None or h.norm() == 0:  # an expert no token chose, the score bias (no gradient through a top-k)
            continue
        assert g is not None, name
        g = g.double()
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), h.flatten(), dim=0))
        rel = float((g - h).norm() / h.norm())
        ok = (cos >= 0.99 and rel <= 0.10) if h.numel() >= 16 else cos >= 0.95
        assert ok, (name, cos, rel)
        worst = min(worst, (cos, rel, name))
        checked += 1
    print(f"worst gradient: cos {worst[0]:.5f}, rel {worst[1]:.4f} ({worst[2]}); {checked} tensors")
    assert checked >= 40


def test_kimi_linear_packed_equals_each_sequence_alone(ckpt):
    """Three sequences packed == each alone, bit for bit. Control: the same rows as one sequence give the later
    sequences other bits (attention and the KDA state reach across), so the comparison can fail."""
    model = KimiLinearForCausalLM.from_pretrained(ckpt)
    ids = torch.randint(1, 512, (30,), generator=torch.Generator().manual_seed(6))
    cu = [0, 11, 12, 30]
    with torch.no_grad():
        packed = model.token_logprobs(ids, cu)
        for s, e in zip(cu[:-1], cu[1:]):
            alone = model.token_logprobs(ids[s:e], [0, e - s])
            assert torch.equal(alone[:-1], packed[s : e - 1]) and alone[-1].isnan(), (s, e)  # the last: no next token
        joined = model.token_logprobs(ids, [0, 30])
    assert torch.equal(joined[:10], packed[:10])
    assert not torch.equal(joined[12:29], packed[12:29]), "control: one joined sequence should differ"


def test_kimi_linear_checkpoint_round_trip_and_refusals(ckpt, tmp_path):
    model = KimiLinearForCausalLM.from_pretrained(ckpt)
    sd = model.hf_state_dict()
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in sd and "model.layers.0.mlp.up_proj.weight" in sd
    again = KimiLinearForCausalLM(model.c)
    again.load_hf_state_dict(sd)
    for (key, p), (key2, p2) in zip(model.hf_parameters(), again.hf_parameters(), strict=True):
        assert key == key2 and torch.equal(p2, p), key
    short = dict(sd)
    del short["model.layers.3.block_sparse_moe.experts.1.w2.weight"]
    with pytest.raises(KeyError, match="experts.1.w2.weight"):
        again.load_hf_state_dict(short)
    raw = kimi_linear_config()
    for change, word in [({"mla_use_nope": False}, "rotary MLA"), ({"q_lora_rank": 64}, "q_lora_rank"),
                         ({"moe_router_activation_func": "softmax"}, "softmax")]:
        with pytest.raises(ValueError, match=word):
            KimiConfig.from_dict({**raw, **change})
    assert json.loads(json.dumps(raw))["linear_attn_config"]["kda_layers"] == [1, 3]
