"""The GDN gates as one Triton kernel: ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, the
CUDA path of :func:`vllm_bi.gdn.recurrent.gdn_gating` under ``VLLM_BI_GDN_GATES=triton``.

The torch path (:mod:`vllm_bi.ops.pointwise`) runs each operation of the formula as its own elementwise kernel,
about fifteen per GDN layer and step; at a decode step each costs a few microseconds of GPU time whatever the batch.
This kernel runs the same operations, in the same order, on each element: the conversions to fp32, the sum
``a + dt_bias``, the clamp at 20 and the choice of softplus's branch, libdevice's ``expf`` and ``log1pf`` (the
functions torch's CUDA kernels call) with denormals kept as torch's build keeps them (Triton flushes them by
default: :data:`LAUNCH`), ``-rate * softplus`` as one product, and ``1 / (1 + exp(-b))`` with an IEEE
division (torch's ``1 / x`` is a reciprocal times one). No product feeds a sum, so the compiler has no multiply-add
to fuse. On CUDA it is therefore meant to give the torch path's bits; ``tests/gpu/test_gates_cuda.py`` checks that
with ``torch.equal``, and until a GPU run has, the setting is part of
:meth:`vllm_bi.settings.Settings.arithmetic` (a server and a trainer on different gate paths refuse each other).

Elementwise: an element's value depends on its inputs only, so it is batch-invariant by construction. In Triton's CPU
interpreter (tests) ``exp``, ``log1p`` and the division are numpy's: the logic, not CUDA's bits.

Gradients: analytic, in torch (``dg/da = -exp(A_log) * sigmoid(a + dt_bias)`` below the clamp, ``dg/dA_log = g``,
``dbeta/db = beta (1 - beta)``): the trainer's gradients need accuracy, not bits.
"""

from __future__ import annotations

import torch

__all__ = ["gdn_gates", "BLOCK"]

BLOCK = 1024  # elements per program
THRESHOLD = 20.0  # softplus is x above it (torch's default threshold)
# Triton links libdevice with denormals flushed to zero by default; torch's CUDA kernels keep them (exp of an input
# below about -87 is a denormal there, 0 here). No fused multiply-add either: torch rounds each product.
LAUNCH = {"enable_reflect_ftz": False, "enable_fp_fusion": False}

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice  # noqa: F401  (tl.extra.libdevice below)

        @triton.jit
        def gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, n, HV, sa_t, sa_h, sb_t, sb_h,
                             THRESHOLD: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            live = offs < n
            t = offs // HV
            h = offs % HV
            a = tl.load(a_ptr + t * sa_t + h * sa_h, mask=live, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t * sb_t + h * sb_h, mask=live, other=0.0).to(tl.float32)
            alog = tl.load(alog_ptr + h, mask=live, other=0.0).to(tl.float32)
            dtb = tl.load(dtb_ptr + h, mask=live, other=0.0).to(tl.float32)
            x = a + dtb
            xc = tl.where(x > THRESHOLD, THRESHOLD, x)  # torch.clamp(x, max=20): NaN stays NaN
            if LIBDEVICE:
                soft = tl.extra.libdevice.log1p(tl.extra.libdevice.exp(xc))
                rate = tl.extra.libdevice.exp(alog)
                beta = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), 1.0 + tl.extra.libdevice.exp(-b))
            else:  # Triton's CPU interpreter: the logic only
                e = tl.exp(xc)
                u = 1.0 + e
                soft = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))  # log1p to fp32 accuracy
                rate = tl.exp(alog)
                beta = 1.0 / (1.0 + tl.exp(-b))
            g = -rate * tl.where(x > THRESHOLD, x, soft)
            tl.store(g_ptr + offs, g, mask=live)
            tl.store(beta_ptr + offs, beta, mask=live)

        _KERNEL = gdn_gates_kernel
    return _KERNEL


def _launch(A_log, a, b, dt_bias, libdevice: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on these tensors; ``libdevice`` (default: on CUDA) picks libdevice's functions over Triton's own
    (the interpreter has no libdevice; a GPU test's control takes Triton's)."""
    if a.dim() != 2 or b.shape != a.shape or A_log.numel() != a.shape[1] or dt_bias.numel() != a.shape[1]:
        raise ValueError(f"gdn_gates: a and b [T, HV], A_log and dt_bias [HV]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    T, HV = a.shape
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    n = T * HV
    if n:
        _kernel()[(-(-n // BLOCK),)](a, b, A_log.contiguous(), dt_bias.contiguous(), g, beta, n, HV, a.stride(0),
                                     a.stride(1), b.stride(0), b.stride(1), THRESHOLD=THRESHOLD, BLOCK=BLOCK,
                                     LIBDEVICE=a.is_cuda if libdevice is None else libdevice, **LAUNCH)
    return g, beta


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A_log, a, b, dt_bias):
        g, beta = _launch(A_log, a, b, dt_bias)
        ctx.save_for_backward(A_log, a, dt_bias, beta)
        ctx.b_dtype = b.dtype
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        A_log, a, dt_bias, beta = ctx.saved_tensors
        x = a.float() + dt_bias.float()
        rate = torch.exp(A_log.float())
        soft = torch.where(x > THRESHOLD, x, torch.log1p(torch.exp(x.clamp(max=THRESHOLD))))
        dsoft = torch.where(x > THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        dx = dg.float() * (-rate * dsoft) if dg is not None else torch.zeros_like(x)
        d_alog = (dg.float() * (-rate * soft)).sum(0) if dg is not None else torch.zeros_like(rate)
        db = dbeta.float() * beta * (1.0 - beta) if dbeta is not None else torch.zeros_like(beta)
        return (d_alog.to(A_log.dtype), dx.to(a.dtype), db.to(ctx.b_dtype), dx.sum(0).to(dt_bias.dtype))


def gdn_gates(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)``, fp32 ``[T, HV]``, of ``a, b [T, HV]`` (any strides) and ``A_log, dt_bias [HV]``: one kernel."""
    return _Gates.apply(A_log, a, b, dt_bias)
