"""``ops.layout.canonical_rows``: the one layout the reducing Triton kernels read (the bits it protects are checked on
CUDA in ``tests/gpu/test_ops_cuda.py``)."""

import torch

from vllm_bi.ops.layout import ALIGN, aligned, canonical_rows


def _canonical(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) % ALIGN == 0 and t.data_ptr() % ALIGN == 0


def test_canonical_rows_views_what_is_already_canonical_and_copies_the_rest():
    x = torch.randn(6, 64)
    assert canonical_rows(x, 64).data_ptr() == x.data_ptr()  # already canonical: no copy
    wide = torch.randn(6, 3008)
    flat = torch.randn(1 + 6 * 3000)
    cases = {"contiguous, odd stride": torch.randn(6, 3000), "padded view": wide[:, :3000],
             "odd offset": flat[1:].view(6, 3000), "column view": torch.randn(3000, 6).t(),
             "3-d": torch.randn(2, 3, 3000)}
    for name, t in cases.items():
        got = canonical_rows(t, 3000)
        assert _canonical(got), name
        assert got.shape == (6, 3000) and torch.equal(got, t.reshape(6, 3000)), name
    assert canonical_rows(wide[:, :3000], 3000).stride(0) == 3008
    w = flat[1:3001]
    assert aligned(w).data_ptr() % ALIGN == 0 and torch.equal(aligned(w), w)
    assert aligned(x[0]).data_ptr() == x.data_ptr()
