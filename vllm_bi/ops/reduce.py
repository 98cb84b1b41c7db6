"""Row reductions whose result for a row never depends on how many rows there are.

CPU: ATen's sum reduces each row of a multi-row tensor serially, but splits a
*single* long row across threads (``parallel_reduce`` when the output has one
element and the input is over the grain size, 32768). A one-token decode and a
64-token prefill would then sum the same logits row in different orders. These
helpers fold long rows into fixed-width blocks first, so every row is always
reduced as ``[.., n_blocks, BLOCK]`` -> ``[.., n_blocks]`` -> ``[..]`` whatever
the batch.

CUDA: ATen's reduction kernels choose their launch configuration (and with it
the summation order) from the whole tensor's shape, so a row's sum can change
with the number of rows. :func:`row_sum` runs a Triton kernel instead: one
program per row, a fixed block of ``GPU_BLOCK`` lanes accumulating the row in
order, then one fixed-shape tree sum of the lanes — the same order for a row
whatever else is in the tensor (and whatever view holds it where the rows are
read in one layout: :mod:`vllm_bi.ops.layout`).
"""

from __future__ import annotations

import torch

from vllm_bi.ops.layout import canonical_rows
from vllm_bi.ops.layout import wanted as layout_wanted

__all__ = ["row_sum", "row_mean", "ROW_BLOCK", "GPU_BLOCK", "ROW_SUM_WARPS"]

ROW_BLOCK = 4096
GPU_BLOCK = 1024
ROW_SUM_WARPS = 4  # with GPU_BLOCK, fixes the tree that sums the lanes


def row_sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the last dim, keepdim, in ``dtype`` (default: ``x.dtype``)."""
    dtype = dtype or x.dtype
    if x.device.type != "cpu":
        return _TritonRowSum.apply(x, dtype)
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


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def row_sum_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr, FP64: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            acc_t = tl.float64 if FP64 else tl.float32
            acc = tl.zeros([BLOCK], dtype=acc_t)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + row * stride + offs, mask=offs < n, other=0.0).to(acc_t)
            tl.store(out_ptr + row, tl.sum(acc, axis=0))

        _KERNEL = row_sum_kernel
    return _KERNEL


def triton_row_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The CUDA path of :func:`row_sum` (no autograd); runs on CPU tensors under ``TRITON_INTERPRET=1``."""
    if dtype not in (torch.float32, torch.float64):
        raise NotImplementedError(f"vllm_bi row_sum on {x.device.type}: accumulation dtype {dtype} (fp32/fp64 only)")
    lead, n = x.shape[:-1], x.shape[-1]
    # one layout (where wanted), so one lane order for the final tl.sum whatever view holds the rows
    x2 = canonical_rows(x, n) if layout_wanted(x) else x.reshape(-1, n).contiguous()
    out = torch.empty(x2.shape[0], dtype=dtype, device=x.device)
    if x2.shape[0]:
        _kernel()[(x2.shape[0],)](x2, out, n, x2.stride(0), BLOCK=GPU_BLOCK, FP64=dtype == torch.float64,
                                  num_warps=ROW_SUM_WARPS)
    return out.reshape(*lead, 1)


class _TritonRowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.in_dtype, ctx.shape = x.dtype, x.shape
        return triton_row_sum(x, dtype)

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape).to(ctx.in_dtype), None
