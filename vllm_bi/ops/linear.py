"""Batch-invariant GEMM: ``y = x @ W.T (+ b)``.

The product is accumulated in float64, on CPU and on CUDA alike. Every bf16×bf16 product is exact
in float64 (16 significant bits), and so is their sum as long as the terms
span fewer than ~2^37 in magnitude (53 − 16 bits) — always true for trained
and random-init weights and activations. An exact sum has no order, so the
result for a row cannot depend on the number of rows, the BLAS kernel MKL or
oneDNN picks for that M, the thread count, or which process computes it; it
is then rounded once to the output dtype. (fp32 operands: products are exact,
sums are within one float64 ulp of exact, and the single rounding to fp32
hides that except on an exact rounding tie.)

CUDA: not implemented yet in vllm_bi; the server uses vLLM's own batch-invariant
persistent matmul on GPU.
"""

from __future__ import annotations

import torch

__all__ = ["bi_linear", "bi_mm", "bi_bmm"]


def _check_device(*ts: torch.Tensor) -> None:
    for t in ts:
        if t is not None and t.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"vllm_bi.ops.linear: no batch-invariant GEMM for device {t.device.type!r} (float64 needed: cpu, cuda)"
            )


def bi_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[..., K] @ weight[N, K].T + bias[N]`` -> ``[..., N]`` in ``out_dtype`` (default x.dtype)."""
    _check_device(x, weight, bias)
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float64)
    y = torch.mm(x2, weight.to(torch.float64).t())
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype).reshape(*lead, weight.shape[0])


def bi_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` with exact (float64) accumulation."""
    _check_device(a, b)
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    return torch.mm(a.to(torch.float64), b.to(torch.float64)).to(out_dtype)


def bi_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a[B, M, K] @ b[B, K, N]``, each batch entry by :func:`bi_mm` (no batch-wide kernel choice)."""
    _check_device(a, b)
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    if a.shape[0] == 0:
        return a.new_empty((0, a.shape[1], b.shape[2]), dtype=out_dtype)
    return torch.stack([bi_mm(a[i], b[i], out_dtype) for i in range(a.shape[0])])
