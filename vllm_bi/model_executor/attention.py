"""vLLM glue: attention backends routed to the op library's batch-invariant attention.

The op is :func:`vllm_bi.ops.attention_triton.paged_attention` (one Triton kernel) on CUDA and
:func:`vllm_bi.ops.attention.causal_attention_rows` on CPU, as ``VLLM_BI_ATTENTION`` picks
(:func:`vllm_bi.ops.attention_triton.attention_backend`; the trainer reads the same setting).

The stock CPU_ATTN kernel packs its cache per ISA and picks its tiling from
the batch; under batch invariance vllm_bi owns the cache layout instead
(``kv_cache [num_blocks, Hkv, block_size, 2*D]``: key in ``[..., :D]``, value
in ``[..., D:]``) and computes every query row of the step at once, each from its own
sequence's blocks.

That is also the logical layout of vLLM's TRITON_ATTN cache on CUDA, so
:func:`bi_attn_forward` serves both (on CUDA the stock ``do_kv_cache_update``
writes the cache: a copy, exact).
"""

from __future__ import annotations

import torch

from vllm_bi.ops.device import host_to, step_cached
from vllm_bi.ops.attention import causal_attention_rows
from vllm_bi.ops.attention_triton import attention_backend, paged_attention, tiles_for

__all__ = ["bi_attn_forward", "bi_cpu_attn_forward", "bi_cpu_kv_cache_update"]


def _unsupported(impl) -> str | None:
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
        return "sliding window"
    if getattr(impl, "logits_soft_cap", None) not in (None, 0, 0.0):
        return "logit soft-cap"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "kv_cache_dtype", "auto") not in ("auto", "bfloat16", "float16", "float32"):
        return f"kv cache dtype {impl.kv_cache_dtype}"
    return None


def bi_cpu_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
    _, hkv, block_size, two_d = kv_cache.shape
    d = two_d // 2
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    valid = slots >= 0
    rows = torch.cat([key[:n].view(n, hkv, d), value[:n].view(n, hkv, d)], dim=-1).to(kv_cache.dtype)
    blk, off = slots[valid] // block_size, slots[valid] % block_size
    kv_cache[blk, :, off, :] = rows[valid]


def bi_attn_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("vllm_bi: fused output quantization is not batch-invariant")
    if attn_metadata is None:
        return output
    reason = _unsupported(self)
    if reason:
        raise NotImplementedError(f"vllm_bi: attention with {reason} is not batch-invariant yet")
    if getattr(self, "attn_type", "decoder") != "decoder":  # AttentionType is a str enum
        raise NotImplementedError(f"vllm_bi: {self.attn_type} attention is not batch-invariant yet")
    if not attn_metadata.causal:
        raise NotImplementedError("vllm_bi: non-causal attention is not batch-invariant yet")
    _, hkv, block_size, two_d = kv_cache.shape
    d = two_d // 2
    q_all = query.reshape(query.shape[0], -1, d)
    dev = q_all.device
    if attention_backend(dev) == "triton":
        tiles = _tiles(attn_metadata, dev, q_all.shape[1], hkv)
        paged_attention(q_all, kv_cache, attn_metadata.block_table, tiles, self.scale,
                        out=output.view(output.shape[0], -1, d))
        return output
    seq_t, positions = _rows(attn_metadata, dev)
    q_all = q_all[: len(positions)]
    table = attn_metadata.block_table
    kv_rows = kv_cache.reshape(-1, two_d)  # row (block * Hkv + h) * block_size + offset; a view, no copy
    heads = torch.arange(hkv, device=dev)

    def gather(rows, B):
        j = torch.arange(B, device=dev)
        blocks = table[seq_t[rows]][:, (j // block_size).clamp(max=table.shape[1] - 1)].long()  # [r, B]
        flat = (blocks.unsqueeze(-1) * hkv + heads) * block_size + (j % block_size).view(1, B, 1)  # [r, B, Hkv]
        kv = kv_rows[flat]  # keys past a sequence's length read other blocks: masked in the op
        return kv[..., :d], kv[..., d:]

    out = causal_attention_rows(q_all, positions, gather, self.scale, lambda t: host_to(t, dev))
    output.view(output.shape[0], -1, d)[: len(positions)] = out.to(output.dtype)
    return output


def _tiles(md, dev, h: int, hkv: int) -> torch.Tensor:
    """The step's query tiles for the Triton kernel (:func:`tiles_for`), on ``dev``. A step of one-token decodes
    (``max_query_len == 1``) builds them on the device, without a host read (as a captured CUDA-graph step
    must): tile ``i`` is row ``i`` of sequence ``i`` at position ``seq_lens[i] - 1`` (a padded entry's length
    0 gives position 0: a finite row nobody reads)."""

    def build():
        if getattr(md, "max_query_len", None) == 1:
            n = md.seq_lens.shape[0]
            i = torch.arange(n, device=dev, dtype=torch.int32)
            pos = (md.seq_lens.to(device=dev, dtype=torch.int32) - 1).clamp_(min=0)
            return torch.stack([i, i, torch.ones_like(i), pos], dim=1)
        return _tiles_host(md, dev, h, hkv)

    return step_cached(md, "_vllm_bi_tiles", dev, build)


def _host_layout(md) -> tuple[list[int], list[int], list[int]]:
    """Each sequence's first query row, number of query rows and first row's absolute position, read from the
    metadata on the host."""
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    n = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    return qsl[:-1], n, [L - k for L, k in zip(seq_lens, n)]


def _tiles_host(md, dev, h: int, hkv: int) -> torch.Tensor:
    """:func:`_tiles` of a general step, from the metadata read on the host."""
    return host_to(tiles_for(h, hkv, *_host_layout(md)), dev)


def _rows(md, dev) -> tuple[torch.Tensor, list[int]]:
    """Each query row's sequence (on ``dev``) and absolute position, read from the metadata once per step
    (:func:`step_cached`)."""

    def build():
        seq_of_row, positions = [], []
        for i, (_, n, p) in enumerate(zip(*_host_layout(md))):
            seq_of_row += [i] * n
            positions += range(p, p + n)
        return host_to(torch.tensor(seq_of_row, dtype=torch.long), dev), positions

    return step_cached(md, "_vllm_bi_rows", dev, build)


bi_cpu_attn_forward = bi_attn_forward
