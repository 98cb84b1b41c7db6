"""Kimi Delta Attention's core through the GDN layer (``gdn.layer`` with ``gating="kda"``: a log decay per key
channel), on CPU, in the recurrent and chunk-aligned modes: against the float64 reference, a packed batch == each
sequence alone, a sequence in two steps == in one (exact; in the chunk mode, resumed at block boundaries), gradients
against float64, and what it does not run refused by name."""

import pytest
import torch

from vllm_bi.gdn.chunk import gdn_chunk_aligned, gdn_chunk_varlen
from vllm_bi.gdn.layer import causal_conv1d, gdn_sequence, gdn_varlen
from vllm_bi.gdn.naive import naive_kda
from vllm_bi.gdn.recurrent import kda_gating

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


def test_kda_refuses_what_it_does_not_run():
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(8)
    with pytest.raises(ValueError, match="gating 'mamba'"):
        gdn_varlen(x, [(0, 8)], w, conv, A_log, a, b, dt_bias, states, H, D, D, gating="mamba")
    with pytest.raises(ValueError, match="GDN mode 'hybrid'"):
        gdn_varlen(x, [(0, 8)], w, conv, A_log, a, b, dt_bias, states, H, D, D, mode="hybrid", gating="kda")


# ----------------------------------------------------------------------------------------------- chunk-aligned mode
# The chunk mode's blocks (gdn/chunk.py) with the decay per key channel inside the sums over K.

def _gated(T, seed, lower_bound=-5.0):
    """l2-normalisable q, k, v [T, H, D], KDA's g [T, H, D] and beta [T, H], fp32, and a start state."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    a = torch.randn(T, H, D, generator=gen) * 2
    b = torch.randn(T, H, generator=gen)
    A_log = torch.log(torch.rand(H, generator=gen) * 8 + 1)
    dt_bias = torch.rand(H * D, generator=gen) - 0.5
    g, beta = kda_gating(A_log, a, b, dt_bias, lower_bound)
    s0 = torch.randn(H, D, D, generator=gen) * 0.1
    return (q, k, v, g, beta), (q, k, v, A_log, a, b, dt_bias), s0


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_chunk_matches_float64(lower_bound):
    """150 tokens (two whole blocks of 64 and a partial one) against the float64 recurrence: outputs and the final
    state within 2e-4 absolute (the recurrent mode's tolerance), the boundary state (position 128) too."""
    x, raw, s0 = _gated(150, 3, lower_bound)
    o, boundary, final = gdn_chunk_aligned(*x, s0)
    o_ref, s_ref = naive_kda(*raw, s0, lower_bound)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(final.double(), s_ref, rtol=0, atol=2e-4)
    _, s_128 = naive_kda(*(t[:128] for t in raw[:3]), raw[3], *(t[:128] for t in raw[4:6]), raw[6], s0, lower_bound)
    torch.testing.assert_close(boundary.double(), s_128, rtol=0, atol=2e-4)


def test_kda_chunk_resumed_at_boundaries_and_decodes_are_exact_and_a_shifted_grid_differs():
    """Exact wherever the block grid stays at absolute multiples of 64: a prefill split anywhere that resumes from the
    last boundary, and decode steps that recompute their partial block; a packed batch == each sequence alone.
    Control: blocks started 10 tokens off the grid give the same numbers within 2e-4 but other bits."""
    x, _, s0 = _gated(150, 4)

    def run(lo, hi, st):
        return gdn_chunk_aligned(*(t[lo:hi] for t in x), st)

    o, _, _ = run(0, 150, s0)
    o_a, b_a, _ = run(0, 100, s0)  # a prefill split at 100 resumes at the boundary 64
    o_b, b_b, _ = run(64, 150, b_a)
    assert torch.equal(o_a, o[:100]) and torch.equal(o_b, o[64:])
    for t in range(128, 136):  # decodes recompute their partial block from the boundary at 128
        assert torch.equal(run(128, t + 1, b_b)[0][-1], o[t]), t
    cu = [0, 150, 190, 230]
    x2, _, _ = _gated(230, 5)
    packed, bounds = gdn_chunk_varlen(*x2, torch.stack([s0, s0 * 0, s0 * 2]), cu)
    for j, st in enumerate((s0, s0 * 0, s0 * 2)):
        alone, bj, _ = gdn_chunk_aligned(*(t[cu[j] : cu[j + 1]] for t in x2), st)
        assert torch.equal(packed[cu[j] : cu[j + 1]], alone) and torch.equal(bounds[j], bj), j
    _, _, s_10 = run(0, 10, s0)
    shifted, _, _ = run(10, 150, s_10)
    torch.testing.assert_close(shifted, o[10:], rtol=0, atol=2e-4)
    assert not torch.equal(shifted, o[10:]), "control: a grid off the absolute positions should change the bits"


def test_kda_chunk_through_the_layer_and_its_control():
    """``gdn_varlen(mode="chunk", gating="kda")`` (the trainer's call and the CPU server's) == the chunked core on the
    conv's output; a per-channel decay replaced by its per-head mean changes the bits."""
    x, a, b, w, A_log, dt_bias, conv, states = _inputs(70, seed=6)
    zeros_c, zeros_s = torch.zeros(1, W - 1, 3 * P).bfloat16(), torch.zeros(1, H, D, D)
    o, _, bound = gdn_varlen(x, [(0, 70)], w, zeros_c, A_log, a, b, dt_bias, zeros_s, H, D, D, mode="chunk",
                             gating="kda", lower_bound=-5.0, packed=True)
    y, _ = causal_conv1d(x, w, zeros_c[0])
    q, k, v = (y[:, i * P : (i + 1) * P].reshape(70, H, D) for i in range(3))
    g, beta = kda_gating(A_log, a, b, dt_bias, -5.0)
    want, want_bound, _ = gdn_chunk_aligned(q, k, v, g, beta, zeros_s[0])
    assert torch.equal(o, want) and torch.equal(bound[0], want_bound)
    mean = a.float().mean(-1, keepdim=True).expand_as(a).bfloat16()
    o_mean, _, _ = gdn_varlen(x, [(0, 70)], w, zeros_c, A_log, mean, b, dt_bias, zeros_s, H, D, D, mode="chunk",
                              gating="kda", lower_bound=-5.0, packed=True)
    assert not torch.equal(o_mean, o), "control: the per-channel decay should matter"


def test_kda_chunk_gradients_match_float64():
    """Autograd through the per-channel blocks (the trainer's path in this mode) against float64 autograd through
    the reference recurrence, 80 tokens (a whole block and a partial one): each input's gradient within 1e-3 of the
    reference gradient's largest magnitude."""
    _, raw, s0 = _gated(80, 7)
    q, k, v, A_log, a, b, dt_bias = raw
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, a, b)]
    s0 = s0.clone().requires_grad_(True)
    g, beta = kda_gating(A_log, leaves[3], leaves[4], dt_bias, -5.0)
    o, _, final = gdn_chunk_aligned(leaves[0], leaves[1], leaves[2], g, beta, s0)
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    s64 = s0.detach().double().requires_grad_(True)
    o_ref, s_ref = naive_kda(*ref[:3], A_log, ref[3], ref[4], dt_bias, s64, -5.0)
    gen = torch.Generator().manual_seed(8)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
    ((o * w_o).sum() + (final * w_s).sum()).backward()
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    for name, mine, want in zip(("q", "k", "v", "a", "b", "state"), leaves + [s0], ref + [s64]):
        scale = want.grad.abs().max().item()
        err = (mine.grad.double() - want.grad).abs().max().item()
        assert err <= 1e-3 * scale, f"d{name}: max err {err:.3g} vs max |grad| {scale:.3g}"
