"""Activations (no reductions; transcendental parts through :mod:`vllm_bi.ops.pointwise`)."""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise

__all__ = ["silu_mul"]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in x.dtype (silu rounded to x.dtype first, as vLLM's native op)."""
    d = x.shape[-1] // 2
    return pointwise.silu(x[..., :d]).to(x.dtype) * x[..., d:]
