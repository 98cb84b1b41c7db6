"""Log-softmax over the last dim as one Triton kernel: the CUDA path of :func:`vllm_bi.ops.softmax.log_softmax`
under ``VLLM_BI_LOGPROBS=triton`` (off by default).

It computes the op library's formula, per row of fp32 values ``x``::

    m   = max(x)                       (0 where the max is not finite)
    s   = sum(exp(x - m))              (GPU_BLOCK lanes, each adding its columns in order, then one tree)
    out = x - (m + log(s))

On CUDA the torch formula is seven kernels and eight passes over the logits (the fp32 copy, the max, the
difference, ``exp``, the sum, the output); this kernel is one program per row and three passes (the max, the
lanes' sums, the output), reading the input in its own dtype and widening it to fp32 in registers. ``exp`` and
``log`` are libdevice's ``expf`` and ``logf``.

Batch invariance holds by construction: one program per row, nothing shared, and nothing but the row length reaches
the kernel's configuration. Its bits are not the torch formula's: on the H200, at a 248,320-token vocabulary, fp32
input gave the formula's bits but bf16 input differed on some of 256 rows (the order in which ``tl.sum`` adds the
lanes follows the block's register layout, which the load of a 2-byte dtype may change; not confirmed). Server and
trainer must therefore agree on the setting (it is part of :meth:`vllm_bi.settings.Settings.arithmetic`). The
backward is the analytic one in torch (gradients need accuracy, not bits).
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
    """fp32 log-softmax over the last dim of a CUDA tensor (bf16, fp16 or fp32), one program per row (module doc).
    Differentiable."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"vllm_bi fused log-softmax: input dtype {x.dtype} (bf16, fp16 or fp32)")
    return _FusedLogSoftmax.apply(x)
