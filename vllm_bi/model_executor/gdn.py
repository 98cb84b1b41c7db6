"""vLLM glue for the batch-invariant GDN layer.

``BIGDNAttentionBackend`` is registered over vLLM's ``GDN_ATTN`` backend and
answers ``supports_batch_invariance() -> True``. That claim is true only
because :func:`bi_gdn_forward` replaces ``QwenGatedDeltaNetAttention``'s
forward: one path for decode, prefill and mixed batches on every device, the
scheduled sequences run together by :func:`vllm_bi.gdn.layer.gdn_varlen`
(on CPU one recurrence per sequence, on CUDA one fla-core varlen launch), each
from its fp32 state slot (zeros when the scheduler says it has none), final
state stored back.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from vllm_bi.gdn.chunk import CHUNK, gdn_mode
from vllm_bi.gdn.layer import RingRows, SlotRows, gdn_varlen
from vllm_bi.gdn.recurrent import state_dtype
from vllm_bi.ops.device import host_to, index_on, rows_of, step_cached

__all__ = ["BIGDNAttentionBackend", "BIGDNMetadataBuilder", "bi_gdn_forward", "bi_gdn_core", "chunk_state_shape",
           "chunk_kda_state_shape", "spec_step", "verify_rows", "is_kda", "bi_kda_forward",
           "padded_new_requests", "wrap_mamba_prepare_attn"]

try:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend as _GDNBase
except ImportError:  # vLLM missing or moved: the plugin's version check reports it
    _GDNBase = object


try:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as _GDNBuilderBase
except ImportError:
    _GDNBuilderBase = object


class BIGDNMetadataBuilder(_GDNBuilderBase):
    """vLLM's GDN metadata, plus each request's number of already computed tokens (``vllm_bi_num_computed``,
    on the device): the chunk-aligned mode needs the absolute position of a request's first new token."""

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        computed = common_attn_metadata.compute_num_computed_tokens()
        if _padded_decode(computed.device) and self._stage_decode(md.num_prefills, md.num_decodes,
                                                                  md.num_spec_decodes):
            # a decode step a CUDA graph may replay: the counts go where the captured step reads them, as vLLM's
            # own decode buffers do (entries past the step's requests are padding: their slot is the null block)
            buf = getattr(self, "_vllm_bi_computed", None)
            if buf is None or buf.device != computed.device:
                buf = self._vllm_bi_computed = torch.zeros(self.decode_cudagraph_max_bs, dtype=computed.dtype,
                                                           device=computed.device)
            buf[: md.num_decodes].copy_(computed[: md.num_decodes], non_blocking=True)
            computed = buf[: max(md.num_decodes, common_attn_metadata.num_reqs)]
        md.vllm_bi_num_computed = computed
        return md


class BIGDNAttentionBackend(_GDNBase):
    """vLLM's GDN metadata backend, declared batch-invariant (the forward is vllm_bi's)."""

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @staticmethod
    def get_builder_cls():
        return BIGDNMetadataBuilder


def _padded_decode(dev) -> bool:
    """Whether the chunk mode's decode steps run padded, planned on the device (``VLLM_BI_CHUNK_DECODE``)."""
    from vllm_bi.settings import current

    return gdn_mode() == "chunk" and current().chunk_decode_plan(torch.device(dev).type) == "padded"


def _split_qkvz(layer, hidden_states: torch.Tensor):
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    T = hidden_states.shape[0]
    if layer.gqa_interleaved_layout:  # Qwen3-Next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        mixed_qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
    else:  # Qwen3.5: [q, k, v, z] and [b, a]
        qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
        z_size = layer.value_dim // layer.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, z_size], dim=-1)
        z = z.reshape(T, -1, layer.head_v_dim)
        b, a = layer.split_ba(ba)
    return mixed_qkv, z, b, a


def bi_gdn_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Replacement for ``QwenGatedDeltaNetAttention.forward_*`` under batch invariance."""
    mixed_qkv, z, b, a = _split_qkvz(self, hidden_states)
    core = torch.zeros(
        (hidden_states.shape[0], self.num_v_heads // self.tp_size, self.head_v_dim),
        dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    bi_gdn_core(self, mixed_qkv, b, a, core)
    return self._output_projection(core, z)


def bi_kda_forward(self, hidden_states: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Replacement for Kimi Linear's ``KimiGatedDeltaNetAttention.forward`` under batch invariance: the trainer's
    ``models.kimi_linear.kda_block`` over vLLM's layer and cache. The merged q/k/v/beta/f_a projection, the forget
    gate ``f_b(f_a)`` per key channel and the output gate ``g_b(g_a(x))``, the GDN core with KDA's gate
    (:func:`bi_gdn_core`), the sigmoid-gated norm with the layer's eps, ``o_proj``."""
    from vllm_bi.ops.norm import gated_rms_norm

    if getattr(self, "use_full_rank_gate", False):
        raise NotImplementedError("vllm_bi: a KDA layer with a full-rank output gate (Kimi K3) is not "
                                  "batch-invariant yet")
    T, H, K = hidden_states.shape[0], self.local_num_heads, self.head_dim
    P = H * K
    projected, _ = self.in_proj_qkvgfab(hidden_states)
    mixed_qkv, beta, f_a = projected.split([3 * P, H, K], dim=-1)
    forget = self.f_b_proj(f_a)[0].view(T, H, K)
    gate = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0].view(T, H, K)
    core = torch.zeros((T, H, K), dtype=hidden_states.dtype, device=hidden_states.device)
    bi_gdn_core(self, mixed_qkv, beta, forget, core)
    y = gated_rms_norm(core, gate, self.o_norm.weight, self.o_norm.eps, True, "sigmoid")
    return self.o_proj(y.reshape(T, P))[0]


def _metadata(layer):
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, dict):
        md = md.get(layer.prefix)
    return md


def bi_gdn_core(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out [T, HV, V]`` for every scheduled sequence and update its state slots (CPU and CUDA)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    md = _metadata(layer)
    if md is None or md.num_actual_tokens == 0:
        return  # profiling / dummy run
    conv_cache, ssm_cache = layer.kv_cache[0], layer.kv_cache[1]
    if ssm_cache.dtype != state_dtype():
        raise RuntimeError(
            f"vllm_bi: GDN state cache is {ssm_cache.dtype}, the GDN state (VLLM_BI_GDN_STATE) needs "
            f"{state_dtype()} (--mamba-ssm-cache-dtype {str(state_dtype()).removeprefix('torch.')})"
        )
    weight = layer.conv1d.weight
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    W = weight.shape[-1]
    dev = mixed_qkv.device
    dim_first = is_conv_state_dim_first()
    kv_layout = _kv_layout(dev)
    if is_kda(layer) and getattr(layer, "num_spec", 0):
        raise NotImplementedError("vllm_bi: Kimi Delta Attention is served without speculative decoding only "
                                  "(drop --speculative-config)")
    if getattr(layer, "num_spec", 0):  # a server with speculative decoding: its own step (conv slots of W - 1 + k rows)
        spec_step(layer, mixed_qkv, b, a, out, md, conv_cache, ssm_cache, weight, dim_first, kv_layout)
        return
    if md.num_spec_decodes or md.spec_sequence_masks is not None:
        raise NotImplementedError("vllm_bi: speculative decoding metadata in a layer without speculative slots")
    plan = step_plan(md, dev)
    if plan is None:
        return
    mode = gdn_mode()
    slot_t = plan.slot_t
    if plan.padded:
        _chunk_decode_padded(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first)
        return
    if mode == "chunk":
        if debug_nonfinite():
            _check_finite(layer, "input", plan, mixed_qkv, a, b, ssm_cache)
        _chunk_core(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first, kv_layout)
        if debug_nonfinite():
            _check_finite(layer, "output", plan, out, None, None, ssm_cache)
        return
    if (kv_layout and _in_place(dev) and _direct_io(dev) and not is_kda(layer) and _in_order(plan.ranges)
            and out.dtype == mixed_qkv.dtype):
        _recurrent_direct(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first)
        return
    conv_states = gather_slots(conv_cache, slot_t, plan.fresh)
    if dim_first:
        conv_states = conv_states.transpose(1, 2)  # -> [N, W-1, D]
    new_conv = _recurrent_step(layer, mixed_qkv, b, a, out, plan, conv_states[:, -(W - 1) :], ssm_cache, weight,
                               kv_layout)
    if dim_first:
        new_conv = new_conv.transpose(1, 2)
    conv_cache[slot_t] = new_conv.to(conv_cache.dtype)


_REPORTED: set = set()


def debug_nonfinite() -> bool:
    """``VLLM_BI_DEBUG_NONFINITE=1``: every GDN layer checks its inputs, outputs and state slots for NaN / inf and
    logs the first layer and requests where one appears (host reads in every layer: for finding a bad layer, not for
    serving)."""
    from vllm_bi.settings import current

    return current().debug_nonfinite


def _check_finite(layer, where, plan, x, a, b, ssm_cache) -> None:
    import logging

    key = (getattr(layer, "prefix", "?"), where)
    if key in _REPORTED:
        return
    bad = []
    for name, t in (("mixed_qkv" if where == "input" else "core output", x), ("a", a), ("b", b)):
        if t is None:
            continue
        rows = (~torch.isfinite(t.float())).reshape(t.shape[0], -1).any(-1).nonzero().flatten().tolist()
        if rows:
            reqs = [j for j, (s, e) in enumerate(plan.ranges) if any(s <= r < e for r in rows)]
            bad.append(f"{name}: rows {rows[:8]} of requests {[(j, plan.ranges[j], (plan.starts or [None] * (j + 1))[j], j in plan.fresh_host) for j in reqs[:8]]} (index, rows, start, new)")
    slots = plan.slot_t.tolist()
    st = ssm_cache[plan.slot_t].float()
    nf = [(j, slots[j]) for j in range(len(slots)) if not bool(torch.isfinite(st[j]).all())]
    if nf:
        bad.append(f"state slots not finite (request, slot) {nf[:8]}; new requests {plan.fresh_host[:8]}")
    if bad:
        _REPORTED.add(key)
        logging.getLogger("vllm_bi").error("vllm_bi: non-finite values at the %s of GDN layer %s: %s", where,
                                           key[0], "; ".join(bad))


class StepPlan:
    """What :func:`bi_gdn_core` reads from one scheduler step's metadata, the same for every GDN layer of the
    step: the scheduled sequences' query ``ranges`` and packed ``rows`` (device), their state ``slot_t``
    (device), ``fresh`` (device indices of the new requests, whose states start from zeros; None if none) and,
    for the chunk mode, each one's number of already computed tokens ``starts``."""

    def __init__(self, ranges, rows, slot_t, fresh, starts, fresh_host=()):
        self.ranges, self.rows, self.slot_t, self.fresh, self.starts = ranges, rows, slot_t, fresh, starts
        self.fresh_host = list(fresh_host)  # ``fresh`` on the host
        self.padded = False  # a chunk-mode decode step planned on the device (_chunk_decode_padded; starts: device)
        self.chunk: dict = {}  # the chunk mode's indices (_chunk_index), per history width
        self._fresh_flags = None

    def fresh_flags(self) -> torch.Tensor | None:
        """``fresh`` as one int32 flag per sequence (nonzero: starts from zeros), built once per step and shared by
        the GDN layers; None when no request is new."""
        if self.fresh is not None and self._fresh_flags is None:
            flags = torch.zeros(len(self.ranges), dtype=torch.int32, device=self.fresh.device)
            self._fresh_flags = flags.index_fill_(0, self.fresh, 1)
        return self._fresh_flags


def step_plan(md, dev) -> StepPlan | None:
    """The :class:`StepPlan` of ``md``, built on the first GDN layer of a step and kept on the metadata object
    (:func:`step_cached`), so that the host reads the scheduler's device tensors once per step rather than once
    per layer (each read synchronises the stream). None when no sequence has new tokens."""
    return step_cached(md, "_vllm_bi_plan", dev, lambda: _build_plan(md, dev))


def _build_plan(md, dev) -> StepPlan | None:
    n_dec, n_pre = md.num_decodes, md.num_prefills
    mode = gdn_mode()
    if n_pre == 0 and n_dec and getattr(md, "num_decode_tokens", None) == n_dec:
        if mode == "recurrent":
            return _decode_plan(md, n_dec, dev)
        if mode == "chunk" and _padded_decode(dev):
            plan = _decode_plan(md, n_dec, dev)
            plan.starts, plan.padded = md.vllm_bi_num_computed[:n_dec].long(), True
            return plan
    # Scheduled sequences: decodes first, then prefills; a decode always continues from its state.
    qsl = md.non_spec_query_start_loc.tolist()
    slots = md.non_spec_state_indices_tensor.tolist()
    has_init = [True] * n_dec
    if n_pre:
        has_init += [bool(x) for x in md.has_initial_state[n_dec : n_dec + n_pre].tolist()]
    seqs = [i for i in range(n_dec + n_pre) if qsl[i + 1] > qsl[i]]
    if not seqs:
        return None
    ranges = [(qsl[i], qsl[i + 1]) for i in seqs]
    fresh = [j for j, i in enumerate(seqs) if not has_init[i]]
    starts = None
    if mode == "chunk":
        computed = md.vllm_bi_num_computed[: n_dec + n_pre].tolist()
        starts = [computed[i] for i in seqs]
    return StepPlan(ranges, rows_of(ranges, dev), host_to(torch.tensor([slots[i] for i in seqs]), dev),
                    host_to(torch.tensor(fresh), dev) if fresh else None, starts, fresh)


def _decode_plan(md, n: int, dev) -> StepPlan:
    """The plan of a step of ``n`` one-token decodes (recurrent mode), read from the metadata without a host
    read: sequence ``i`` is row ``i``, its slot is ``non_spec_state_indices_tensor[i]`` on the device, and no
    request is new. The same plan the host path builds, so the same bits; and nothing in it needs the host,
    which a captured (CUDA-graph) decode step requires. A padded entry (vLLM's ``PAD_SLOT_ID``, -1) reads and
    writes slot 0, vLLM's null block, never a request's."""
    ranges = _decode_ranges(n)
    slot_t = md.non_spec_state_indices_tensor[:n].long().clamp(min=0)  # out of place: the tensor is vLLM's
    return StepPlan(ranges, rows_of(ranges, dev), slot_t, None, None)


@lru_cache(maxsize=64)
def _decode_ranges(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n)]


def _kv_layout(dev: torch.device) -> bool:
    """Whether the state slots hold fla-core's ``[HV, K, V]`` order (:func:`state_memory`): on CUDA, where
    fla-core's kernels take and return states so; CPU's torch core keeps vLLM's ``[HV, V, K]``."""
    return dev.type == "cuda"


def state_memory(cache: torch.Tensor, kv_layout: bool) -> torch.Tensor:
    """The fp32 state cache ``[slots, HV, V, K]`` as the core keeps it in memory.

    ``kv_layout`` (CUDA): each slot's memory holds the state in fla-core's ``[HV, K, V]`` order; the same
    memory is returned seen with that shape, so gathering and storing slots are contiguous copies and no
    transposing copy of the states is ever made (a 256-request decode of Qwen3.5-9B moves 537 MB per copy).
    vLLM only allocates, copies and zeroes whole slots (prefix caching copies them between blocks), and
    every read and write of the values goes through :func:`gather_slots` and :func:`store_slots`, so the
    order inside a slot is this module's choice. Values are copied, never computed: no bit changes."""
    if not kv_layout:
        return cache
    V, K = cache.shape[-2], cache.shape[-1]
    if cache.stride(-1) != 1 or cache.stride(-2) != K:
        raise RuntimeError(f"vllm_bi: the GDN state cache's slots are not contiguous (strides {cache.stride()}); "
                           "the batch-invariant GDN path needs vLLM's standard state layout")
    kv = cache.flatten(-2).unflatten(-1, (K, V))
    if kv.data_ptr() != cache.data_ptr():  # a copy would silently drop every store
        raise RuntimeError("vllm_bi: could not view the GDN state cache in place")
    return kv


def gather_slots(cache: torch.Tensor, slot_t: torch.Tensor, fresh: torch.Tensor | None,
                 kv_layout: bool = False) -> torch.Tensor:
    """``cache[slot_t]`` with the rows ``fresh`` (device indices, or None) zeroed, in one gather.

    ``kv_layout``: the slots hold fla-core's ``[HV, K, V]`` order (:func:`state_memory`); the result is
    the contiguous ``[N, HV, K, V]`` gather seen as ``[N, HV, V, K]``, which is how the core takes states."""
    if kv_layout:
        out = torch.index_select(state_memory(cache, True), 0, slot_t).transpose(-1, -2)
    else:
        out = cache[slot_t]
    if fresh is not None:
        out[fresh] = 0
    return out


def store_slots(cache: torch.Tensor, slot_t: torch.Tensor, states: torch.Tensor, kv_layout: bool = False) -> None:
    """``cache[slot_t] = states`` (``states [N, HV, V, K]``); with ``kv_layout`` the inverse of
    :func:`gather_slots`: the states go into the slots in ``[HV, K, V]`` order, contiguous when ``states``
    came from fla-core (its final states are ``[N, HV, K, V]`` seen transposed)."""
    states = states.to(cache.dtype)  # a bf16 cache (VLLM_BI_GDN_STATE=bf16): the states hold bf16 values already
    if kv_layout:
        state_memory(cache, True).index_copy_(0, slot_t, states.transpose(-1, -2))
    else:
        cache[slot_t] = states


def _chunk_core(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first, kv_layout):
    """The chunk-aligned mode (``VLLM_BI_GDN_MODE=chunk``). Each state
    slot holds the fp32 state at the request's last block boundary (``ssm_cache``) and, in the widened conv cache
    (``R = CHUNK + W - 1`` rows of ``[mixed_qkv | a | b]``, :func:`history_rows`), the raw inputs of its last ``R``
    tokens, which hold the partial block since that boundary and the conv state before it. A request whose first new token
    sits at absolute position ``p`` re-runs the ``p % CHUNK`` cached tokens after its boundary with the new ones
    (``gdn_varlen(mode="chunk")``, the trainer's call); the recomputed rows are dropped.

    The history's layout (:func:`_chunk_index`) is a ring, the token at absolute position
    ``p`` in row ``p % R``, so a step reads only the rows it needs and writes only its new rows (a decode step
    writes one row per request, where a shifted history would be moved whole: 279 MB per layer at 256 requests
    of Qwen3.5-9B). When every request's rows from ``W - 1`` before its block to its last new one fit in the ring
    at once (every decode step: ``63 + W - 1 + 1 = R``), the new rows are written first and the conv then reads
    each block's rows in the ring (:class:`RingRows`: on CUDA one kernel, which also writes q, k, v apart).
    On CUDA the boundary states stay in their slots (``gdn_chunk_decode.chunk_in_slots``: a partial block reads
    its state in place); CPU gathers them and stores the ones that moved."""
    W = weight.shape[-1]
    a_shape = a.shape[1:]  # [HV] (GDN), or [H, K]: KDA's forget gate per key channel
    a = a.reshape(a.shape[0], -1)
    D, HA = mixed_qkv.shape[1], a.shape[1]
    hist_cache = conv_cache.transpose(1, 2) if dim_first else conv_cache  # [S, R, C], a view
    R, C = hist_cache.shape[1], hist_cache.shape[2]
    ix = _chunk_index(plan, R, W, mixed_qkv.device)
    N = len(plan.ranges)
    # the raw rows [mixed_qkv | a | b] as the history stores them (a and b through mixed_qkv's dtype first)
    raw = [t.to(mixed_qkv.dtype).to(conv_cache.dtype) for t in (mixed_qkv, a, b)]
    if ix.fits:  # the new rows into the ring first; then the conv reads each block's rows there
        _write_ring(hist_cache, plan, ix, raw)
        if ix.ext is None:  # the ring rows of each request's conv state and block, as RingRows takes them
            at = plan.slot_t[ix.ext_req] * R + ix.ext_row
            ix.ext = torch.where(ix.ext_row >= 0, at, -1)  # -1: before the sequence's start (zeros)
        qkv_blk = RingRows(hist_cache, ix.ext, ix.cache_req)
        ab = hist_cache[plan.slot_t[ix.cache_req], ix.cache_row, D:]  # the blocks' a and b columns
        a_blk, b_blk, conv0 = ab[:, :HA], ab[:, HA:], None  # RingRows carries the conv rows
    else:
        cached = hist_cache[plan.slot_t[ix.cache_req], ix.cache_row]  # the history rows this step reads
        _write_ring(hist_cache, plan, ix, raw)  # the new rows into the ring, once the rows they may overwrite are read
        head = torch.cat([cached.new_zeros(1, C), cached])  # src = [head; raw rows]: [a zero row; the rows read]
        conv0 = head[ix.conv_rows, :D].reshape(N, W - 1, D)
        if ix.direct is not None:
            # every request starts at a block boundary (new prompts, resumed whole blocks): its block is its new
            # rows, used where they lie; its conv state comes from the history alone
            qkv_blk, a_blk, b_blk = (t[: ix.direct] for t in raw)
        else:  # the blocks re-run cached rows: gathered from src
            full = torch.cat([head, torch.cat(raw, dim=-1)])
            blk = full[ix.block_rows]
            qkv_blk, a_blk, b_blk = blk[:, :D], blk[:, D : D + HA], blk[:, D + HA :]
    in_slots = kv_layout and _in_place(mixed_qkv.device)
    if in_slots:
        boundary, where = state_memory(ssm_cache, True), dict(slots=plan.slot_t, fresh=plan.fresh_host)
    else:
        boundary, where = gather_slots(ssm_cache, plan.slot_t, plan.fresh, kv_layout), {}  # [N, HV, V, K]
    o, _, finals = gdn_varlen(
        qkv_blk, ix.ranges, weight, conv0, layer.A_log, a_blk.reshape(-1, *a_shape), b_blk, layer.dt_bias,
        boundary, *_dims(layer), mode="chunk", packed=True, **where, **_gating(layer),
    )
    if ix.direct is not None:  # every packed row is a new token, in the step's order
        out[: ix.direct].copy_(o)
    else:
        out[plan.rows] = o[ix.keep_rows].to(out.dtype)
    # a request that reached no new block boundary gets back its input state, bit for bit: its slot already
    # holds it (unless it is new), so only the others are stored (at decode, about 1 request in CHUNK;
    # chunk_in_slots stores its own)
    if not in_slots:
        if ix.store is None:
            store_slots(ssm_cache, plan.slot_t, finals, kv_layout)
        elif ix.store.numel():
            store_slots(ssm_cache, plan.slot_t[ix.store], finals[ix.store], kv_layout)


def _chunk_decode_padded(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first):
    """The chunk mode's decode step with nothing read on the host (``VLLM_BI_CHUNK_DECODE=padded``, CUDA), so that
    a CUDA graph can capture it: :func:`_chunk_core`'s ring path with every request's partial block padded to
    ``CHUNK`` rows. Request ``j``'s new token sits at position ``p = plan.starts[j]`` (device); its block's rows
    are positions ``p - p % CHUNK .. p``, read from the ring after its new row is written (row ``p % R``), and the
    rows after ``p`` are zeros (the conv reads them as zero rows, ``a`` and ``b`` are zeroed). Each real row gets
    the bits of the host-planned step: the conv and the gating are per row, fla-core's launches give a row the same
    bits whatever rows follow it, and the partial-block kernel reads only the real rows
    (:func:`vllm_bi.gdn.chunk_decode.padded_blocks_in_slots`). A request whose block completes writes the state
    at its end into its slot there; no other slot is written. Padded entries of a replayed batch use slot 0,
    vLLM's null block."""
    W, D, HV = weight.shape[-1], mixed_qkv.shape[1], a.shape[1]
    hist = conv_cache.transpose(1, 2) if dim_first else conv_cache  # [S, R, C], a view
    R = hist.shape[1]
    slot, pos = plan.slot_t, plan.starts
    N, dev = slot.shape[0], mixed_qkv.device
    raw = torch.cat([t[:N].to(mixed_qkv.dtype).to(conv_cache.dtype) for t in (mixed_qkv, a, b)], dim=-1)
    hist[slot, pos % R] = raw  # the new rows first: the blocks are then read from the ring
    off = pos % CHUNK
    first = pos - off  # the block's first position
    span = first[:, None] - (W - 1) + torch.arange(W - 1 + CHUNK, device=dev)  # conv rows, then block rows
    ext = torch.where((span >= 0) & (span <= pos[:, None]), slot[:, None] * R + span % R, -1).flatten()
    seq = torch.arange(N * CHUNK, device=dev) // CHUNK
    blk = span[:, W - 1 :]
    ab = hist[slot[:, None], blk % R, D:]  # [N, CHUNK, 2 HV]: the blocks' a and b columns
    ab = torch.where((blk <= pos[:, None])[..., None], ab, 0).reshape(N * CHUNK, 2 * HV)
    o, _, _ = gdn_varlen(
        RingRows(hist, ext, seq), _padded_ranges(N), weight, None, layer.A_log, ab[:, :HV], ab[:, HV:],
        layer.dt_bias, state_memory(ssm_cache, True), layer.num_k_heads // layer.tp_size, layer.head_k_dim,
        layer.head_v_dim, layer.activation, mode="chunk", packed=True, slots=slot, lens=off + 1,
    )
    out[:N] = o.view(N, CHUNK, *o.shape[1:])[torch.arange(N, device=dev), off].to(out.dtype)


@lru_cache(maxsize=64)
def _padded_ranges(n: int) -> list[tuple[int, int]]:
    return [(CHUNK * i, CHUNK * (i + 1)) for i in range(n)]


def is_kda(layer) -> bool:
    """Whether ``layer`` is Kimi Linear's KDA layer (``KimiGatedDeltaNetAttention``: a forget gate per key channel)
    rather than Qwen's GDN layer."""
    return hasattr(layer, "f_b_proj")


def _dims(layer) -> tuple:
    """The GDN core's head dimensions and activation, as :func:`gdn_varlen` takes them after the state (KDA: as many
    key as value heads, one head dim, SiLU convs)."""
    if is_kda(layer):
        return layer.local_num_heads, layer.head_dim, layer.head_dim, "silu"
    return layer.num_k_heads // layer.tp_size, layer.head_k_dim, layer.head_v_dim, layer.activation


def _gating(layer) -> dict:
    """:func:`gdn_varlen`'s gate arguments for ``layer``: KDA's per-channel gate and its lower bound, or GDN's."""
    return {"gating": "kda", "lower_bound": layer.gate_lower_bound} if is_kda(layer) else {}


def _recurrent_step(layer, mixed_qkv, b, a, out, plan, conv, ssm_cache, weight, kv_layout) -> torch.Tensor:
    """The recurrent core of one step from conv states ``conv [N, W-1, D]``: fills ``out`` and the state slots,
    returns the new conv states. CUDA: the states are read from and written to their slots in place (one pass
    over them, as stock vLLM's kernel; :mod:`vllm_bi.gdn.slots`). CPU: gathered, run, stored."""
    dims = _dims(layer)
    if kv_layout and _in_place(mixed_qkv.device):
        o, new_conv, _ = gdn_varlen(mixed_qkv, plan.ranges, weight, conv, layer.A_log, a, b, layer.dt_bias,
                                    state_memory(ssm_cache, True), *dims, packed=True, slots=plan.slot_t,
                                    fresh=plan.fresh_flags(), **_gating(layer))
    else:
        states = gather_slots(ssm_cache, plan.slot_t, plan.fresh, kv_layout).float()
        o, new_conv, new_states = gdn_varlen(mixed_qkv, plan.ranges, weight, conv, layer.A_log, a, b,
                                             layer.dt_bias, states, *dims, packed=True, **_gating(layer))
        store_slots(ssm_cache, plan.slot_t, new_states, kv_layout)
    out[plan.rows] = o.to(out.dtype)
    return new_conv


def _direct_io(dev: torch.device) -> bool:
    """Whether the recurrent step runs without torch copies around its kernels (``VLLM_BI_GDN_IO``)."""
    from vllm_bi.settings import current

    return current().gdn_io_op(torch.device(dev).type) == "direct"


def _in_order(ranges: list[tuple[int, int]]) -> bool:
    """Whether a step's sequences are its first rows, packed in order."""
    return ranges[0][0] == 0 and all(ranges[j][1] == ranges[j + 1][0] for j in range(len(ranges) - 1))


def _recurrent_direct(layer, mixed_qkv, b, a, out, plan, conv_cache, ssm_cache, weight, dim_first) -> None:
    """:func:`_recurrent_step` with nothing copied around the kernels (``VLLM_BI_GDN_IO=direct``): the conv reads
    each request's conv state in its slot (zeros for a new one) and writes the new one back
    (:class:`vllm_bi.gdn.layer.SlotRows`), q, k and v come out of it apart, and the recurrent kernel writes the
    layer's rows of ``out``. The same operations on the same values as the copying path, so the same bits."""
    T = plan.ranges[-1][1]
    gdn_varlen(SlotRows(mixed_qkv, conv_cache, dim_first), plan.ranges, weight, None, layer.A_log, a, b,
               layer.dt_bias, state_memory(ssm_cache, True), *_dims(layer), packed=True, slots=plan.slot_t,
               fresh=plan.fresh_flags(), out=out[:T], **_gating(layer))


def _in_place(dev: torch.device) -> bool:
    """Whether the recurrent step updates the state slots in place (the Triton kernel) and the chunk mode reads
    its boundary states in their slots (fla-core's launches and the partial-block kernel): on CUDA. The CPU
    glue tests run the recurrent step through Triton's interpreter by patching this."""
    return dev.type == "cuda"


def _write_ring(hist_cache: torch.Tensor, plan: "StepPlan", ix: "_ChunkIndex", raw: list[torch.Tensor]) -> None:
    """The chunk mode's new history rows into the ring (:func:`_chunk_index`): the last ``R`` new rows of each
    request, the token at position ``p`` into row ``p % R`` of its slot."""
    hist_cache[plan.slot_t[ix.write_req], ix.write_row] = torch.cat([t[ix.write_src] for t in raw], dim=-1)


class _ChunkIndex:
    """The chunk mode's gathers for one step (the same for every GDN layer). The rows a step reads from the
    histories are (``cache_req``, ``cache_row``): request index (into ``plan.slot_t``) and history row. The
    step's sources are numbered as ``src = [a zero row; those rows; the step's raw rows]``; in that numbering,
    each request's conv state before its partial block (``conv_rows``, ``W - 1`` per request), its partial
    block's cached rows then its new rows (``block_rows``; packed ``ranges``), and ``write_src``: the ring's new
    rows (raw row numbers, written at (``write_req``, ``write_row``)). Also the rows of the packed output that are
    new tokens (``keep_rows``), and the requests whose boundary state must be stored (``store``: new ones and those that
    reached a new block boundary; None: every request). ``direct``: when no request re-runs cached rows and the
    requests' rows are the step's first ``direct`` rows in order, that count (the block rows are then the new
    rows where they lie), else None.

    ``fits`` (not direct): every request's positions from ``W - 1`` before its block to its last new row fit
    in the ring at once (decode steps). The new rows are then written first, and the numbering is the ring's
    own: (``cache_req``, ``cache_row``) are the blocks' rows in order, and (``ext_req``, ``ext_row``) each
    request's ``W - 1`` conv-state rows then its block's rows (``-1``: before the sequence's start, a zero row),
    made into :class:`RingRows`' ``ext`` on the step's first GDN layer."""

    def __init__(self, **parts):
        self.cache_req = self.cache_row = self.conv_rows = self.block_rows = self.keep_rows = None
        self.write_req = self.write_row = self.write_src = self.store = self.ranges = self.direct = None
        self.ext_req = self.ext_row = self.ext = None
        self.fits = False
        self.__dict__.update(parts)


def _chunk_index(plan: "StepPlan", R: int, W: int, dev) -> _ChunkIndex:
    """Build (once per step and history shape; kept on the plan) the chunk mode's indices from the requests'
    query ranges and absolute start positions: host work and one host-to-device copy. The history row of absolute
    position ``p`` is ``p % R`` (a ring)."""
    key = (R, W, str(dev))
    if key in plan.chunk:
        return plan.chunk[key]
    ranges, N = plan.ranges, len(plan.ranges)
    n = torch.tensor([e - s for s, e in ranges], dtype=torch.long)
    st = torch.tensor(plan.starts, dtype=torch.long)  # absolute position of each request's first new token
    redo = torch.tensor([x % CHUNK for x in plan.starts], dtype=torch.long)  # the partial block's cached rows
    b0 = st - redo  # its partial block's first position (a block boundary)
    s0 = torch.tensor([s for s, _ in ranges], dtype=torch.long)
    fresh = torch.zeros(N, dtype=torch.bool)
    fresh[list(plan.fresh_host)] = True
    # the history rows read: positions lo..st-1 (none for a new request); below 0 the conv state is zeros
    lo = torch.where(fresh, st, (b0 - (W - 1)).clamp(min=0))
    if bool((st - lo > R).any()):
        raise RuntimeError(f"vllm_bi: a request needs more than the {R} history rows it keeps (positions {lo} to {st})")

    def spans(first: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (request, position) of positions first_j .. first_j + length_j - 1, packed
        req = torch.repeat_interleave(torch.arange(N), length)
        off = torch.arange(int(length.sum())) - torch.repeat_interleave(length.cumsum(0) - length, length)
        return req, first[req] + off

    in_order = ranges[0][0] == 0 and all(ranges[j][1] == ranges[j + 1][0] for j in range(N - 1))
    direct = ranges[-1][1] if in_order and not bool(redo.any()) else None
    # fits: the ring holds each request's W - 1 conv rows, its block's cached rows and its new ones at once
    fits = direct is None and bool((redo + (W - 1) + n <= R).all()) and not bool((fresh & (st > 0)).any())
    if fits:  # the rows read: the blocks' rows in order, new ones included (in the ring by then)
        cache_req, cache_pos = spans(b0, redo + n)
    else:  # positions lo..st-1
        cache_req, cache_pos = spans(lo, st - lo)
    cache_row = cache_pos % R
    read_off = (st - lo).cumsum(0) - (st - lo)
    n_read = int((st - lo).sum())

    def src(req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # src row of each (request, position)
        from_raw = 1 + n_read + s0[req] + pos - st[req]
        from_hist = 1 + read_off[req] + pos - lo[req]
        return torch.where(pos >= st[req], from_raw, torch.where(pos >= lo[req], from_hist, 0))

    blk_len = redo + n  # the partial block's cached rows, then the new ones
    bounds = [0, *blk_len.cumsum(0).tolist()]
    keep = redo.tolist()
    keep_rows = torch.cat([torch.arange(bounds[j] + keep[j], bounds[j + 1]) for j in range(N)])
    # stored: new requests and those that reached a block boundary
    store = torch.tensor([j for j in range(N) if fresh[j] or plan.starts[j] % CHUNK + int(n[j]) >= CHUNK],
                         dtype=torch.long)
    if fits:  # each request's conv rows and block rows, in the ring (-1: before the sequence's start)
        conv_rows = block_rows = torch.arange(0)
        ext_req, ext_pos = spans(b0 - (W - 1), blk_len + (W - 1))
        ext_row = torch.where(ext_pos < 0, -1, ext_pos % R)
    else:
        conv_rows, block_rows = src(*spans(b0 - (W - 1), torch.full((N,), W - 1))), src(*spans(b0, blk_len))
        ext_req = ext_row = torch.arange(0)
    # the new tokens' raw rows, the last R of each request, into row p % R
    kept = torch.minimum(n, torch.full((N,), R))
    write_req, write_pos = spans(st + n - kept, kept)
    write_row, write_src = write_pos % R, s0[write_req] + write_pos - st[write_req]
    parts = dict(cache_req=cache_req, cache_row=cache_row, conv_rows=conv_rows, block_rows=block_rows,
                 keep_rows=keep_rows, store=store, write_req=write_req, write_row=write_row, write_src=write_src,
                 ext_req=ext_req, ext_row=ext_row)
    on_dev = host_to(torch.cat(list(parts.values())), dev).split([t.numel() for t in parts.values()])
    ix = _ChunkIndex(**dict(zip(parts, on_dev)))
    ix.store = None if store.numel() == N else ix.store
    ix.ranges = [(bounds[j], bounds[j + 1]) for j in range(N)]
    ix.direct, ix.fits = direct, fits
    plan.chunk[key] = ix
    return ix


def history_rows(conv_kernel_size: int) -> int:
    """Rows of the chunk mode's widened conv history: ``CHUNK + W - 1``, so that a decode's ring rows
    (the ``W - 1`` before its block, up to 63 cached, its new one) fit at once (:func:`_chunk_index`)."""
    return CHUNK + conv_kernel_size - 1


def _widened(conv: tuple, extra: int) -> tuple:
    """A conv-state shape with ``extra`` more columns (the raw gate inputs the chunk mode keeps beside the rows)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return (conv[0] + extra, conv[1]) if is_conv_state_dim_first() else (conv[0], conv[1] + extra)


def chunk_state_shape(orig):
    """Wrap ``MambaStateShapeCalculator.gated_delta_net_state_shape`` for the chunk-aligned mode: the conv
    state keeps :func:`history_rows` rows (``CHUNK`` more than stock's ``W - 1``) and ``2 * num_v_heads`` more
    columns (the raw ``a``, ``b``)."""

    def gated_delta_net_state_shape(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                                    conv_kernel_size, num_spec=0):
        conv, temporal = orig(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                              history_rows(conv_kernel_size) + 1, num_spec)
        return _widened(conv, 2 * num_v_heads // tp_world_size), temporal

    gated_delta_net_state_shape._vllm_bi = True
    return gated_delta_net_state_shape


def chunk_kda_state_shape(orig):
    """Wrap ``MambaStateShapeCalculator.kda_state_shape`` for the chunk-aligned mode: :func:`history_rows` rows, and
    ``num_heads * (head_dim + 1)`` more columns (the raw forget gate per key channel and beta)."""

    def kda_state_shape(cls, tp_world_size, num_heads, head_dim, num_k_heads=None, head_k_dim=None,
                        conv_kernel_size=4, num_spec=0):
        conv, temporal = orig(cls, tp_world_size, num_heads, head_dim, num_k_heads, head_k_dim,
                              history_rows(conv_kernel_size) + 1, num_spec)
        return _widened(conv, num_heads // tp_world_size * (head_dim + 1)), temporal

    kda_state_shape._vllm_bi = True
    return kda_state_shape

# --------------------------------------------------------------------------- speculative decoding
# The GDN steps of a server with speculative decoding (``--speculative-config``), recurrent GDN mode.
# 
# vLLM gives a speculative request ``k + 1`` state slots (``spec_state_indices_tensor[i]``) and, each step, the
# number of rows of its previous step that were accepted (``num_accepted_tokens[i] = m``: its last sampled token and
# the drafts that matched). A step verifies ``n <= k + 1`` rows: the last sampled token and the new drafts.
# 
# - **Bits.** :func:`verify_rows` computes the rows position by position, each one as a one-token decode step
#   (:func:`vllm_bi.gdn.layer.gdn_varlen` over one row per request, from the state and conv window after the row
#   before it), so every row has the bits a plain decode of that token would give, whatever is accepted later; the
#   recurrent mode's prefill has the same bits (P3), so the trainer's recompute matches.
# - **States.** The state after row ``j`` goes to slot ``j``; a step starts from slot ``m - 1`` (the state after its
#   last accepted token; ``m = 1`` for a request's first speculative step, whose state its prefill left in slot 0).
# - **Conv history** (a slot of ``W - 1 + k`` raw rows, ``spec_state_indices_tensor[i, 0]``): after a step whose
#   window before its rows was ``P`` (the ``W - 1`` raw rows ending at the last accepted token) and whose rows were
#   ``x_0 .. x_{n-1}``, the slot holds ``P[1:], x_0, .., x_{n-1}`` from row 0, so the next step's window is rows
#   ``m - 1 .. m + W - 3``. A step without speculative requests (prefills) leaves each request's last ``W - 1`` raw
#   rows at rows ``0 .. W - 2``: the window of ``m = 1``. This is the convention of vLLM's own conv-update kernel;
#   here only vllm_bi reads and writes the values (vLLM copies whole slots).
# - **One pass** (``VLLM_BI_SPEC_VERIFY=fused``, CUDA's default): :func:`_verify_fused` runs each request's rows as
#   one sequence through the in-place kernel, which stores the state after each row into that row's slot: the same
#   bits, no host read but the step's row offsets (once per step).
# - **New requests among the speculative rows.** vLLM's scheduler pads a new request with one token to compute into
#   ``1 + k`` rows (the token and ``k`` placeholder drafts, always rejected) when decodes run beside it, and the
#   runner then counts it as a speculative row. Its slots still hold their previous owner's state and conv rows, so
#   :func:`_clear_new_requests` zeroes them before the verify, as a new prefill's are zeroed: on CPU always, and on
#   CUDA under the ``speculative-one-token`` feature, on by default (``settings.CUDA_FEATURES``; the one-token test
#   of ``tests/gpu/test_speculative_cuda.py`` checks it). Model Runner V2 (CUDA) counts such a row a ``1 + k``-token
#   prefill, whose stored state then includes the placeholders; under the feature :func:`wrap_mamba_prepare_attn`
#   makes it a speculative row, as V1 (CPU) does.


def _rows_view(conv: torch.Tensor, dim_first: bool) -> torch.Tensor:
    """Conv slots seen as ``[..., rows, D]`` (vLLM may keep them ``[..., D, rows]``)."""
    return conv.transpose(-1, -2) if dim_first else conv


def spec_step(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor, md,
              conv_cache: torch.Tensor, ssm_cache: torch.Tensor, weight: torch.Tensor, dim_first: bool,
              kv_layout: bool) -> None:
    """One step of a GDN layer in a server with speculative decoding (:func:`bi_gdn_core` from its slots and conv
    weight on): the requests without drafts (prefills) through the recurrent path on their own tokens, then the
    speculative requests' rows (:func:`verify_rows`)."""
    if gdn_mode() != "recurrent":
        raise RuntimeError(f"vllm_bi: speculative decoding runs in the recurrent GDN mode only, this server runs "
                           f"{gdn_mode()!r}; set VLLM_BI_GDN_MODE=recurrent or drop --speculative-config")
    W = weight.shape[-1]
    spec = md.spec_sequence_masks is not None
    if not spec or md.num_prefills or md.num_decodes:
        rows = md.non_spec_token_indx if spec else None
        x, bb, aa = (mixed_qkv, b, a) if rows is None else (mixed_qkv[rows], b[rows], a[rows])
        sub = out if rows is None else out.new_zeros((rows.numel(), *out.shape[1:]))
        plan = step_plan(md, mixed_qkv.device)
        if plan is not None:
            window = _rows_view(gather_slots(conv_cache, plan.slot_t, plan.fresh), dim_first)[:, : W - 1]
            new = _recurrent_step(layer, x, bb, aa, sub, plan, window, ssm_cache, weight, kv_layout)
            _rows_view(conv_cache, dim_first)[plan.slot_t, : W - 1] = new.to(conv_cache.dtype)
        if rows is not None:
            out[rows] = sub
    if spec:
        n = md.num_spec_decodes
        # read once per step, shared by the GDN layers
        qsl = step_cached(md, "_vllm_bi_spec_qsl", mixed_qkv.device, lambda: md.spec_query_start_loc[: n + 1].tolist())
        rows = md.spec_token_indx if (md.num_prefills or md.num_decodes) else None
        x, bb, aa = (mixed_qkv, b, a) if rows is None else (mixed_qkv[rows], b[rows], a[rows])
        slots, accepted = md.spec_state_indices_tensor[:n].long(), md.num_accepted_tokens[:n].long()
        if _zero_new_spec_rows(mixed_qkv.device):
            new = step_cached(md, "_vllm_bi_spec_new", mixed_qkv.device, lambda: new_spec_requests(md, n))
            if new:
                _clear_new_requests(new, slots, accepted, conv_cache, ssm_cache, W, dim_first, kv_layout)
        o = verify_rows(layer, x, bb, aa, qsl, slots, accepted, conv_cache, ssm_cache, weight, dim_first, kv_layout)
        if rows is None:
            out[: qsl[-1]] = o
        else:
            out[rows] = o


def _zero_new_spec_rows(dev: torch.device) -> bool:
    """Whether a speculative step zeroes the slots of new requests among its rows (:func:`new_spec_requests`): on CPU
    always, and on CUDA where the ``speculative-one-token`` CUDA feature is on (by default:
    ``settings.CUDA_FEATURES``)."""
    from vllm_bi.settings import current

    return dev.type == "cpu" or current().cuda_feature("speculative-one-token")


def new_spec_requests(md, n: int) -> list[int]:
    """The speculative requests (indices among the step's ``n``) with no computed token: new requests that vLLM's
    scheduler padded into speculative rows (the module doc). Read from ``md.vllm_bi_num_computed``; the speculative
    requests are the first ``n`` when the step has nothing else, else those of ``md.spec_sequence_masks``."""
    computed = md.vllm_bi_num_computed
    if md.num_prefills or md.num_decodes:
        mask = md.spec_sequence_masks
        computed = computed[: mask.shape[0]][mask[: computed.shape[0]]]
    return (computed[:n] == 0).nonzero().flatten().tolist()


def padded_new_requests(input_batch):
    """Model Runner V2: the rows of ``input_batch`` that are a new request with one prompt token which vLLM's
    scheduler padded with ``k`` placeholder drafts (``-1``), as a boolean ``[num_reqs]`` array, or None if none.

    V1 counts such a row as a speculative row (``num_scheduled == drafts + 1``), and so does V2 for a prompt tail
    over existing context (``prefill_runs_as_decode_np``), but V2 leaves a row with no computed prompt token a
    prefill: the GDN metadata then runs its ``1 + k`` rows as one prefill and stores the state and conv window
    after the last placeholder, which the request's next step (``m = 1``) starts from."""
    drafts = input_batch.num_draft_tokens_per_req
    if drafts is None or not input_batch.has_prefill:
        return None
    n = input_batch.num_reqs
    drafts = drafts[:n]
    padded = (input_batch.is_prefilling_np[:n] & (input_batch.num_computed_prefill_tokens_np[:n] == 0)
              & (drafts > 0) & (input_batch.num_scheduled_tokens[:n] - drafts == 1))
    return padded if padded.any() else None


def wrap_mamba_prepare_attn(orig):
    """``MambaHybridModelState.prepare_attn`` (V2) counting the rows of :func:`padded_new_requests` as decodes
    (``prefill_runs_as_decode_np``), as V1 does: they become speculative rows with ``num_accepted_tokens = 1``
    and no computed token, which :func:`new_spec_requests` finds and :func:`_clear_new_requests` zeroes, and the
    verify keeps the state after each row in its own slot. Installed on CUDA where the ``speculative-one-token`` CUDA
    feature is on (by default: ``settings.CUDA_FEATURES``; the ledger)."""
    import dataclasses
    import functools

    @functools.wraps(orig)
    def prepare_attn(self, input_batch, *args, **kwargs):
        padded = padded_new_requests(input_batch)
        if padded is not None:
            before = input_batch.prefill_runs_as_decode_np
            runs_as_decode = padded if before is None else (before[: padded.shape[0]] | padded)
            input_batch = dataclasses.replace(input_batch, prefill_runs_as_decode_np=runs_as_decode)
        return orig(self, input_batch, *args, **kwargs)

    return prepare_attn


def _clear_new_requests(new: list[int], slots: torch.Tensor, accepted: torch.Tensor, conv_cache: torch.Tensor,
                        ssm_cache: torch.Tensor, W: int, dim_first: bool, kv_layout: bool) -> None:
    """Zero what the verify reads for the speculative requests ``new`` (:func:`new_spec_requests`): the state slot
    it starts from and the ``W - 1`` conv rows of its window. The request owns these slots from this step on; each
    GDN layer clears its own caches."""
    f = host_to(torch.tensor(new, dtype=torch.long), slots.device)
    first = (accepted[f] - 1).clamp(min=0)
    state_memory(ssm_cache, kv_layout)[slots[f, first]] = 0
    window = first[:, None] + torch.arange(W - 1, device=slots.device)[None, :]
    _rows_view(conv_cache, dim_first)[slots[f, 0][:, None], window] = 0


def verify_rows(layer, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor, qsl: list[int], slots: torch.Tensor,
                accepted: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor, weight: torch.Tensor,
                dim_first: bool, kv_layout: bool) -> torch.Tensor:
    """The GDN core's output ``[qsl[-1], HV, V]`` for speculative requests whose rows are packed by ``qsl``
    (request ``i``: rows ``qsl[i] .. qsl[i+1] - 1``), from their slots ``slots [N, k + 1]`` and accepted counts
    ``accepted [N]`` (the module doc says what is read and written). With ``VLLM_BI_SPEC_VERIFY=fused`` on the
    in-place path (CUDA), :func:`_verify_fused` computes the same bits in one pass per request."""
    if _fused_verify(x.device, kv_layout) and torch.promote_types(x.dtype, conv_cache.dtype) == conv_cache.dtype:
        return _verify_fused(layer, x, b, a, qsl, slots, accepted, conv_cache, ssm_cache, weight, dim_first)
    dev = x.device
    N = len(qsl) - 1
    lens = [qsl[i + 1] - qsl[i] for i in range(N)]
    W = weight.shape[-1]
    conv_slot = slots[:, 0]
    hist = _rows_view(conv_cache, dim_first)  # [slots, R, D]
    first = (accepted - 1).clamp(min=0)
    req = torch.arange(N, device=dev)
    window = hist[conv_slot[:, None], first[:, None] + torch.arange(W - 1, device=dev)[None, :]]  # [N, W-1, D]
    before = window.clone()  # P: each request's window before its first row
    src = slots[req, first]  # the state after the last accepted token
    out = x.new_zeros((x.shape[0], layer.num_v_heads // layer.tp_size, layer.head_v_dim))
    for j in range(max(lens, default=0)):
        live = [i for i in range(N) if lens[i] > j]
        sel = torch.tensor(live, dtype=torch.long, device=dev)
        at = torch.tensor([qsl[i] + j for i in live], dtype=torch.long, device=dev)
        ranges = [(t, t + 1) for t in range(len(live))]
        states = gather_slots(ssm_cache, src[sel], None, kv_layout).float()
        o, new_conv, new_states = gdn_varlen(x[at], ranges, weight, window[sel], layer.A_log, a[at], b[at],
                                             layer.dt_bias, states, *_dims(layer), packed=True)
        dst = slots[sel, j]
        store_slots(ssm_cache, dst, new_states, kv_layout)
        window[sel] = new_conv.to(window.dtype)
        out[at] = o.to(out.dtype)
        src = src.clone()
        src[sel] = dst
    for i in range(N):  # P[1:], then the step's raw rows, from row 0
        rows = torch.cat([before[i, 1:], x[qsl[i] : qsl[i + 1]].to(hist.dtype)])
        hist[conv_slot[i], : rows.shape[0]] = rows
    return out


def _fused_verify(dev: torch.device, kv_layout: bool) -> bool:
    """Whether a speculative step's rows run as one in-place pass per request (:func:`_verify_fused`): with
    ``VLLM_BI_SPEC_VERIFY=fused`` where the recurrent step updates its slots in place (CUDA)."""
    from vllm_bi.settings import current

    return kv_layout and _in_place(dev) and current().spec_verify == "fused"


def _verify_fused(layer, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor, qsl: list[int], slots: torch.Tensor,
                  accepted: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor, weight: torch.Tensor,
                  dim_first: bool) -> torch.Tensor:
    """:func:`verify_rows` with each request's rows as one sequence: its conv from the window ``P`` over its rows,
    the gates, then the in-place recurrence from slot ``slots[i, accepted_i - 1]`` (clamped at 0) with the state
    after row ``j`` stored into ``slots[i, j]`` (:func:`vllm_bi.gdn.slots.recurrent_in_slots`, ``spec_slots``); the
    conv history written with one indexed write. Nothing read on the host but ``qsl``.

    The same bits as the position-by-position path: the conv computes each row from its own ``W`` inputs in a fixed
    order (the rows before it within the step are the raw rows, which the other path reads back from its window
    after rounding them to the conv cache's dtype: no change where that dtype holds ``x``'s values, which the
    caller checks); the gates are elementwise; the kernel gives every row and stored state the bits of one call per
    row, the kernel a plain decode step runs (the other path runs fla-core's, whose bits it repeats)."""
    dev = x.device
    N, T = len(qsl) - 1, qsl[-1]
    W = weight.shape[-1]
    out = x.new_zeros((x.shape[0], layer.num_v_heads // layer.tp_size, layer.head_v_dim))
    if N == 0:
        return out
    conv_slot = slots[:, 0]
    hist = _rows_view(conv_cache, dim_first)  # [slots, R, D]
    first = (accepted - 1).clamp(min=0)
    req = torch.arange(N, device=dev)
    before = hist[conv_slot[:, None], first[:, None] + torch.arange(W - 1, device=dev)[None, :]]  # P [N, W-1, D]
    ranges = list(zip(qsl[:-1], qsl[1:]))
    o, _, _ = gdn_varlen(x, ranges, weight, before, layer.A_log, a, b, layer.dt_bias, state_memory(ssm_cache, True),
                         *_dims(layer), packed=True, slots=slots[req, first], spec_slots=slots)
    out[:T] = o.to(out.dtype)
    # the history: P[1:], then the step's raw rows, from row 0 (row p of request i at W - 2 + p)
    cu = index_on(qsl, dev)
    seq = torch.repeat_interleave(req, cu[1:] - cu[:-1], output_size=T)
    row = torch.cat([torch.arange(W - 2, device=dev).repeat(N), W - 2 + torch.arange(T, device=dev) - cu[seq]])
    at = torch.cat([conv_slot.repeat_interleave(W - 2), conv_slot[seq]])
    hist[at, row] = torch.cat([before[:, 1:].reshape(N * (W - 2), -1), x[:T].to(hist.dtype)])
    return out
