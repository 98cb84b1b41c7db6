"""The GDN short conv on CUDA (``causal_conv1d_varlen`` -> the Triton kernel of ``vllm_bi.ops.conv``) at
Qwen3.5-9B GDN width (8192 channels, width 4).

Exact (``torch.equal``): the ring conv == the plain kernel on gathered rows; a sequence's outputs and new conv state alone == in a packed batch; a prompt split
at an arbitrary row and resumed from the first part's conv state == the whole prompt. Correctness: outputs
vs the float64 formula within 1e-2 absolute + 1e-2 relative (bf16 output); gradients of x and weight
(the Triton backward) vs float64 autograd, relative L2 <= 1e-2.

Run on a GPU machine: `pytest -m gpu tests/gpu` (skipped without CUDA).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from vllm_bi.gdn.layer import causal_conv1d_varlen  # noqa: E402

D, W, DEV = 8192, 4, "cuda"
LENS = [1, 7, 64, 300, 2]


def _inputs(seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(sum(LENS), D, generator=g).bfloat16().to(DEV)
    w = (torch.randn(D, W, generator=g) * 0.5).bfloat16().to(DEV)
    st = torch.randn(len(LENS), W - 1, D, generator=g).bfloat16().to(DEV)
    return x, w, st


def _cu(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def _formula(x, w, st, lens):
    """float64, differentiable: act(sum_w weight[:, w] * ext_j[t + w]) per sequence."""
    out, cu = [], _cu(lens)
    for j, n in enumerate(lens):
        ext = torch.cat([st[j].double(), x[cu[j]:cu[j + 1]].double()])
        y = sum(ext[i : i + n] * w[:, i].double() for i in range(W))
        out.append(y * torch.sigmoid(y))
    return torch.cat(out)


def test_invariant_and_split_exact():
    x, w, st = _inputs()
    y, new = causal_conv1d_varlen(x, _cu(LENS), w, st)
    cu = _cu(LENS)
    for j, n in enumerate(LENS):
        ya, na = causal_conv1d_varlen(x[cu[j]:cu[j + 1]], [0, n], w, st[j:j + 1])
        assert torch.equal(ya, y[cu[j]:cu[j + 1]]), j
        assert torch.equal(na[0], new[j]), j
    j, cut = 3, 137  # the 300-token prompt, split at an unaligned row
    xs = x[cu[j]:cu[j + 1]]
    y1, s1 = causal_conv1d_varlen(xs[:cut], [0, cut], w, st[j:j + 1])
    y2, s2 = causal_conv1d_varlen(xs[cut:], [0, LENS[j] - cut], w, s1)
    assert torch.equal(torch.cat([y1, y2]), y[cu[j]:cu[j + 1]])
    assert torch.equal(s2[0], new[j])


def test_matches_float64_and_gradients():
    x, w, st = _inputs(1)
    ref = _formula(x, w, st, LENS)
    y, _ = causal_conv1d_varlen(x, _cu(LENS), w, st)
    err = (y.double() - ref).abs() - 1e-2 * ref.abs()
    assert float(err.max()) <= 1e-2
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    r = torch.randn(x.shape, device=DEV)
    (causal_conv1d_varlen(xg, _cu(LENS), wg, st)[0].float() * r).sum().backward()
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    (_formula(x64, w64, st, LENS) * r.double()).sum().backward()
    for got, want in ((xg.grad, x64.grad), (wg.grad, w64.grad)):
        rel = float((got.double() - want).norm() / want.norm())
        assert rel <= 1e-2, rel


def test_block_sizes_do_not_change_the_bits():
    """The kernel's tiling (tokens x channels per program, warps) decides which program computes an element,
    not how: every tiling gives the same bits, so the fastest can be chosen by measurement alone."""
    from vllm_bi.ops.conv import triton_causal_conv1d

    x, w, st = _inputs(2)
    cu = _cu(LENS)
    seq = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS)).int().to(DEV)
    pos = (torch.arange(sum(LENS)) - torch.tensor(cu[:-1]).repeat_interleave(torch.tensor(LENS))).int().to(DEV)
    starts = torch.tensor(cu[:-1]).to(DEV)
    ref = triton_causal_conv1d(x, w, st, seq, pos, starts, True)
    for blocks in ((16, 256, 4), (64, 64, 4), (32, 128, 8), (128, 32, 2)):
        assert torch.equal(triton_causal_conv1d(x, w, st, seq, pos, starts, True, blocks), ref), blocks


def test_ring_conv_gives_the_plain_kernels_bits():
    """The chunk mode's decode conv (``ops.conv.ring_causal_conv1d``: rows read in place in the history ring, q, k
    and v written apart) == the plain kernel on the same rows gathered, ``torch.equal``: the compiled kernels'
    arithmetic (fp32 taps in order, FMA contraction) is the same (``tests/conv_ring_case.py``)."""
    from conv_ring_case import check_ring_conv

    check_ring_conv(DEV)
