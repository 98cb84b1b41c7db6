"""Elementwise activations (batch-invariant by construction: no reductions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_mul"]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in x.dtype, as vLLM's ``SiluAndMul.forward_native``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
