"""GDN recurrence: float64 reference, and exactness of splits, decode steps and batching.

Tolerance vs the float64 reference: 2e-4 absolute on fp32 outputs of unit scale
(the recurrence runs in fp32 over 200 tokens).
"""

import torch

from vllm_bi.attention.gdn_naive import naive_causal_conv1d, naive_gdn
from vllm_bi.attention.gdn_recurrent import causal_conv1d, gdn_gating, gdn_recurrent

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
