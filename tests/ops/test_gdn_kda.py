"""Kimi Delta Attention's core through the GDN layer (``gdn.layer`` with ``gating="kda"``: a log decay per key
channel), on CPU: against the float64 reference, a packed batch == each sequence alone, a sequence in two steps ==
in one (exact), and the modes it does not run refused by name."""

import pytest
import torch

from vllm_bi.gdn.layer import causal_conv1d, gdn_sequence, gdn_varlen
from vllm_bi.gdn.naive import naive_kda

H, D, W = 2, 32, 4  # Kimi Linear's KDA: as many key as value heads, one head dim for q, k and v
P = H * D


def _inputs(T, seed=0, n=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 3 * P, generator=g).bfloat16()
    a = (torch.randn(T, H, D, generator=g) * 2).bfloat16()  # f_b_proj(f_a), per key channel
    b = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(3 * P, W, generator=g) * 0.4).float()  # vLLM keeps the KDA conv weight in fp32
    A_log = torch.log(torch.rand(H, generator=g) * 8 + 1)
    dt_bias = torch.rand(H * D, generator=g) - 0.5
    conv = torch.randn(n, W - 1, 3 * P, generator=g).bfloat16()
    states = torch.randn(n, H, D, D, generator=g) * 0.1
    return x, a, b, w, A_log, dt_bias, conv, states


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_sequence_matches_float64(lower_bound):
    """The gating and the recurrence against the float64 formulas on the same conv output (2e-4 absolute on outputs
    and states of magnitude ~1, fp32 arithmetic over 48 steps); the conv's own accuracy is tested with GDN's."""
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(48)
    o, _, st = gdn_sequence(x, w, conv[0], A_log, a, b, dt_bias, states[0], H, D, D, gating="kda",
                            lower_bound=lower_bound)
    y, _ = causal_conv1d(x, w, conv[0])
    q, k, v = (y[:, i * P : (i + 1) * P].reshape(48, H, D) for i in range(3))
    o_ref, s_ref = naive_kda(q, k, v, A_log, a, b, dt_bias, states[0], lower_bound)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(st.double(), s_ref, rtol=0, atol=2e-4)


def test_kda_packed_batch_equals_each_sequence_alone():
    """Four sequences packed in order, and the same four given out of order: each one's output, conv state and state
    equal its run alone bit for bit."""
    lens = [5, 1, 9, 3]
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(sum(lens), seed=1, n=4)
    conv[1], states[1] = 0, 0  # a new sequence
    ranges, s = [], 0
    for n in lens:
        ranges.append((s, s + n))
        s += n
    args = (w, conv, A_log, a, b, dt_bias, states, H, D, D)
    outs, new_conv, new_states = gdn_varlen(x, ranges, *args, gating="kda", lower_bound=-5.0)
    for j, (s, e) in enumerate(ranges):
        o, c, st = gdn_sequence(x[s:e], w, conv[j], A_log, a[s:e], b[s:e], dt_bias, states[j], H, D, D, gating="kda",
                                lower_bound=-5.0)
        assert torch.equal(outs[j], o) and torch.equal(new_conv[j], c) and torch.equal(new_states[j], st), j
    shuffled = [ranges[2], ranges[0], ranges[3], ranges[1]]
    order = [2, 0, 3, 1]
    outs2, _, st2 = gdn_varlen(x, shuffled, w, conv[order], A_log, a, b, dt_bias, states[order], H, D, D,
                               gating="kda", lower_bound=-5.0)
    for i, j in enumerate(order):
        assert torch.equal(outs2[i], outs[j]) and torch.equal(st2[i], new_states[j]), j


def test_kda_two_steps_equal_one_and_the_controls_differ():
    """A prompt's prefill in two steps (the conv state and the fp32 state carried) == in one, and a decode after it ==
    the same token inside a longer prefill: exact. Controls: the state carried in bf16 across the split, and the
    per-channel decay replaced by its per-head mean, each change the bits."""
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(40, seed=2)
    c0, s0 = torch.zeros(W - 1, 3 * P).bfloat16(), torch.zeros(H, D, D)

    def run(lo, hi, c, s, aa=a):
        return gdn_sequence(x[lo:hi], w, c, A_log, aa[lo:hi], b[lo:hi], dt_bias, s, H, D, D, gating="kda")

    o, c, s = run(0, 40, c0, s0)
    o1, c1, s1 = run(0, 23, c0, s0)
    o2, c2, s2 = run(23, 39, c1, s1)
    o3, _, s3 = run(39, 40, c2, s2)
    assert torch.equal(torch.cat([o1, o2, o3]), o) and torch.equal(s3, s)
    o2_bf16, _, _ = run(23, 39, c1, s1.bfloat16().float())
    assert not torch.equal(o2_bf16, o2), "control: a bf16 state at the split should change the bits"
    mean = a.float().mean(-1, keepdim=True).expand_as(a).bfloat16()
    assert not torch.equal(run(0, 40, c0, s0, mean)[0], o), "control: the per-channel decay should matter"


def test_kda_refuses_the_modes_it_does_not_run():
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(8)
    with pytest.raises(ValueError, match="VLLM_BI_GDN_MODE=recurrent"):
        gdn_varlen(x, [(0, 8)], w, conv, A_log, a, b, dt_bias, states, H, D, D, mode="chunk", gating="kda")
    with pytest.raises(ValueError, match="gating 'mamba'"):
        gdn_varlen(x, [(0, 8)], w, conv, A_log, a, b, dt_bias, states, H, D, D, gating="mamba")
