"""Log-softmax over the last dim as one Triton kernel on CUDA, with the bits of the op library's torch formula.

:func:`vllm_bi.ops.softmax.log_softmax` computes, per row of fp32 values ``x``::

    m   = max(x)                       (0 where the max is not finite)
    s   = row_sum(exp(x - m))          (ops.reduce: GPU_BLOCK lanes, each adding its columns in order, then one tree)
    out = x - (m + log(s))

On CUDA that is seven kernels and eight passes over the logits (the fp32 copy, the max, the difference, ``exp``,
the sum, the output). :func:`fused_log_softmax` does the same arithmetic in one program per row and three passes:
the max (exact in any order), the lanes' sums in :func:`vllm_bi.ops.reduce.row_sum`'s order and its tree (the
same block of lanes, the same warps), and the output. ``exp`` and ``log`` are libdevice's ``expf`` and ``logf``,
the functions torch's CUDA kernels call. The input is read in its own dtype (bf16 logits: 2 bytes per element per
pass) and widened to fp32 in registers, exactly as ``x.to(torch.float32)`` would.

So the result equals the torch formula bit for bit (``tests/gpu/test_ops_cuda.py`` checks it on the GPU at a
248,320-token vocabulary, 1 to 256 rows, bf16 and fp32 inputs); a row's bits do not depend on the batch (one
program per row, nothing shared). The backward is the analytic one in torch (gradients need accuracy, not bits).
"""

from __future__ import annotations

import torch

from vllm_bi.ops.reduce import GPU_BLOCK, ROW_SUM_WARPS

__all__ = ["fused_log_softmax"]

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice  # noqa: F401  (tl.extra.libdevice below)

        @triton.jit
        def log_softmax_rows_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr,
                                    LIBDEVICE: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            xr = x_ptr + row * stride_x
            lanes = tl.arange(0, BLOCK)
            mx = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + lanes
                v = tl.load(xr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
                mx = tl.maximum(mx, v)
            m = tl.max(mx, axis=0)
            m = tl.where((m == m) & (tl.abs(m) != float("inf")), m, 0.0)
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + lanes
                live = offs < n
                v = tl.load(xr + offs, mask=live, other=0.0).to(tl.float32)
                if LIBDEVICE:  # torch's CUDA expf / logf
                    e = tl.extra.libdevice.exp(v - m)
                else:  # Triton's CPU interpreter (no libdevice): the logic only
                    e = tl.exp(v - m)
                acc += tl.where(live, e, 0.0)
            s = tl.sum(acc, axis=0)
            if LIBDEVICE:
                lse = m + tl.extra.libdevice.log(s)
            else:
                lse = m + tl.log(s)
            orow = out_ptr + row * stride_o
            for start in range(0, n, BLOCK):
                offs = start + lanes
                live = offs < n
                v = tl.load(xr + offs, mask=live, other=0.0).to(tl.float32)
                tl.store(orow + offs, v - lse, mask=live)

        _KERNEL = log_softmax_rows_kernel
    return _KERNEL


def _forward(x: torch.Tensor) -> torch.Tensor:
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        _kernel()[(x2.shape[0],)](x2, out, n, x2.stride(0), out.stride(0), BLOCK=GPU_BLOCK,
                                  LIBDEVICE=x.device.type == "cuda", num_warps=ROW_SUM_WARPS)
    return out.reshape(*lead, n)


class _FusedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = _forward(x)
        ctx.save_for_backward(out)
        ctx.in_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        g = g.float()
        return (g - out.exp() * g.sum(-1, keepdim=True)).to(ctx.in_dtype)


def fused_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim of a CUDA tensor (bf16, fp16 or fp32): the bits of
    :func:`vllm_bi.ops.softmax.log_softmax`'s formula (module doc). Differentiable."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"vllm_bi fused log-softmax: input dtype {x.dtype} (bf16, fp16 or fp32)")
    return _FusedLogSoftmax.apply(x)
