"""The chunk-aligned mode's CUDA orchestration (``gdn_chunk._chunk_varlen_cuda``) on CPU.

On CUDA each call makes two fla-core chunked launches: the whole 64-token blocks of every sequence (whose
final states become the boundary states), then the partial blocks from those states. Here fla-core's kernel
is replaced by ``gdn_torch_varlen`` (the same op in torch, fla-core's layout and conventions) in float64, so
the test checks the splitting, packing, state hand-over and gradient flow against the plain recurrence over
whole sequences: mathematically equal, so float64 results must agree to 1e-10 (outputs, boundary states)
and 1e-9 (gradients). The bits of fla-core's kernel are the GPU tests' business
(``tests/gpu/test_gdn_chunk_cuda.py``).
"""

import pytest
import torch

from vllm_bi.gdn import chunk as gdn_chunk, recurrent as gdn_recurrent
from vllm_bi.gdn.recurrent import gdn_torch_varlen

H, HV, K, V = 1, 2, 8, 8
LENS = [70, 5, 64, 130, 1, 128]


@pytest.fixture
def torch_kernel(monkeypatch):
    calls = []

    def fake_fla_chunk(q, k, v, g, beta, h0, cu, scale):
        calls.append([int(x) for x in cu])
        return gdn_torch_varlen(q, k, v, g, beta, h0, cu, scale)

    monkeypatch.setitem(gdn_recurrent._FLA_FORWARDS, "chunk", fake_fla_chunk)
    monkeypatch.setattr(gdn_chunk, "pin_fla_chunk_configs", lambda: {})
    return calls


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    q, k = (torch.randn(T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, HV, generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(T, HV, generator=gen, dtype=torch.float64)
    states = torch.randn(len(LENS), HV, V, K, generator=gen, dtype=torch.float64) * 0.1
    return q, k, v, g, beta, states


def _cu(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def _reference(q, k, v, g, beta, states, lens):
    """Whole sequences through the plain recurrence; boundary states by running up to the last boundary."""
    cu = _cu(lens)
    h0 = states.transpose(-1, -2)
    o, _ = gdn_torch_varlen(q[None], k[None], v[None], g[None], beta[None], h0, torch.tensor(cu), K**-0.5)
    bounds = []
    for i, n in enumerate(lens):
        w = n // gdn_chunk.CHUNK * gdn_chunk.CHUNK
        if w == 0:
            bounds.append(states[i])
            continue
        s = slice(cu[i], cu[i] + w)
        _, h = gdn_torch_varlen(q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s], h0[i : i + 1],
                                torch.tensor([0, w]), K**-0.5)
        bounds.append(h[0].transpose(-1, -2))
    return o[0], torch.stack(bounds)


def test_two_launches_equal_the_recurrence(torch_kernel):
    q, k, v, g, beta, states = _inputs()
    o, bound = gdn_chunk._chunk_varlen_cuda(q, k, v, g, beta, states, _cu(LENS), None)
    o_ref, bound_ref = _reference(q, k, v, g, beta, states, LENS)
    assert (o - o_ref).abs().max().item() < 1e-10
    assert (bound - bound_ref).abs().max().item() < 1e-10
    # launch 1: the whole blocks (64, 64, 128, 128 rows of sequences 0, 2, 3, 5); launch 2: the rest (6, 5, 2, 1)
    assert torch_kernel == [[0, 64, 128, 256, 384], [0, 6, 11, 13, 14]]


def test_only_partial_or_only_whole_blocks(torch_kernel):
    q, k, v, g, beta, states = _inputs(1)
    for lens in ([5, 1, 63], [64, 128]):
        T = sum(lens)
        args = (q[:T], k[:T], v[:T], g[:T], beta[:T], states[: len(lens)])
        o, bound = gdn_chunk._chunk_varlen_cuda(*args, _cu(lens), None)
        o_ref, bound_ref = _reference(*args, lens)
        assert (o - o_ref).abs().max().item() < 1e-10 and (bound - bound_ref).abs().max().item() < 1e-10
    assert len(torch_kernel) == 2  # one launch each


def test_gradients_flow_through_the_boundary_hand_over(torch_kernel):
    q, k, v, g, beta, states = _inputs(2)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, states)]
    wo = torch.randn(sum(LENS), HV, V, dtype=torch.float64)
    wb = torch.randn(len(LENS), HV, V, K, dtype=torch.float64)

    def loss(fn):
        o, bound = fn(*leaves)
        return (o * wo).sum() + (bound * wb).sum()

    got = torch.autograd.grad(loss(lambda *a: gdn_chunk._chunk_varlen_cuda(*a, _cu(LENS), None)), leaves)
    want = torch.autograd.grad(loss(lambda *a: _reference(*a, LENS)), leaves)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-9 * max(1.0, b.abs().max().item())


def test_prefill_batch_reads_rows_in_place(torch_kernel):
    """Every sequence has whole blocks: launch 1 takes every row in place, each sequence as two segments
    (whole blocks, partial tail); launch 2 recomputes the tails from the boundary states."""
    lens = [70, 64, 130, 128]
    q, k, v, g, beta, states = _inputs(3)
    T = sum(lens)
    args = (q[:T], k[:T], v[:T], g[:T], beta[:T], states[: len(lens)])
    leaves = [t.clone().requires_grad_(True) for t in args]
    o, bound = gdn_chunk._chunk_varlen_cuda(*leaves, _cu(lens), None)
    o_ref, bound_ref = _reference(*args, lens)
    assert (o - o_ref).abs().max().item() < 1e-10 and (bound - bound_ref).abs().max().item() < 1e-10
    assert torch_kernel == [[0, 64, 70, 134, 262, 264, 392], [0, 6, 8]]
    wo = torch.randn(T, HV, V, dtype=torch.float64)
    got = torch.autograd.grad((o * wo).sum() + bound.sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in args]
    o_r, b_r = _reference(*ref_leaves, lens)
    want = torch.autograd.grad((o_r * wo).sum() + b_r.sum(), ref_leaves)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-9
