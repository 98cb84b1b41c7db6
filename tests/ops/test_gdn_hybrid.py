"""The hybrid GDN arithmetic (``gdn_chunk.gdn_hybrid_varlen``), on CPU: a prompt's whole blocks in the
chunk-aligned arithmetic, its tail and every generated token in the recurrence from the boundary state.

* exact (``torch.equal``): it is the chunk-aligned form over ``[0, B)`` then the recurrence from the state at
  ``B`` (``B`` = the prompt's last block boundary), whatever the batch; and the steps a server takes (a prompt
  split mid-block and resumed from its last boundary, the switch inside a step, one-token decodes from the
  full state, a preempted request recomputed in one prefill) give the one-shot (trainer's) bits;
* gradients through the hand-over from chunk rows to recurrent rows within 1e-3 of float64 autograd through
  the plain recurrence (relative to each gradient's largest magnitude);
* bad splits are refused by name.
"""

import pytest
import torch

from vllm_bi.gdn.chunk import CHUNK, gdn_chunk_aligned, gdn_chunk_varlen, gdn_hybrid_varlen, hybrid_chunk_rows
from vllm_bi.gdn.naive import naive_gdn
from vllm_bi.gdn.recurrent import gdn_gating, gdn_recurrent

H, HV, K, V = 1, 2, 32, 32


def _inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    dt_bias = torch.rand(HV, generator=gen) - 0.5
    return q, k, v, A_log, a, b, dt_bias


def _qkvgb(T, seed=0):
    q, k, v, A_log, a, b, dt_bias = _inputs(T, seed)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    return q, k, v, g, beta


def _hybrid(x, s, e, state, chunk_rows):
    q, k, v, g, beta = (t[s:e] for t in x)
    return gdn_hybrid_varlen(q, k, v, g, beta, state[None], [0, e - s], [chunk_rows])


def test_the_split_is_the_prompts_last_block_boundary():
    assert [hybrid_chunk_rows(150), hybrid_chunk_rows(150, 64), hybrid_chunk_rows(150, 128)] == [128, 64, 0]
    assert [hybrid_chunk_rows(150, 151), hybrid_chunk_rows(64), hybrid_chunk_rows(63)] == [0, 64, 0]
    assert [hybrid_chunk_rows(150, 0, 100), hybrid_chunk_rows(150, 64, 10), hybrid_chunk_rows(150, 64, 90)] == [100, 10, 64]


def test_chunk_rows_then_the_recurrence_from_the_boundary_state():
    x = _qkvgb(170)
    s0 = torch.zeros(HV, V, K)
    o, st = _hybrid(x, 0, 170, s0, 128)
    o_c, bound, _ = gdn_chunk_aligned(*(t[:128] for t in x), s0, chunk=CHUNK)
    o_r, final = gdn_recurrent(*(t[128:] for t in x), bound)
    assert torch.equal(o, torch.cat([o_c, o_r])) and torch.equal(st[0], final)
    # all rows in the chunk arithmetic, ending mid-block: the chunk mode's boundary state comes back
    o2, st2 = _hybrid(x, 0, 100, s0, 100)
    o_c2, bound2, _ = gdn_chunk_aligned(*(t[:100] for t in x), s0, chunk=CHUNK)
    assert torch.equal(o2, o_c2) and torch.equal(st2[0], bound2)


@pytest.mark.parametrize("lens,splits", [
    ([170, 40, 128, 65, 1], [128, 0, 128, 64, 0]),  # mixed: rows gathered per arithmetic
    ([128, 64, 100], [128, 64, 100]),  # whole prompts only (the op's no-gather path for every row chunked)
    ([3, 1, 7], [0, 0, 0]),  # generated tokens only (the no-gather path for every row recurrent)
])
def test_a_sequences_bits_do_not_depend_on_its_batch(lens, splits):
    """Each sequence alone (one-sequence calls, some of them the op's shortcut paths) gives the bits it has in
    the batch."""
    x = _qkvgb(sum(lens), 1)
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(len(lens), HV, V, K, generator=gen) * 0.1
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    o, st = gdn_hybrid_varlen(*x, states, cu, splits)
    for j in range(len(lens)):
        o_j, st_j = _hybrid(x, cu[j], cu[j + 1], states[j], splits[j])
        assert torch.equal(o[cu[j] : cu[j + 1]], o_j) and torch.equal(st[j], st_j[0]), f"sequence {j}"
    # whole prompts: the first sequence again beside one that switches arithmetic (the general path), same bits
    if len(lens) > 1 and splits[0] == lens[0] and lens[0] >= CHUNK:
        o2, st2 = gdn_hybrid_varlen(*(torch.cat([t[: lens[0]], t[: CHUNK + 2]]) for t in x), states[[0, 1]],
                                    [0, lens[0], lens[0] + CHUNK + 2], [lens[0], CHUNK])
        assert torch.equal(o2[: lens[0]], o[: lens[0]]) and torch.equal(st2[0], st[0])


def test_server_steps_give_the_trainer_bits():
    """Prompt of 150 tokens (B = 128), 20 generated: the trainer's one call vs a server's steps."""
    P, L = 150, 170
    x = _qkvgb(L, 3)
    s0 = torch.zeros(HV, V, K)
    o_all, final = _hybrid(x, 0, L, s0, hybrid_chunk_rows(P))
    # step 1: the first 100 prompt tokens (all before B): chunk rows; the slot keeps the boundary state at 64
    o1, st = _hybrid(x, 0, 100, s0, hybrid_chunk_rows(P, 0, 100))
    assert torch.equal(o1, o_all[:100])
    # step 2: the prompt's rest, resumed from the boundary at 64 (rows 64..99 recomputed and dropped); the
    # arithmetic switches at 128 inside the step; the slot then keeps the full state after 150
    o2, st = _hybrid(x, 64, P, st[0], hybrid_chunk_rows(P, 64))
    assert torch.equal(o2[100 - 64 :], o_all[100:P])
    # decodes: one token each from the full state, no recomputation
    for t in range(P, L):
        o_t, st = _hybrid(x, t, t + 1, st[0], hybrid_chunk_rows(P, t, 1))
        assert torch.equal(o_t, o_all[t : t + 1]), f"decode at {t}"
    assert torch.equal(st, final)
    # a preempted request recomputed in one prefill of prompt and generated tokens: split at B again
    o_re, _ = _hybrid(x, 0, 165, s0, hybrid_chunk_rows(P))
    assert torch.equal(o_re, o_all[:165])


def test_negative_control_the_switch_point_matters():
    """The two arithmetics differ in bits (else this mode would be pointless to pin down): moving the switch
    from 128 to 64 changes rows 64..127."""
    x = _qkvgb(170, 4)
    s0 = torch.zeros(HV, V, K)
    o128, _ = _hybrid(x, 0, 170, s0, 128)
    o64, _ = _hybrid(x, 0, 170, s0, 64)
    assert torch.equal(o128[:64], o64[:64]) and not torch.equal(o128[64:128], o64[64:128])


def test_gradients_through_the_hand_over_match_float64_reference():
    T, split = 90, 64
    q, k, v, A_log, a, b, dt_bias = _inputs(T, 5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, a, b)]
    g, beta = gdn_gating(A_log, leaves[3], leaves[4], dt_bias)
    o, st = gdn_hybrid_varlen(leaves[0], leaves[1], leaves[2], g, beta, torch.zeros(1, HV, V, K), [0, T], [split])
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    o_ref, s_ref = naive_gdn(*ref_leaves[:3], A_log, ref_leaves[3], ref_leaves[4], dt_bias,
                             torch.zeros(HV, V, K, dtype=torch.float64))
    gen = torch.Generator().manual_seed(6)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(st[0].shape, generator=gen)
    ((o * w_o).sum() + (st[0] * w_s).sum()).backward()
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    for name, mine, ref in zip(("q", "k", "v", "a", "b"), leaves, ref_leaves):
        scale = ref.grad.abs().max().item()
        err = (mine.grad.double() - ref.grad).abs().max().item()
        assert err <= 1e-3 * scale, f"d{name}: max err {err:.3g} vs max |grad| {scale:.3g}"


def test_output_gradients_take_one_chunked_pass_over_whole_sequences():
    """When only the output carries a gradient (the trainer drops the states), the backward differentiates the
    chunked form over each whole sequence (one pass, not one per arithmetic): the gradients are exactly those
    of gdn_chunk_varlen over the same rows, within 1e-3 of float64 autograd through the plain recurrence
    (relative to each gradient's largest magnitude), and the forward's bits are the hybrid's."""
    lens, splits = [90, 40, 130], [64, 0, 128]
    T = sum(lens)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v, A_log, a, b, dt_bias = _inputs(T, 7)
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(T, HV, V, generator=gen)
    states = torch.randn(len(lens), HV, V, K, generator=gen) * 0.1

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, a, b)]
        s0 = states.clone().requires_grad_(True)
        g, beta = gdn_gating(A_log, leaves[3], leaves[4], dt_bias)
        o = fn(leaves[0], leaves[1], leaves[2], g, beta, s0)
        (o * w).sum().backward()
        return o.detach(), [t.grad for t in (*leaves, s0)]

    o, mine = grads(lambda *x: gdn_hybrid_varlen(*x, cu, splits)[0])
    o_c, whole = grads(lambda *x: gdn_chunk_varlen(*x, cu)[0])
    with torch.no_grad():
        assert torch.equal(o, gdn_hybrid_varlen(*_qkvgb(T, 7), states, cu, splits)[0])  # the same inputs, no grad
    assert not torch.equal(o, o_c)  # other bits forward (the arithmetics differ) ...
    for name, gm, gw in zip(("q", "k", "v", "a", "b", "state"), mine, whole):
        assert torch.equal(gm, gw), f"d{name}"  # ... the same backward
    # and that backward is the gradient of the math: float64 reference per sequence
    for j, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        ref = [t[s:e].detach().double().requires_grad_(True) for t in (q, k, v, a, b)]
        s_ref = states[j].double().requires_grad_(True)
        o_ref, _ = naive_gdn(*ref[:3], A_log, ref[3], ref[4], dt_bias, s_ref)
        (o_ref * w[s:e].double()).sum().backward()
        for name, gm, gr in zip(("q", "k", "v", "a", "b", "state"), mine, (*ref, s_ref)):
            part = gm[j] if name == "state" else gm[s:e]
            scale = gr.grad.abs().max().item()
            err = (part.double() - gr.grad).abs().max().item()
            assert err <= 1e-3 * scale, f"sequence {j} d{name}: max err {err:.3g} vs max |grad| {scale:.3g}"


@pytest.mark.parametrize("splits,match", [([70], "multiple of 64"), ([200], r"in \[0, 170\]"),
                                          ([64, 0], "2 chunk_rows for 1 sequences")])
def test_bad_splits_are_refused(splits, match):
    x = _qkvgb(170)
    with pytest.raises(ValueError, match=match):
        gdn_hybrid_varlen(*x, torch.zeros(1, HV, V, K), [0, 170], splits)
