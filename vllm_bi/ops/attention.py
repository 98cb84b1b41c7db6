"""Causal softmax attention whose output for a query depends only on its position.

A query at absolute position ``p`` attends keys ``0..p``. Its keys are padded
(masked) to a bucket length ``B = max(16, next_pow2(p + 1))`` that depends on
``p`` alone, so its row is computed with the same shapes whether it arrives
in a long prefill, a split prefill, or a one-token decode, and whatever else
is batched. Every step is a per-row operation:

* scores ``q·k``: bf16×bf16 products (exact in fp32) summed over the head dim
  by :func:`vllm_bi.ops.reduce.row_sum` in fp32, then scaled;
* softmax in fp32 with ``row_sum`` over exactly ``B`` entries (masked ones are
  exact zeros);
* ``sum_j p_j v_j`` as an fp32 elementwise product reduced by ``row_sum`` over
  the ``B`` keys, then divided by the softmax denominator, rounded once.

Rows are batched across sequences (:func:`causal_attention_rows`): the rows of
one bucket, from any sequences, each with its own keys gathered, go through
the same few kernels, in chunks of bounded memory; neither the grouping nor
the chunking changes a row's bits.

Shapes: ``q [Tq, H, D]``, ``k, v [L, Hkv, D]`` (the sequence's keys and values
from position 0), ``positions [Tq]`` absolute positions of the queries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.reduce import row_sum

__all__ = ["causal_attention", "causal_attention_rows", "bucket_len", "latent_keys_values"]

MIN_BUCKET = 16
# bytes of the largest temporary of one chunk of rows ([rows, H, B, D] fp32); rows are chunked to it
CHUNK_BYTES = 256 << 20


def bucket_len(n_keys: int) -> int:
    b = MIN_BUCKET
    while b < n_keys:
        b *= 2
    return b


def _attend(q: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk of rows of one bucket: ``q [r, H, D]``, ``pos [r]`` (device), ``k, v [r, B, Hkv, D]`` each
    row's keys ``0..B-1`` of its own sequence (entries after its position are masked and may hold
    anything). Returns ``[r, H, D]`` in ``q.dtype``."""
    r, H, D = q.shape
    B, Hkv = k.shape[1], k.shape[2]
    rep = H // Hkv
    valid = torch.arange(B, device=q.device).view(1, B) <= pos.view(-1, 1)  # [r, B]
    # each row's order of summation is row_sum's, whatever the batch: no need for float64's exactness
    k32 = k.to(torch.float32).repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)  # [r, H, B, D]
    s = row_sum(q.to(torch.float32).unsqueeze(2) * k32).squeeze(-1) * scale  # [r, H, B]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = torch.amax(s, dim=-1, keepdim=True)
    e = pointwise.exp(s - m)  # masked -> exactly 0
    denom = row_sum(e)  # [r, H, 1]
    v32 = torch.where(valid.view(r, B, 1, 1), v.to(torch.float32), 0.0)  # masked keys may be garbage
    vt = v32.repeat_interleave(rep, dim=2).permute(0, 2, 3, 1)  # [r, H, D, B]
    num = row_sum(e.unsqueeze(2) * vt)  # [r, H, D, 1]
    return (num.squeeze(-1) / denom).to(q.dtype)


def causal_attention_rows(
    q: torch.Tensor, positions: list[int], gather: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    scale: float, to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention for the rows of ``q [T, H, D]`` of any number of sequences at once.

    ``positions[i]``: row ``i``'s absolute position in its sequence. ``gather(rows, B)`` (``rows``: row indices
    on ``q``'s device) returns the keys and values ``[len(rows), B, Hkv, D]`` of those rows' sequences,
    positions ``0..B-1`` (only those up to each row's position are read). ``to_device`` moves small host-built index tensors (default ``.to``). Returns
    ``[T, H, D]`` in ``q.dtype``."""
    T, H, D = q.shape
    dev = q.device
    to_device = to_device or (lambda t: t.to(dev))
    out = torch.empty((T, H, D), dtype=q.dtype, device=dev)
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(positions):
        buckets.setdefault(bucket_len(p + 1), []).append(i)
    for B, rows in sorted(buckets.items()):
        per = max(1, CHUNK_BYTES // (B * H * D * 4))
        for c in range(0, len(rows), per):
            idx = rows[c : c + per]
            host = torch.tensor([idx, [positions[i] for i in idx]], dtype=torch.long)
            idx_t, pos_t = to_device(host)
            k, v = gather(idx_t, B)
            if k.shape[2] == 0 or H % k.shape[2]:
                raise ValueError(f"query heads {H} not a multiple of kv heads {k.shape[2]}")
            out[idx_t] = _attend(q[idx_t], pos_t, k, v, scale)
    return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int] | torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: ``q [Tq, H, D]`` at ``positions``, its keys and values ``k, v [L, Hkv, D]`` from
    position 0. Returns ``[Tq, H, D]`` in q.dtype."""
    positions = [int(p) for p in (positions.tolist() if torch.is_tensor(positions) else positions)]
    L = k.shape[0]
    if positions and max(positions) >= L:
        raise ValueError(f"query position {max(positions)} has no key (only {L} keys)")

    def gather(rows, B):
        j = torch.arange(B, device=k.device).clamp(max=L - 1)  # keys after L are masked for every row
        return k[j].unsqueeze(0).expand(rows.numel(), -1, -1, -1), v[j].unsqueeze(0).expand(rows.numel(), -1, -1, -1)

    return causal_attention_rows(q, positions, gather, scale)


def latent_keys_values(latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int,
                       nope: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention's keys and values, decompressed from the latent of each row: ``latent [..., r]``
    (normalised), ``k_pe [..., rope]`` (the key part all heads share), ``kv_b_weight [H * (nope + dv), r]``.
    Returns ``k, v [..., H, nope + rope]``: ``v`` zero-padded to the key's head dim, so one attention op serves
    both (the zero columns change no other column; callers cut them off). The product is row-local, so a row's
    bits do not depend on how many rows are decompressed together: the trainer decompresses a sequence's rows, the
    server its cached blocks."""
    rope = k_pe.shape[-1]
    if dv > nope + rope:
        raise ValueError(f"a value head dim {dv} above the key's {nope + rope} is not supported")
    lead = latent.shape[:-1]
    kv = bi_linear(latent, kv_b_weight).view(*lead, num_heads, nope + dv)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(-2).expand(*lead, num_heads, rope)], dim=-1)
    return k, torch.nn.functional.pad(kv[..., nope:], (0, nope + rope - dv))
