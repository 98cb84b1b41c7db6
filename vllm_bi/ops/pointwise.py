"""Transcendental elementwise functions whose result for an element never depends on its position.

Measured on these CPUs (torch 2.13, AVX2; ``tests/ops/test_pointwise.py``):
ATen computes the body of a contiguous tensor with SIMD approximations
(Sleef) and the last ``numel % vector_width`` elements with the scalar libm
function. The two disagree in the last bit for ``softplus``, ``log1p``,
``rsqrt``, ``sigmoid`` and ``silu``, so the same value rounds differently
depending on how many tokens share the tensor and where it sits — a
batch-invariance bug hidden inside an "elementwise" op.

Here every such function is evaluated on a stride-2 view of the input, which
ATen's vectorised loop does not take: each element goes through the same
scalar code path whatever the tensor's size or the element's offset.
``rsqrt`` is ``1 / sqrt`` (both IEEE correctly rounded in SIMD and scalar).
All functions compute in fp32 (or fp64 for fp64 inputs) and return that dtype.

Gradients: ``exp``, ``log`` and ``log1p`` carry their analytic backward (a
``torch.autograd.Function``); the others are compositions of those with
differentiable torch ops, so autograd differentiates them as written.
"""

from __future__ import annotations

import torch

__all__ = ["exp", "log", "log1p", "sigmoid", "silu", "softplus", "rsqrt"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scalar_path(fn, x: torch.Tensor) -> torch.Tensor:
    dt = _compute_dtype(x)
    if x.device.type != "cpu":
        # CUDA elementwise kernels run the same per-element code at every offset
        return fn(x.to(dt))
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=dt)
    src = torch.empty((*x.shape, 2), dtype=dt)
    src[..., 0] = x
    dst = torch.empty((*x.shape, 2), dtype=dt)
    out = dst[..., 0]
    fn(src[..., 0], out=out)
    return out.contiguous()


def _unary(fn, grad, save_output: bool):
    """An autograd Function running ``fn`` on the scalar path; ``grad(g, saved)`` is its backward."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = _scalar_path(fn, x)
            ctx.save_for_backward(y if save_output else x)
            return y

        @staticmethod
        def backward(ctx, g):
            (saved,) = ctx.saved_tensors
            return grad(g, saved.to(g.dtype))

    return _Fn


_Exp = _unary(torch.exp, lambda g, y: g * y, save_output=True)
_Log = _unary(torch.log, lambda g, x: g / x, save_output=False)
_Log1p = _unary(torch.log1p, lambda g, x: g / (1.0 + x), save_output=False)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _Exp.apply(x)


def log(x: torch.Tensor) -> torch.Tensor:
    return _Log.apply(x)


def log1p(x: torch.Tensor) -> torch.Tensor:
    return _Log1p.apply(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``."""
    x = x.to(_compute_dtype(x))
    return 1.0 / (1.0 + exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``."""
    x = x.to(_compute_dtype(x))
    return x * sigmoid(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """``log1p(exp(x))``, and ``x`` above ``threshold`` (as torch's default)."""
    x = x.to(_compute_dtype(x))
    return torch.where(x > threshold, x, log1p(exp(torch.clamp(x, max=threshold))))


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)`` — two correctly rounded IEEE operations."""
    x = x.to(_compute_dtype(x))
    return 1.0 / torch.sqrt(x)
