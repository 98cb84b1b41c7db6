"""Log-softmax over the last dim in two Triton kernels: the CUDA path of :func:`vllm_bi.ops.softmax.log_softmax`
under ``VLLM_BI_LOGPROBS=triton``.

Each row of ``n`` values is cut into ``parts(n)`` spans of :data:`SPAN` columns (the last one shorter), a number
that depends on ``n`` alone. Per row, in fp32 (the input widened in registers, read in its own dtype)::

    kernel 1, one program per (row, span j):
        m_j = max(x[span j])                     (taken as 0 for the sum where it is not finite)
        s_j = sum(exp(x[span j] - m_j))          (the finite terms added as 64-bit fixed-point integers)
    kernel 2, one program per (row, span j), each computing the same lse from the row's partials:
        M   = max_j m_j                          (0 where not finite)
        s   = sum_j s_j * exp(m_j - M)           (a scalar loop over the spans, in their order)
        out[span j] = x[span j] - (M + log(s))

A 64-row decode step thus runs 64 x 31 programs at a 248,320-token vocabulary, where one program per row would leave
half of an H100's SMs idle; the logits are read three times (the second read of a span from cache) and the output
written once, against the torch formula's eight passes over an fp32 copy.

Batch invariance holds by construction, and does not rest on how Triton lays out a block in registers. A float
``tl.sum`` adds its lanes in an order that follows the layout, and the layout follows what the compiler may assume of
the arguments (a pointer's or a stride's divisibility by 16, the dtype's width), so a row could take other bits as
a row of a ``[T, 3000]`` tensor than as the same row of a 3008-wide tensor's ``[:, :3000]`` view (vLLM pads the
vocabulary to a multiple of 64 and slices it). Here no float sum depends on the layout: a span's terms are summed as integers (``exp`` of a
value at most the span's max is in ``[0, 1]``; in units of 2**-49, 8192 of them stay below 2**62, and a term loses
under 2**-49 to truncation), inf and NaN terms apart (their sum is the same in any order), and the spans are combined
by a scalar loop. A row's programs read only that row, and only ``n`` reaches the launch (the span count, the block
widths, the warps). The bits are not the torch formula's, so server and trainer must agree on the setting; it is
part of :meth:`vllm_bi.settings.Settings.arithmetic`. ``exp`` and ``log`` are libdevice's ``expf`` and ``logf`` on
CUDA. The backward is the analytic one in torch (gradients need accuracy, not bits).
"""

from __future__ import annotations

import torch

from vllm_bi.ops.reduce import GPU_BLOCK, ROW_SUM_WARPS

__all__ = ["fused_log_softmax", "parts", "SPAN"]

SPAN = 8 * GPU_BLOCK  # columns per program; a multiple of GPU_BLOCK, so spans start on a block of lanes
# 2**49: a span's finite terms are each in [0, 1] (x <= the span's max), so SPAN of them in this fixed point stay
# below 2**62; a term loses under 2**-49 to truncation
FIXED_ONE = 562949953421312.0

_KERNELS = None


def parts(n: int) -> int:
    """How many spans a row of ``n`` values is cut into (a function of ``n`` only)."""
    return max(1, -(-n // SPAN))


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice  # noqa: F401  (tl.extra.libdevice below)

        @triton.jit
        def span_partials_kernel(x_ptr, m_ptr, s_ptr, n, stride_x, n_parts, SPAN: tl.constexpr, BLOCK: tl.constexpr,
                                 ONE: tl.constexpr, LIBDEVICE: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            part = tl.program_id(1)
            xr = x_ptr + row * stride_x
            lanes = tl.arange(0, BLOCK)
            lo = part * SPAN
            mx = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, SPAN, BLOCK):
                offs = lo + start + lanes
                v = tl.load(xr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
                mx = tl.maximum(mx, v)
            m = tl.max(mx, axis=0)
            m0 = tl.where((m == m) & (tl.abs(m) != float("inf")), m, 0.0)
            fixed = tl.zeros([BLOCK], tl.int64)  # finite terms in fixed point: integer sums have no order
            odd = tl.zeros([BLOCK], tl.float32)  # inf and NaN terms: their sum is the same in any order
            for start in range(0, SPAN, BLOCK):
                offs = lo + start + lanes
                live = offs < n
                v = tl.load(xr + offs, mask=live, other=0.0).to(tl.float32)
                if LIBDEVICE:  # torch's CUDA expf
                    e = tl.extra.libdevice.exp(v - m0)
                else:  # Triton's CPU interpreter (no libdevice): the logic only
                    e = tl.exp(v - m0)
                fin = live & (e < float("inf"))
                fixed += (tl.where(fin, e, 0.0) * ONE).to(tl.int64)
                odd += tl.where(live & (~fin), e, 0.0)
            s = tl.sum(fixed, axis=0).to(tl.float32) * (1.0 / ONE) + tl.sum(odd, axis=0)
            tl.store(m_ptr + row * n_parts + part, m)
            tl.store(s_ptr + row * n_parts + part, s)

        @triton.jit
        def span_output_kernel(x_ptr, m_ptr, s_ptr, out_ptr, n, stride_x, stride_o, n_parts, SPAN: tl.constexpr,
                               BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            part = tl.program_id(1)
            pm = m_ptr + row * n_parts
            ps = s_ptr + row * n_parts
            big = tl.load(pm)
            for j in range(1, n_parts):  # scalar loops: the spans in their order, whatever the register layout
                big = tl.maximum(big, tl.load(pm + j))
            big = tl.where((big == big) & (tl.abs(big) != float("inf")), big, 0.0)
            total = 0.0
            for j in range(0, n_parts):
                mj = tl.load(pm + j)
                sj = tl.load(ps + j)
                mj0 = tl.where((mj == mj) & (tl.abs(mj) != float("inf")), mj, 0.0)
                if LIBDEVICE:
                    scale = tl.extra.libdevice.exp(mj0 - big)
                else:
                    scale = tl.exp(mj0 - big)
                # a span without a finite max adds its own sum (0 for all -inf; inf or NaN are passed on)
                total += tl.where(mj == mj0, sj * scale, sj)
            if LIBDEVICE:
                lse = big + tl.extra.libdevice.log(total)
            else:
                lse = big + tl.log(total)
            xr = x_ptr + row * stride_x
            orow = out_ptr + row * stride_o
            lanes = tl.arange(0, BLOCK)
            lo = part * SPAN
            for start in range(0, SPAN, BLOCK):
                offs = lo + start + lanes
                live = offs < n
                v = tl.load(xr + offs, mask=live, other=0.0).to(tl.float32)
                tl.store(orow + offs, v - lse, mask=live)

        _KERNELS = (span_partials_kernel, span_output_kernel)
    return _KERNELS


def _forward(x: torch.Tensor) -> torch.Tensor:
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if rows and n:
        k = parts(n)
        m = torch.empty(rows, k, dtype=torch.float32, device=x.device)
        s = torch.empty(rows, k, dtype=torch.float32, device=x.device)
        partials, output = _kernels()
        lib = x.device.type == "cuda"
        partials[(rows, k)](x2, m, s, n, x2.stride(0), k, SPAN=SPAN, BLOCK=GPU_BLOCK, ONE=FIXED_ONE, LIBDEVICE=lib,
                            num_warps=ROW_SUM_WARPS)
        output[(rows, k)](x2, m, s, out, n, x2.stride(0), out.stride(0), k, SPAN=SPAN, BLOCK=GPU_BLOCK,
                          LIBDEVICE=lib, num_warps=ROW_SUM_WARPS)
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
    """fp32 log-softmax over the last dim of a CUDA tensor (bf16, fp16 or fp32), each row cut into
    :func:`parts` spans (module doc). Differentiable."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"vllm_bi fused log-softmax: input dtype {x.dtype} (bf16, fp16 or fp32)")
    return _FusedLogSoftmax.apply(x)
