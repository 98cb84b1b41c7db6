"""vLLM glue: attention backends routed to :func:`vllm_bi.ops.attention.causal_attention`.

The stock CPU_ATTN kernel packs its cache per ISA and picks its tiling from
the batch; under batch invariance vllm_bi owns the cache layout instead
(``kv_cache [num_blocks, Hkv, block_size, 2*D]``: key in ``[..., :D]``, value
in ``[..., D:]``) and computes each sequence's queries from its own blocks.

That is also the logical layout of vLLM's TRITON_ATTN cache on CUDA, so
:func:`bi_attn_forward` serves both (on CUDA the stock ``do_kv_cache_update``
writes the cache: a copy, exact).
"""

from __future__ import annotations

import torch

from vllm_bi.ops.attention import causal_attention

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
    qsl = attn_metadata.query_start_loc.tolist()
    seq_lens = attn_metadata.seq_lens.tolist()
    bt = attn_metadata.block_table
    q_all = query.reshape(query.shape[0], -1, d)
    out_v = output.view(output.shape[0], -1, d)
    for i in range(len(seq_lens)):
        s, e, L = qsl[i], qsl[i + 1], seq_lens[i]
        if e == s:
            continue
        nb = (L + block_size - 1) // block_size
        blocks = bt[i, :nb].long()
        kv = kv_cache[blocks].permute(0, 2, 1, 3).reshape(nb * block_size, hkv, two_d)[:L]
        positions = list(range(L - (e - s), L))
        out_v[s:e] = causal_attention(q_all[s:e], kv[..., :d], kv[..., d:], positions, self.scale).to(output.dtype)
    return output


bi_cpu_attn_forward = bi_attn_forward
