"""One memory layout for the rows a reducing Triton kernel reads.

Triton compiles a kernel once per pattern of what it may assume of its arguments: a pointer aligned to 16 bytes, an
integer divisible by 16. Those assumptions set the vector width of the loads and with it the register layout of a
block, and a float ``tl.sum`` adds its lanes in the order that layout gives. So the same row can get other bits when
it arrives as a strided view (vLLM slices padded buffers), at an odd offset, or contiguous with another row stride.
:func:`canonical_rows` hands every such kernel rows in one layout, whatever the caller's: a base aligned to 16 bytes
and a row stride that is a multiple of 16 elements, copying only the inputs not already in it. On CUDA the kernels
take it where :func:`wanted` says so (``vllm_bi.settings.CANONICAL_ROWS_CUDA``).
"""

from __future__ import annotations

import torch

from vllm_bi import settings

__all__ = ["ALIGN", "canonical_rows", "aligned", "wanted"]

ALIGN = 16  # Triton's divisibility assumption: bytes for a pointer, the value for an integer


def wanted(x: torch.Tensor) -> bool:
    """Whether a kernel reads ``x``'s rows in the one layout: always off CUDA (Triton's interpreter, for tests); on
    CUDA as :data:`vllm_bi.settings.CANONICAL_ROWS_CUDA` says."""
    return x.device.type != "cuda" or settings.CANONICAL_ROWS_CUDA


def _ok(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0


def canonical_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as ``[rows, n]`` with unit stride along a row, its base 16-byte aligned and its row stride a multiple of
    16 elements: a view of ``x`` when it already is, else a copy into a buffer whose rows are padded to that stride."""
    x2 = x.reshape(-1, n)
    if x2.stride(-1) == 1 and x2.stride(0) % ALIGN == 0 and _ok(x2):
        return x2
    buf = torch.empty(x2.shape[0], -(-n // ALIGN) * ALIGN, dtype=x.dtype, device=x.device)
    out = buf[:, :n]
    out.copy_(x2)
    return out


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (a copy where it is not)."""
    t = t.contiguous()
    return t if _ok(t) else t.clone()
