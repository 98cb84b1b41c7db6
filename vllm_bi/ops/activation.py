"""Activations (no reductions; transcendental parts through :mod:`vllm_bi.ops.pointwise`)."""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise, rows_triton

__all__ = ["silu_mul"]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in x.dtype (silu rounded to x.dtype first, as vLLM's native op).

    On CUDA under ``VLLM_BI_ROWWISE=triton``: one kernel (:mod:`vllm_bi.ops.rows_triton`)."""
    if rows_triton.wanted(x):
        return rows_triton.silu_mul(x, _silu_mul_torch)
    return _silu_mul_torch(x)


def _silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return pointwise.silu(x[..., :d]).to(x.dtype) * x[..., d:]
