"""Causal softmax attention whose output for a query depends only on its position.

A query at absolute position ``p`` attends keys ``0..p``. Its keys are padded
(masked) to a bucket length ``B = max(16, next_pow2(p + 1))`` that depends on
``p`` alone, so its row is computed with the same shapes whether it arrives
in a long prefill, a split prefill, or a one-token decode, and whatever else
is batched:

* scores ``q·k`` are exact: bf16×bf16 products summed in float64 (see
  :mod:`vllm_bi.ops.linear`), then rounded to fp32 and scaled;
* softmax in fp32 with the row reduction of :mod:`vllm_bi.ops.reduce` over
  exactly ``B`` entries (masked ones are exact zeros);
* ``sum_j p_j v_j`` as an fp32 elementwise product reduced over the last dim
  (length ``B``), then divided by the softmax denominator, rounded once.

Shapes: ``q [Tq, H, D]``, ``k, v [L, Hkv, D]`` (the sequence's keys and values
from position 0), ``positions [Tq]`` absolute positions of the queries.
"""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.reduce import row_sum

__all__ = ["causal_attention", "bucket_len"]

MIN_BUCKET = 16
_ROW_CHUNK = 16


def bucket_len(n_keys: int) -> int:
    b = MIN_BUCKET
    while b < n_keys:
        b *= 2
    return b


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int] | torch.Tensor, scale: float
) -> torch.Tensor:
    """Return ``[Tq, H, D]`` in q.dtype."""
    dev = q.device
    positions = [int(p) for p in (positions.tolist() if torch.is_tensor(positions) else positions)]
    Tq, H, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    if H % Hkv:
        raise ValueError(f"query heads {H} not a multiple of kv heads {Hkv}")
    if positions and max(positions) >= L:
        raise ValueError(f"query position {max(positions)} has no key (only {L} keys)")
    rep = H // Hkv
    out = torch.empty((Tq, H, D), dtype=q.dtype, device=dev)
    k64 = k.to(torch.float64).repeat_interleave(rep, dim=1)  # [L, H, D]
    v32 = v.to(torch.float32).repeat_interleave(rep, dim=1)
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(positions):
        buckets.setdefault(bucket_len(p + 1), []).append(i)
    for B, rows in buckets.items():
        n = min(B, L)
        kb = torch.zeros((B, H, D), dtype=torch.float64, device=dev)
        kb[:n] = k64[:n]
        vt = torch.zeros((H, D, B), dtype=torch.float32, device=dev)  # values with keys on the last dim
        vt[:, :, :n] = v32[:n].permute(1, 2, 0)
        kt = kb.permute(1, 2, 0)  # [H, D, B]
        key_idx = torch.arange(B, device=dev)
        for c in range(0, len(rows), _ROW_CHUNK):
            idx = rows[c : c + _ROW_CHUNK]
            pos = torch.tensor([positions[i] for i in idx], device=dev)
            qi = q[idx].to(torch.float64)  # [r, H, D]
            # exact scores: per head a [r, D] @ [D, B] GEMM in float64. torch.mm, not einsum/bmm: under
            # vLLM's BI mode on CUDA, aten::bmm is overridden by a Triton kernel with no float64 path.
            s = torch.stack([torch.mm(qi[:, h], kt[h]) for h in range(H)], dim=1).to(torch.float32) * scale
            mask = key_idx.view(1, 1, B) > pos.view(-1, 1, 1)
            s = s.masked_fill(mask, float("-inf"))
            m = torch.amax(s, dim=-1, keepdim=True)
            e = pointwise.exp(s - m)  # masked -> exactly 0
            denom = row_sum(e)  # [r, H, 1]
            num = row_sum(e.unsqueeze(2) * vt.unsqueeze(0))  # [r, H, D, 1]
            out[idx] = (num.squeeze(-1) / denom).to(q.dtype)
    return out
