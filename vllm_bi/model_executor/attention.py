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

Multi-head latent attention (Kimi Linear's, :func:`bi_mla_forward`) keeps vLLM's latent cache (CPU_MLA's on CPU,
TRITON_MLA's on CUDA) and decompresses the blocks a step reads into that same layout, then attends as above.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_bi.ops.device import host_to, step_cached
from vllm_bi.ops.attention import causal_attention_rows, latent_keys_values
from vllm_bi.ops.attention_triton import attention_backend, paged_attention, tiles_for
from vllm_bi.ops.norm import rms_norm_maybe_residual

__all__ = ["bi_attn_forward", "bi_cpu_attn_forward", "bi_cpu_kv_cache_update", "bi_mla_forward", "mla_unsupported",
           "wrap_mla_build", "MLA_ANY_BLOCK_SIZE", "MLA_WHOLE_BLOCKS"]


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
    d = kv_cache.shape[-1] // 2
    _paged_rows(query.reshape(query.shape[0], -1, d), kv_cache, attn_metadata, self.scale,
                output.view(output.shape[0], -1, d))
    return output


def _paged_rows(q_all: torch.Tensor, kv_cache: torch.Tensor, md, scale: float, out: torch.Tensor,
                mla: bool = False) -> None:
    """Write the attention of the step's query rows ``q_all [T, H, D]`` into ``out [T, H, D]``, each row over its
    sequence's keys and values in the paged cache ``kv_cache [blocks, Hkv, block_size, 2 * D]``. ``md``: the step's
    ``query_start_loc``, ``seq_lens``, ``block_table`` (and ``max_query_len``). ``mla``: the rows are multi-head
    latent attention's (the op's choice, :func:`vllm_bi.ops.attention_triton.attention_backend`)."""
    _, hkv, block_size, two_d = kv_cache.shape
    d = two_d // 2
    dev = q_all.device
    if attention_backend(dev, mla) == "triton":
        tiles = _tiles(md, dev, q_all.shape[1], hkv)
        paged_attention(q_all, kv_cache, md.block_table, tiles, scale, out=out)
        return
    seq_t, positions = _rows(md, dev)
    q_all = q_all[: len(positions)]
    table = md.block_table
    kv_rows = kv_cache.reshape(-1, two_d)  # row (block * Hkv + h) * block_size + offset; a view, no copy
    heads = torch.arange(hkv, device=dev)

    def gather(rows, B):
        j = torch.arange(B, device=dev)
        blocks = table[seq_t[rows]][:, (j // block_size).clamp(max=table.shape[1] - 1)].long()  # [r, B]
        flat = (blocks.unsqueeze(-1) * hkv + heads) * block_size + (j % block_size).view(1, B, 1)  # [r, B, Hkv]
        kv = kv_rows[flat]  # keys past a sequence's length read other blocks: masked in the op
        return kv[..., :d], kv[..., d:]

    rows = causal_attention_rows(q_all, positions, gather, scale, lambda t: host_to(t, dev))
    out[: len(positions)] = rows.to(out.dtype)


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


def mla_unsupported(layer) -> str | None:
    """What of an MLA layer :func:`bi_mla_forward` does not serve, or None."""
    if getattr(layer, "q_lora_rank", None) is not None:
        return "a low-rank query"
    if getattr(layer, "rotary_emb", None) is not None:
        return "rotary embeddings"
    if getattr(layer, "use_output_gate", False):
        return "an output gate"
    if getattr(layer, "kv_cache_dtype", "auto") not in ("auto", "bfloat16", "float16", "float32"):
        return f"kv cache dtype {layer.kv_cache_dtype}"
    if getattr(layer, "dcp_world_size", 1) > 1:
        return "decode context parallelism"
    return None


def bi_mla_forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """Replacement for Kimi Linear's ``MultiHeadLatentAttention.forward`` under batch invariance: the trainer's
    ``models.kimi_linear.mla_block`` over vLLM's latent cache, one formulation for prefill and decode. The
    normalised latent and the shared key part are written to the cache; every cached block the step's sequences
    use is decompressed by ``kv_b_proj`` (:func:`vllm_bi.ops.attention.latent_keys_values`, row-local) into a
    paged key/value cache of the attention op's layout, which the step's rows attend over as in
    :func:`bi_attn_forward`. vLLM's weight-absorbed decode never runs."""
    reason = mla_unsupported(self)
    if reason:
        raise NotImplementedError(f"vllm_bi: multi-head latent attention with {reason} is not batch-invariant yet")
    T, H = hidden_states.shape[0], self.num_local_heads
    nope, rope, dv, r = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
    q = self.q_proj(hidden_states)[0].view(T, H, nope + rope)
    kv_a = self.kv_a_proj_with_mqa(hidden_states)[0]
    norm = self.kv_a_layernorm
    latent = rms_norm_maybe_residual(kv_a[:, :r], None, norm.weight, norm.variance_epsilon)
    attn = torch.zeros((T, H, nope + rope), dtype=q.dtype, device=q.device)
    md, slots = _mla_step(self)
    if md is not None and md.num_actual_tokens:
        n = md.num_actual_tokens
        cache = self.kv_cache  # [blocks, block_size, r + rope]: the normalised latent, then the shared key part
        flat = cache.view(-1, cache.shape[-1])
        s = slots[:n].long()
        valid = s >= 0
        flat[s[valid]] = torch.cat([latent[:n], kv_a[:n, r:]], dim=-1)[valid].to(cache.dtype)
        step = _mla_layout(md, cache.shape[1], q.device)
        lat = cache[step.blocks]  # [sequences * blocks each, block_size, r + rope]
        k, v = latent_keys_values(lat[..., :r], lat[..., r:], self.kv_b_proj.weight, H, nope, dv)
        kv = torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()  # [blocks, H, block_size, 2 * (nope + rope)]
        _paged_rows(q[:n], kv, step, self.scale, attn[:n], mla=True)
    return self.o_proj(attn[..., :dv].reshape(T, H * dv))[0]


def _mla_step(layer):
    """The step's MLA metadata of ``layer`` and its slot mapping, or ``(None, None)`` in a dummy run."""
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    md = fc.attn_metadata
    if md is None:
        return None, None
    md = md[layer.layer_name] if isinstance(md, dict) else md
    slots = fc.slot_mapping[layer.layer_name] if isinstance(fc.slot_mapping, dict) else md.slot_mapping
    return md, slots


def _mla_layout(md, block_size: int, dev):
    """Once per step: the cache blocks the step's sequences use, in table order (``blocks``), and the step as
    :func:`_paged_rows` reads it, over a decompressed cache that holds those blocks in that order."""
    layout = getattr(md, "vllm_bi_layout", None)  # kept by wrap_mla_build
    if layout is None:
        raise RuntimeError(f"vllm_bi: the MLA metadata ({type(md).__name__}) has no step layout: its backend's "
                           "builder is not the one the batch-invariant MLA forward wraps; serve with "
                           "--attention-backend CPU_MLA (CPU) or TRITON_MLA (CUDA)")
    seq_lens, table = layout

    def build():
        R = seq_lens.shape[0]
        per = -(-md.max_seq_len // block_size)
        blocks = table[:R, :per].reshape(-1).long()
        own = torch.arange(R * per, device=dev, dtype=torch.int32).view(R, per)
        return SimpleNamespace(blocks=blocks, block_table=own, query_start_loc=md.query_start_loc, seq_lens=seq_lens,
                               max_query_len=md.max_query_len)

    return step_cached(md, "_vllm_bi_mla_layout", dev, build)


def wrap_mla_build(build):
    """vLLM's MLA metadata splits the step's block table and lengths between its decode and prefill parts; the
    batch-invariant forward reads every row in one pass, so the whole step's ``(seq_lens, block_table)`` are kept
    on the metadata too."""

    def wrapped(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        md.vllm_bi_layout = (common_attn_metadata.seq_lens, common_attn_metadata.block_table_tensor)
        return md

    return wrapped


def _any_block_size(cls, block_size: int | None) -> bool:
    return True


def _whole_blocks(kv_cache_spec=None) -> list:
    from vllm.v1.attention.backend import MultipleOf

    return [MultipleOf(16)]


# CPU_MLA's kernels serve one block size; bi_mla_forward reads the latent cache itself, at the block size the hybrid
# layout needs, in whole cache blocks (a cache block split into kernel blocks of 16 would be zeroed by vLLM's CPU
# runner in the wrong units: it indexes the split cache with a new block's id)
MLA_ANY_BLOCK_SIZE = classmethod(_any_block_size)
MLA_WHOLE_BLOCKS = staticmethod(_whole_blocks)
