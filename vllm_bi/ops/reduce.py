"""Row reductions whose result for a row never depends on how many rows there are.

ATen's CPU sum reduces each row of a multi-row tensor serially, but splits a
*single* long row across threads (``parallel_reduce`` when the output has one
element and the input is over the grain size, 32768). A one-token decode and a
64-token prefill would then sum the same logits row in different orders. These
helpers fold long rows into fixed-width blocks first, so every row is always
reduced as ``[.., n_blocks, BLOCK]`` -> ``[.., n_blocks]`` -> ``[..]`` whatever
the batch.
"""

from __future__ import annotations

import torch

__all__ = ["row_sum", "row_mean", "ROW_BLOCK"]

ROW_BLOCK = 4096


def row_sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the last dim, keepdim, in ``dtype`` (default: ``x.dtype``)."""
    dtype = dtype or x.dtype
    x = x.to(dtype)
    n = x.shape[-1]
    if n <= ROW_BLOCK:
        return torch.sum(x, dim=-1, keepdim=True)
    pad = (-n) % ROW_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    blocks = x.reshape(*x.shape[:-1], (n + pad) // ROW_BLOCK, ROW_BLOCK)
    return torch.sum(torch.sum(blocks, dim=-1), dim=-1, keepdim=True)


def row_mean(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean over the last dim, keepdim (sum by :func:`row_sum`, then divide)."""
    return row_sum(x, dtype) / x.shape[-1]
