"""Softmax and log-softmax over the last dim, row by row, batch-invariant.

``log_softmax`` is also the function the server uses for the logprobs it
returns (CPU, model runner V1), so the trainer calling it on identical logits
gets identical logprobs.
"""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.reduce import row_sum

__all__ = ["softmax", "log_softmax", "logsumexp"]


def _last_dim(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, bool]:
    dim = dim % x.dim() if x.dim() else 0
    if dim == x.dim() - 1:
        return x, False
    return x.transpose(dim, -1), True


def _fused_wanted() -> bool:
    from vllm_bi.settings import current

    return current().logprobs_op("cuda") == "triton"


def logsumexp(x32: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x)))`` over the last dim of an fp32 tensor, keepdim."""
    m = torch.amax(x32, dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m + pointwise.log(row_sum(pointwise.exp(x32 - m)))


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """``x - logsumexp(x)`` in fp32 (result cast to ``dtype``, default fp32). Under ``VLLM_BI_LOGPROBS=triton`` a
    CUDA tensor takes one Triton kernel instead (:mod:`vllm_bi.ops.softmax_triton`: the same formula, other bits)."""
    x, moved = _last_dim(x, dim)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and _fused_wanted():
        from vllm_bi.ops.softmax_triton import fused_log_softmax

        out = fused_log_softmax(x)
    else:
        x32 = x.to(torch.float32)
        out = x32 - logsumexp(x32)
    if moved:
        out = out.transpose(dim, -1)
    return out.to(dtype or x.dtype)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` computed in fp32, cast to ``dtype`` (default x.dtype)."""
    x, moved = _last_dim(x, dim)
    x32 = x.to(torch.float32)
    m = torch.amax(x32, dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = pointwise.exp(x32 - m)
    out = e / row_sum(e)
    if moved:
        out = out.transpose(dim, -1)
    return out.to(dtype or x.dtype)
