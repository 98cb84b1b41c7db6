"""RMSNorm variants with per-row reductions from :mod:`vllm_bi.ops.reduce`.

The arithmetic follows vLLM 0.32's native implementations (``ir.ops.rms_norm``,
``ir.ops.fused_add_rms_norm``, ``RMSNormGated.forward_static``): fp32 math,
one rounding to the input dtype at the end. Only the reduction is replaced.

On CUDA under ``VLLM_BI_ROWWISE=triton`` each op is one kernel of :mod:`vllm_bi.ops.rows_triton` (the same formula,
Triton's rounding of exp, division and square root); this module's torch code is then the backward's reference.
"""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise, rows_triton
from vllm_bi.ops.reduce import row_mean

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_maybe_residual", "gated_rms_norm"]


def _normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * pointwise.rsqrt(row_mean(x32 * x32) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` (weight is applied in its own dtype, then cast back to x.dtype).

    For Gemma-style norms pass ``weight = w.float() + 1``.
    """
    return rms_norm_maybe_residual(x, None, weight, eps)


def _rms_norm_only(x, weight, eps):
    out = _normalize(x.to(torch.float32), eps)
    if weight is not None:
        out = out.to(weight.dtype) * weight
    return out.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (fp32, rounded to x.dtype as the new residual); returns ``(rms_norm(h), h)``."""
    return rms_norm_maybe_residual(x, residual, weight, eps)


def _fused_add_rms_norm_only(x, residual, weight, eps):
    h32 = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = h32.to(x.dtype)
    out = _normalize(h32, eps)
    if weight is not None:
        out = out.to(weight.dtype) * weight
    return out.to(x.dtype), new_residual


def _rms_norm_torch(x, residual, weight, eps):
    if residual is None:
        return _rms_norm_only(x, weight, eps)
    return _fused_add_rms_norm_only(x, residual, weight, eps)


def rms_norm_maybe_residual(x, residual, weight, eps):
    """vLLM's norm-layer calling convention: ``rms_norm(x)``, or ``(rms_norm(x + residual), x + residual)``."""
    if rows_triton.wanted(x):
        return rows_triton.rms_norm(x, residual, weight, eps, _rms_norm_torch)
    return _rms_norm_torch(x, residual, weight, eps)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    norm_before_gate: bool = True,
    activation: str = "silu",
    group_size: int | None = None,
) -> torch.Tensor:
    """GDN output norm: ``rms_norm(x) * weight * act(z)`` (or ``rms_norm(x * act(z)) * weight``)."""
    if activation not in ("silu", "swish", "sigmoid"):
        raise ValueError(f"gated_rms_norm: unsupported activation {activation!r}")
    if rows_triton.wanted(x):
        return rows_triton.gated_rms_norm(x, z, weight, eps, norm_before_gate, activation, group_size,
                                          _gated_rms_norm_torch)
    return _gated_rms_norm_torch(x, z, weight, eps, norm_before_gate, activation, group_size)


def _gated_rms_norm_torch(x, z, weight, eps, norm_before_gate=True, activation="silu", group_size=None):
    act = pointwise.sigmoid if activation == "sigmoid" else pointwise.silu
    orig = x.dtype
    x32 = x.to(torch.float32)
    z32 = None if z is None else z.to(torch.float32)
    if z32 is not None and not norm_before_gate:
        x32 = x32 * act(z32)
    if group_size is None:
        out = _normalize(x32, eps) * weight.to(torch.float32)
    else:
        g = x32.reshape(*x32.shape[:-1], -1, group_size)
        out = _normalize(g, eps).reshape(x32.shape) * weight.to(torch.float32)
    if z32 is not None and norm_before_gate:
        out = out * act(z32)
    return out.to(orig)
