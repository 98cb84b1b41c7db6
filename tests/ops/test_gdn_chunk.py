"""Chunk-aligned GDN (``gdn/chunk.py``): the specification of the performance mode, on CPU.

* matches the independent float64 reference within 2e-4 absolute (fp32 arithmetic over 200 tokens, the
  recurrent mode's tolerance), outputs and final state;
* exact (``torch.equal``) wherever the block grid stays at absolute multiples of the block size: a prefill
  split at a boundary, a prefill split anywhere that resumes from the last boundary, and decode steps that
  recompute their partial block from the boundary state;
* negative control: a grid shifted off the absolute positions changes the bits.
"""

import torch

from vllm_bi.gdn.chunk import gdn_chunk_aligned
from vllm_bi.gdn.naive import naive_gdn
from vllm_bi.gdn.recurrent import gdn_gating

T, H, HV, K, V, C = 200, 1, 2, 128, 128, 64


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    dt_bias = torch.rand(HV, generator=gen) - 0.5
    s0 = torch.randn(HV, V, K, generator=gen) * 0.1
    return q, k, v, A_log, a, b, dt_bias, s0


def _run(x, s, e, state):
    q, k, v, g, beta = x
    return gdn_chunk_aligned(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state, chunk=C)


def test_matches_float64_reference():
    q, k, v, A_log, a, b, dt_bias, s0 = _inputs()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    o, boundary, final = gdn_chunk_aligned(q, k, v, g, beta, s0, chunk=C)
    o_ref, s_ref = naive_gdn(q, k, v, A_log, a, b, dt_bias, s0)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(final.double(), s_ref, rtol=0, atol=2e-4)
    _, s_192 = naive_gdn(q[:192], k[:192], v[:192], A_log, a[:192], b[:192], dt_bias, s0)
    torch.testing.assert_close(boundary.double(), s_192, rtol=0, atol=2e-4)  # last boundary: 3 * 64


def test_aligned_splits_and_partial_block_decode_are_exact():
    q, k, v, A_log, a, b, dt_bias, s0 = _inputs(1)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    x = (q, k, v, g, beta)
    o, boundary, final = _run(x, 0, T, s0)
    # prefill split at a boundary, state handed over
    o1, b1, _ = _run(x, 0, 128, s0)
    o2, b2, f2 = _run(x, 128, T, b1)
    assert torch.equal(torch.cat([o1, o2]), o) and torch.equal(b2, boundary) and torch.equal(f2, final)
    # prefill split anywhere (100): the second part resumes from the last boundary (64), its first tokens
    # recomputed, exactly as a chunk-aligned cache would do
    o_a, b_a, _ = _run(x, 0, 100, s0)
    o_b, _, _ = _run(x, 64, T, b_a)
    assert torch.equal(o_a, o[:100]) and torch.equal(o_b, o[64:])
    # decode: each new token recomputes its partial block from the boundary state
    for t in range(128, 150):
        o_t, _, _ = _run(x, 128, t + 1, b1)
        assert torch.equal(o_t[-1], o[t]), f"decode step at position {t} differs"


def test_negative_control_a_shifted_grid_changes_the_bits():
    q, k, v, A_log, a, b, dt_bias, s0 = _inputs(2)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    x = (q, k, v, g, beta)
    o, _, _ = _run(x, 0, T, s0)
    _, _, s_10 = _run(x, 0, 10, s0)  # state after 10 tokens, then blocks at 10, 74, 138: off the grid
    o_shift, _, _ = _run(x, 10, T, s_10)
    torch.testing.assert_close(o_shift, o[10:], rtol=0, atol=2e-4)  # same math
    assert not torch.equal(o_shift, o[10:])  # other bits


def test_gradients_match_float64_reference():
    """Autograd through the chunked form (the trainer's path in this mode) vs float64 autograd through the
    reference: each input's gradient within 1e-3 of the reference gradient's largest magnitude."""
    q, k, v, A_log, a, b, dt_bias, s0 = _inputs(3)
    n = 80  # one full block and a partial one
    leaves = [t[:n].clone().requires_grad_(True) for t in (q, k, v, a, b)]
    s0 = s0.clone().requires_grad_(True)
    g, beta = gdn_gating(A_log, leaves[3], leaves[4], dt_bias)
    o, _, final = gdn_chunk_aligned(leaves[0], leaves[1], leaves[2], g, beta, s0, chunk=C)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    s064 = s0.detach().double().requires_grad_(True)
    o_ref, s_ref = naive_gdn(*ref_leaves[:3], A_log, ref_leaves[3], ref_leaves[4], dt_bias, s064)
    gen = torch.Generator().manual_seed(4)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
    ((o * w_o).sum() + (final * w_s).sum()).backward()
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    for name, mine, ref in zip(("q", "k", "v", "a", "b", "state"), leaves + [s0], ref_leaves + [s064]):
        scale = ref.grad.abs().max().item()
        err = (mine.grad.double() - ref.grad).abs().max().item()
        assert err <= 1e-3 * scale, f"d{name}: max err {err:.3g} vs max |grad| {scale:.3g}"
