"""GDN recurrence: float64 reference, and exactness of splits, decode steps and batching.

Tolerance vs the float64 reference: 2e-4 absolute on fp32 outputs of unit scale
(the recurrence runs in fp32 over 200 tokens).
"""

import torch

from vllm_bi.gdn.naive import naive_causal_conv1d, naive_gdn
from vllm_bi.gdn.layer import causal_conv1d, causal_conv1d_varlen
from vllm_bi.gdn.recurrent import gdn_gating, gdn_recurrent
from vllm_bi.ops import pointwise

torch.manual_seed(0)
T, H, HV, K, V = 200, 1, 2, 128, 128


def _inputs(T=T):
    q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    v = torch.randn(T, HV, V)
    A_log = torch.log(torch.rand(HV) * 15 + 1)
    a, b, dt_bias = torch.randn(T, HV), torch.randn(T, HV), torch.rand(HV) - 0.5
    return q, k, v, A_log, a, b, dt_bias


def test_matches_float64_reference():
    q, k, v, A_log, a, b, dt_bias = _inputs()
    s0 = torch.randn(HV, V, K) * 0.1
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    o, s = gdn_recurrent(q, k, v, g, beta, s0)
    o_ref, s_ref = naive_gdn(q, k, v, A_log, a, b, dt_bias, s0)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=2e-4)


def test_split_and_decode_are_exact():
    q, k, v, A_log, a, b, dt_bias = _inputs()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    zero = torch.zeros(HV, V, K)
    o, s = gdn_recurrent(q, k, v, g, beta, zero)
    for p in (1, 63, 64, 100, 199):
        o1, s1 = gdn_recurrent(q[:p], k[:p], v[:p], g[:p], beta[:p], zero)
        o2, s2 = gdn_recurrent(q[p:], k[p:], v[p:], g[p:], beta[p:], s1)
        assert torch.equal(torch.cat([o1, o2]), o) and torch.equal(s2, s)
    st = zero
    for t in range(T):  # one-token decode steps
        ot, st = gdn_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], st)
        assert torch.equal(ot[0], o[t])


def test_negative_control_bf16_state_at_split_differs():
    q, k, v, A_log, a, b, dt_bias = _inputs()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    zero = torch.zeros(HV, V, K)
    o, _ = gdn_recurrent(q, k, v, g, beta, zero)
    _, s1 = gdn_recurrent(q[:100], k[:100], v[:100], g[:100], beta[:100], zero)
    o2, _ = gdn_recurrent(q[100:], k[100:], v[100:], g[100:], beta[100:], s1.bfloat16().float())
    assert not torch.equal(o2, o[100:])


def test_needs_explicit_fp32_state():
    q, k, v, A_log, a, b, dt_bias = _inputs(4)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    import pytest

    with pytest.raises(ValueError, match="explicit fp32 state"):
        gdn_recurrent(q, k, v, g, beta, None)
    with pytest.raises(ValueError, match="float32"):
        gdn_recurrent(q, k, v, g, beta, torch.zeros(HV, V, K, dtype=torch.bfloat16))


def test_causal_conv1d_reference_and_split():
    x = torch.randn(50, 96).bfloat16()
    w = torch.randn(96, 4).bfloat16()
    st0 = torch.zeros(3, 96).bfloat16()
    y, st = causal_conv1d(x, w, st0)
    torch.testing.assert_close(y.double(), naive_causal_conv1d(x, w, st0), rtol=1e-2, atol=2e-2)
    y1, s1 = causal_conv1d(x[:17], w, st0)
    y2, s2 = causal_conv1d(x[17:], w, s1)
    assert torch.equal(torch.cat([y1, y2]), y) and torch.equal(s2, st)


def _conv_per_token(x, w, st0):
    """The conv written out per sequence (the pre-varlen implementation): fp32 taps added in order w = 0..W-1."""
    W = w.shape[-1]
    xe = torch.cat([st0.to(x.dtype), x]).float()
    acc = xe[0 : x.shape[0]] * w.float()[:, 0]
    for j in range(1, W):
        acc = acc + xe[j : j + x.shape[0]] * w.float()[:, j]
    return pointwise.silu(acc).to(x.dtype), xe[-(W - 1) :].to(x.dtype)


def test_causal_conv1d_varlen_is_per_sequence_exact():
    """Packed sequences (one gather per tap, no loop) give every sequence the bits it gets alone and the bits
    of the per-sequence formula; also with sequences shorter than the conv window."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 1, 70, 2, 3]
    x = torch.randn(sum(lens), 96, generator=gen).bfloat16()
    w = torch.randn(96, 4, generator=gen).bfloat16()
    states = torch.randn(len(lens), 3, 96, generator=gen).bfloat16()
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    y, new = causal_conv1d_varlen(x, cu, w, states)
    for j in range(len(lens)):
        s, e = cu[j], cu[j + 1]
        y1, st1 = causal_conv1d(x[s:e], w, states[j])
        ref_y, ref_st = _conv_per_token(x[s:e], w, states[j])
        assert torch.equal(y[s:e], y1) and torch.equal(new[j], st1), f"sequence {j} depends on the batch"
        assert torch.equal(y1, ref_y) and torch.equal(st1, ref_st), f"sequence {j} differs from the formula"


def test_gradients_match_float64_reference():
    """Backward of the recurrence (autograd through the fp32 forward) vs autograd of the float64
    reference; tolerance: relative L2 error <= 1e-4 per input (T=40)."""
    torch.manual_seed(1)
    q, k, v, A_log, a, b, dt_bias = _inputs(40)
    s0 = torch.randn(HV, V, K) * 0.1
    leaves32 = [t.clone().requires_grad_(True) for t in (q, k, v, A_log, a, b, dt_bias, s0)]
    q1, k1, v1, A1, a1, b1, d1, s1 = leaves32
    g, beta = gdn_gating(A1, a1, b1, d1)
    o, s = gdn_recurrent(q1, k1, v1, g, beta, s1)
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    leaves64 = [t.double().clone().requires_grad_(True) for t in (q, k, v, A_log, a, b, dt_bias, s0)]
    o64, s64 = naive_gdn(*leaves64[:7], leaves64[7])
    ((o64 * w_o.double()).sum() + (s64 * w_s.double()).sum()).backward()
    for name, t32, t64 in zip("q k v A_log a b dt_bias state".split(), leaves32, leaves64):
        rel = ((t32.grad.double() - t64.grad).norm() / t64.grad.norm()).item()
        assert rel <= 1e-4, f"d/d{name}: relative error {rel:.2e}"


def test_varlen_entry_point_on_cpu():
    from vllm_bi.gdn.recurrent import gdn_recurrent_varlen

    seqs = [_inputs(T) for T in (7, 1, 30)]
    packed = [torch.cat([s[i] for s in seqs]) for i in range(7)]
    q, k, v, A_log, a, b, dt_bias = packed
    A_log, dt_bias = seqs[0][3], seqs[0][6]
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    states = torch.randn(3, HV, V, K) * 0.1
    o, fin = gdn_recurrent_varlen(q, k, v, g, beta, states, [0, 7, 8, 38])
    o1, s1 = gdn_recurrent(q[8:], k[8:], v[8:], g[8:], beta[8:], states[2])
    assert torch.equal(o[8:], o1) and torch.equal(fin[2], s1)
    import pytest

    with pytest.raises(ValueError, match="explicit fp32 states"):
        gdn_recurrent_varlen(q, k, v, g, beta, None, [0, 38])


def _channel_gate(T=T):
    """A log decay per key channel (Kimi Delta Attention's gate), in the range GDN's per-head gate takes."""
    return -torch.rand(T, HV, K) * 0.5


def test_channel_wise_gate_matches_float64_reference():
    """The recurrence with a decay per key channel against the float64 delta rule (2e-4 absolute, as above); fed
    GDN's float64 gating, the delta rule gives ``naive_gdn``'s values (1e-12)."""
    from vllm_bi.gdn.naive import naive_delta_rule

    q, k, v, A_log, a, b, dt_bias = _inputs()
    s0 = torch.randn(HV, V, K) * 0.1
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    o_ref, s_ref = naive_gdn(q, k, v, A_log, a, b, dt_bias, s0)
    g64 = -torch.exp(A_log.double()) * torch.log1p(torch.exp(a.double() + dt_bias.double()))  # naive_gdn's gating
    o_dr, s_dr = naive_delta_rule(q, k, v, g64, torch.sigmoid(b.double()), s0)
    torch.testing.assert_close(o_dr, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(s_dr, s_ref, rtol=0, atol=1e-12)
    gk = _channel_gate()
    o, s = gdn_recurrent(q, k, v, gk, beta, s0)
    o_ref, s_ref = naive_delta_rule(q, k, v, gk, beta, s0)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=2e-4)


def test_channel_wise_gate_split_is_exact_and_equal_channels_give_the_head_gates_bits():
    q, k, v, A_log, a, b, dt_bias = _inputs(64)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    zero = torch.zeros(HV, V, K)
    gk = _channel_gate(64)
    o, s = gdn_recurrent(q, k, v, gk, beta, zero)
    o1, s1 = gdn_recurrent(q[:40], k[:40], v[:40], gk[:40], beta[:40], zero)
    o2, s2 = gdn_recurrent(q[40:], k[40:], v[40:], gk[40:], beta[40:], s1)
    assert torch.equal(torch.cat([o1, o2]), o) and torch.equal(s2, s)
    head, _ = gdn_recurrent(q, k, v, g, beta, zero)
    same, _ = gdn_recurrent(q, k, v, g[..., None].expand(64, HV, K).contiguous(), beta, zero)
    assert torch.equal(same, head)
    g_one = g[..., None].expand(64, HV, K).clone()
    g_one[:, :, 0] -= 0.25  # control: one channel decays faster
    other, _ = gdn_recurrent(q, k, v, g_one, beta, zero)
    assert not torch.equal(other, head)


def test_torch_varlen_takes_a_channel_wise_gate():
    """``gdn_torch_varlen`` (fla-core's layout, the backward's fallback) with ``g [1, T, HV, K]`` in float64 against
    the float64 delta rule, two packed sequences (1e-10)."""
    from vllm_bi.gdn.naive import naive_delta_rule
    from vllm_bi.gdn.recurrent import gdn_torch_varlen

    q, k, v, A_log, a, b, dt_bias = (x.double() for x in _inputs(50))
    g, beta = (x.double() for x in gdn_gating(A_log, a, b, dt_bias))
    gk = _channel_gate(50).double()
    h0 = torch.randn(2, HV, K, V, dtype=torch.float64) * 0.1
    cu = torch.tensor([0, 20, 50])
    o, ht = gdn_torch_varlen(q[None], k[None], v[None], gk[None], beta[None], h0, cu, K**-0.5)
    for i, (s, e) in enumerate([(0, 20), (20, 50)]):
        o_ref, s_ref = naive_delta_rule(q[s:e], k[s:e], v[s:e], gk[s:e], beta[s:e], h0[i].transpose(-1, -2))
        torch.testing.assert_close(o[0, s:e], o_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(ht[i].transpose(-1, -2), s_ref, rtol=0, atol=1e-10)


def test_kda_gating_matches_float64():
    """Kimi Delta Attention's gate per key channel, with and without its lower bound, against the float64 formulas
    (1e-6 relative and 1e-9 absolute: fp32 pointwise ops, whose softplus of a very negative input is off by up to
    ~4e-10); values above softplus's threshold take the identity, as torch's does;
    the bounded gate stays in [lower_bound, 0]."""
    from vllm_bi.gdn.recurrent import kda_gating

    Hk, Kk = 3, 16
    A_log = torch.log(torch.rand(Hk) * 15 + 1)
    a = torch.randn(40, Hk, Kk) * 4
    a[0, 0, 0] = 30.0  # above the threshold
    b, dt_bias = torch.randn(40, Hk), torch.rand(Hk * Kk) - 0.5
    x = a.double() + dt_bias.double().view(Hk, Kk)
    rate = torch.exp(A_log.double()).view(Hk, 1)
    g, beta = kda_gating(A_log, a, b, dt_bias)
    ref = -rate * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(beta.double(), torch.sigmoid(b.double()), rtol=1e-6, atol=0)
    gb, _ = kda_gating(A_log, a, b, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(gb.double(), -5.0 * torch.sigmoid(rate * x), rtol=1e-6, atol=1e-9)
    assert bool(((gb >= -5.0) & (gb <= 0.0)).all())
    assert g.shape == (40, Hk, Kk) and g.dtype == torch.float32
