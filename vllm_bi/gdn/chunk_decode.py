"""The chunk-aligned mode's partial blocks (a decode step's rows since each request's last block boundary) with the
boundary states read from their cache slots. The server's chunk-mode step on CUDA runs through
:func:`chunk_in_slots`. Its GPU test (``tests/gpu/test_gdn_chunk_cuda.py::test_partial_blocks_in_slots_equal_fla_core``)
showed that the partial-block kernel gives fla-core's bits on the H200.

Why: at a 256-request decode the chunk mode's step costs 3.0× stock in GPU time
(``docs/results/2026-12-01-h200-gdn-decode-gpu-time.md``). fla-core's state kernel, built for long sequences, takes 1.1 ms of
it: for a request's one partial block it writes ``h`` (the boundary state rounded to bf16), ``v_new`` and an fp32
final state that the server throws away, and before it the server gathers the boundary states out of their slots
(537 MB).

What :func:`partial_blocks_in_slots` runs, for packed partial blocks (each fewer than 64 rows, starting at a block
boundary):

1. fla-core's own launches for what does not touch the state: the l2norm of q and k, the cumulative gate
   (``chunk_local_cumsum``, log2 scale), and the fused kkt + triangular solve with ``recompute_w_u``
   (``chunk_gated_delta_rule_fwd_intra``), with the chunk indices given (no host read);
2. one kernel of this module in place of fla-core's state and output kernels, per tile of (request, value head, 64
   values), a program taking every tile of its head (:data:`PARTIAL_LAUNCH`): the boundary state read from its slot,
   ``v_new = u - w h`` and ``o`` with the output kernel's tile shapes and operation order: ``h`` rounded to bf16;
   ``w h`` and ``q h`` as two 64-wide products accumulated in order; ``q k^T`` likewise;
   ``o = (q h) exp2(g) scale + ((q k^T) exp2(g_i - g_j), causal, as bf16) v_new (bf16) scale``.

A block that completes in a step (64 rows) runs the same, and then a second kernel of this module writes the state at
its end into the slot: fla-core's state kernel's step for one chunk, with its tile (64 keys x 32 values, 4 warps, 4
stages) and operation order (``v_new`` from the bf16 boundary state, the gate, ``h exp2(g_last) + k^T v_new``
accumulated by ``tl.dot`` into ``h``).
"""

from __future__ import annotations

import torch

from vllm_bi.gdn.chunk import _packed, gdn_chunk_varlen, pin_fla_chunk_configs
from vllm_bi.gdn.slots import check_slot_pool
from vllm_bi.ops.device import index_on

__all__ = ["chunk_in_slots", "partial_blocks_in_slots", "padded_blocks_in_slots", "partial_block_outputs", "block_intermediates"]

CHUNK = 64
BV = 64  # fla-core's output kernel tile (pinned: BK 64, BV 64, 4 warps)
BV_STATE = 32  # fla-core's state kernel tile (pinned: BV 32, 4 warps, 4 stages)
# The partial-block kernel's launch: warps and pipeline stages (how the hardware schedules its tiles), and what one
# program takes: ``group`` all value heads of a key head (else one), ``all_v`` every value tile (else one). None of
# them changes a tile's arithmetic; benchmarks/decode_tiles.py checks each leaves the bits as they are before timing it.
# ``all_v`` with 4 warps and 3 stages: 0.575 ms against 0.704 ms for partial_blocks_in_slots at 256 x 33 (the kernel
# 0.42 -> 0.29 ms), same bits (docs/results/2026-12-01-h200-chunk-decode-targets.md).
PARTIAL_LAUNCH = dict(num_warps=4, num_stages=3, group=False, all_v=True)
# The block-state kernel's launch: fla-core's state kernel's pin (4 warps, 4 stages); benchmarks/decode_tiles.py checks
# and times others.
STATE_LAUNCH = dict(num_warps=4, num_stages=4)
# Whether the server's step sends blocks that complete (64 rows) to the partial-block path, whose second kernel then
# writes the state at the block's end. On since its GPU test
# (tests/gpu/test_gdn_chunk_cuda.py::test_whole_blocks_in_slots_equal_fla_core) showed fla-core's bits and the chunk
# mode's parity suite passed with it (docs/results/2026-12-01-h200-chunk-decode-ring-conv.md).
WHOLE_BLOCKS_IN_SLOTS = True

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - vllm pulls triton in
    triton = None

if triton is not None:
    try:  # fla-core's exp2, as its state and output kernels use it
        from fla.ops.utils.op import exp2 as fla_exp2
    except ImportError:  # CPU installs have no fla-core; the interpreter tests run with its default

        @triton.jit
        def fla_exp2(x):
            return tl.math.exp2(x.to(tl.float32))

    @triton.jit
    def _partial_block_kernel(q, k, w, u, g, o, pool, slot_stride, slots, cu, ends, scale,
                              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BT: tl.constexpr, BVO: tl.constexpr, TWO: tl.constexpr, HEADS: tl.constexpr,
                              VBLOCKS: tl.constexpr):
        # a program takes HEADS value heads of one key head (1, or all HV // H of its group) times VBLOCKS value
        # tiles of BVO columns (1, or all of them): q k^T is computed once for them, q, k and w loaded once; each
        # (value head, tile) is the same tile arithmetic whichever program runs it
        vb0 = tl.program_id(0).to(tl.int64) * VBLOCKS
        pid = tl.program_id(1).to(tl.int64)
        seq = pid // (HV // HEADS)
        hv0 = (pid % (HV // HEADS)) * HEADS
        hk = hv0 // (HV // H)
        first = tl.load(cu + seq).to(tl.int64)
        n = tl.load(ends + seq).to(tl.int64) - first  # rows past n (to the next segment, or padding) are not read
        slot = tl.load(slots + seq).to(tl.int64)
        rows = tl.arange(0, BT)
        row_ok = rows < n
        ks = tl.arange(0, 64)
        q_rows = q + ((first + rows) * H + hk)[:, None] * K
        k_rows = k + ((first + rows) * H + hk)[:, None] * K
        q1 = tl.load(q_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        k1 = tl.load(k_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        qk0 = tl.dot(q1, tl.trans(k1))
        if TWO:
            q2 = tl.load(q_rows + (64 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            k2 = tl.load(k_rows + (64 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            qk0 = tl.dot(q2, tl.trans(k2), qk0)
        causal = (rows[:, None] >= rows[None, :]) & (row_ok[:, None] & row_ok)
        for i in tl.static_range(HEADS):
            hv = hv0 + i
            w_rows = w + ((first + rows) * HV + hv)[:, None] * K
            w1 = tl.load(w_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            if TWO:
                w2 = tl.load(w_rows + (64 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            gt = tl.load(g + (first + rows) * HV + hv, mask=row_ok, other=0.0)
            qk = qk0 * fla_exp2(gt[:, None] - gt[None, :])
            qk = tl.where(causal, qk, 0).to(w1.dtype)
            for b in tl.static_range(VBLOCKS):
                vs = (vb0 + b) * BVO + tl.arange(0, BVO)
                v_ok = vs < V
                state = pool + slot * slot_stride + hv * (K * V) + vs[None, :]
                # the boundary state's first 64 keys (and the next 64 when K = 128), fp32 as the state kernel
                # keeps it
                S1 = tl.zeros([64, BVO], dtype=tl.float32)
                S1 += tl.load(state + ks[:, None] * V, mask=v_ok[None, :], other=0.0).to(tl.float32)
                Sb1 = S1.to(w1.dtype)
                wS = tl.dot(w1, Sb1)
                qS = tl.dot(q1, Sb1)
                if TWO:
                    S2 = tl.zeros([64, BVO], dtype=tl.float32)
                    S2 += tl.load(state + (64 + ks)[:, None] * V, mask=v_ok[None, :], other=0.0).to(tl.float32)
                    Sb2 = S2.to(w2.dtype)
                    wS = tl.dot(w2, Sb2, wS)
                    qS = tl.dot(q2, Sb2, qS)
                tile_ok = row_ok[:, None] & v_ok[None, :]
                u_rows = u + ((first + rows) * HV + hv)[:, None] * V + vs[None, :]
                # rows past the block: w and u load as zeros, so v_new is +0 there, as fla-core's masked load of it
                v_new = (tl.load(u_rows, mask=tile_ok, other=0.0) - wS).to(w1.dtype)
                qS = qS * fla_exp2(gt)[:, None]
                out = qS * scale + tl.dot(qk, v_new) * scale
                o_rows = o + ((first + rows) * HV + hv)[:, None] * V + vs[None, :]
                tl.store(o_rows, out.to(o.dtype.element_ty), mask=tile_ok)


    @triton.jit
    def _block_state_kernel(k, w, u, g, pool, slot_stride, slots, cu, ends, seqs, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BVS: tl.constexpr,
                            TWO: tl.constexpr):
        # the state after one whole block from the boundary state in the slot, written back into the slot: fla-core's
        # state kernel's step for one chunk (tile 64 keys x BVS values; v_new from bf16(h); gate; h * exp2(g_last)
        # + k^T v_new, accumulated by tl.dot into h). Keep each load next to its use: the same arithmetic with w,
        # k^T and the gate loaded before the state (and every value tile in one program) passed Triton's interpreter
        # but wrote wrong states, some NaN, on the H200 (Triton 3.6, tests/gpu/test_gdn_chunk_heads_cuda.py)
        vb = tl.program_id(0).to(tl.int64)
        seq_head = tl.program_id(1).to(tl.int64)
        seq = tl.load(seqs + seq_head // HV).to(tl.int64)
        first = tl.load(cu + seq).to(tl.int64)
        if tl.load(ends + seq).to(tl.int64) - first != BT:  # a padded launch's block that does not complete
            return
        hv = seq_head % HV
        hk = hv // (HV // H)
        slot = tl.load(slots + seq).to(tl.int64)
        rows = tl.arange(0, BT)
        ks = tl.arange(0, 64)
        vs = vb * BVS + tl.arange(0, BVS)
        v_ok = vs < V
        state = pool + slot * slot_stride + hv * (K * V) + vs[None, :]
        h1 = tl.zeros([64, BVS], dtype=tl.float32)
        h1 += tl.load(state + ks[:, None] * V, mask=v_ok[None, :], other=0.0).to(tl.float32)
        w_rows = w + ((first + rows) * HV + hv)[:, None] * K
        w1 = tl.load(w_rows + ks[None, :])
        b_v = tl.dot(w1, h1.to(w1.dtype))
        if TWO:
            h2 = tl.zeros([64, BVS], dtype=tl.float32)
            h2 += tl.load(state + (64 + ks)[:, None] * V, mask=v_ok[None, :], other=0.0).to(tl.float32)
            w2 = tl.load(w_rows + (64 + ks)[None, :])
            b_v = tl.dot(w2, h2.to(w2.dtype), b_v)
        u_rows = u + ((first + rows) * HV + hv)[:, None] * V + vs[None, :]
        b_v = tl.load(u_rows, mask=v_ok[None, :], other=0.0) - b_v
        g_last = tl.load(g + (first + BT - 1) * HV + hv).to(tl.float32)
        b_g = tl.load(g + (first + rows) * HV + hv).to(tl.float32)
        b_v = b_v * fla_exp2(g_last - b_g)[:, None]
        g_last = fla_exp2(g_last)
        h1 *= g_last
        if TWO:
            h2 *= g_last
        b_v = b_v.to(w1.dtype)
        k_cols = k + ((first + rows) * H + hk)[None, :] * K  # k^T: keys down, rows across
        h1 = tl.dot(tl.load(k_cols + ks[:, None]), b_v, h1)
        tl.store(state + ks[:, None] * V, h1, mask=v_ok[None, :])
        if TWO:
            h2 = tl.dot(tl.load(k_cols + (64 + ks)[:, None]), b_v, h2)
            tl.store(state + (64 + ks)[:, None] * V, h2, mask=v_ok[None, :])


def _check(who: str, x: torch.Tensor, pool: torch.Tensor, HV: int, K: int, V: int) -> None:

    if K not in (64, 128):
        raise ValueError(f"{who}: the partial-block kernel supports head_k_dim 64 or 128, got {K}")
    check_slot_pool(who, x, pool, HV, K, V)


def partial_block_outputs(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                          pool: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor, scale: float,
                          whole: torch.Tensor | None = None, ends: torch.Tensor | None = None) -> torch.Tensor:
    """Step 2 of the module doc alone: ``q, k [T, H, K]`` l2-normalised (bf16), ``w [T, HV, K]``, ``u [T, HV, V]``
    (fla-core's WY form, bf16), ``g [T, HV]`` the cumulative gate per block (log2 scale, fp32), ``pool [S, HV, K,
    V]`` fp32 (fla-core's state order, each slot contiguous), ``slots [N]``, ``cu [N + 1]`` (device; every segment
    1..64 rows, starting at a boundary). Returns ``o [T, HV, V]`` in ``u.dtype``. ``whole`` (device indices of the
    segments of 64 rows): after the outputs, their slots get the state at the block's end (fla-core's state
    kernel's step: tile 64 keys x 32 values, 4 warps, 4 stages, as pinned); the other slots are only read.
    ``ends [N]`` (device): where each segment's rows end, when not at the next segment's start (padded segments,
    :func:`padded_blocks_in_slots`); a segment in ``whole`` whose rows end short of 64 keeps its slot."""
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    _check("partial_block_outputs", q, pool, HV, K, V)
    o = torch.empty_like(u)
    N = slots.shape[0]
    if N and T:
        q, k, w, u, g = (t.contiguous() for t in (q, k, w, u, g))
        launch = dict(PARTIAL_LAUNCH)
        heads = HV // H if launch.pop("group") else 1
        vblocks = triton.cdiv(V, BV) if launch.pop("all_v") else 1
        ends = cu[1:] if ends is None else ends
        _partial_block_kernel[(triton.cdiv(V, BV) // vblocks, N * HV // heads)](
            q, k, w, u, g, o, pool, pool.stride(0), slots, cu, ends, scale, H=H, HV=HV, K=K, V=V, BT=CHUNK, BVO=BV,
            TWO=K > 64, HEADS=heads, VBLOCKS=vblocks, **launch)
        if whole is not None and whole.numel():  # after the outputs, which read the boundary states
            _block_state_kernel[(triton.cdiv(V, BV_STATE), whole.numel() * HV)](
                k, w, u, g, pool, pool.stride(0), slots, cu, ends, whole, H=H, HV=HV, K=K, V=V, BT=CHUNK, BVS=BV_STATE,
                TWO=K > 64, **STATE_LAUNCH)
    return o


def partial_blocks_in_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            pool: torch.Tensor, slots: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """The chunk mode's output rows of packed partial blocks (CUDA): ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta
    [T, HV]`` as :func:`vllm_bi.gdn.chunk.gdn_chunk_varlen` takes them, each segment of ``cu`` (host
    offsets) of 1..64 rows and starting at a block boundary, whose boundary state is in slot ``slots[j]`` of
    ``pool [S, HV, K, V]``. Returns ``o [T, HV, V]`` (``v.dtype``). A segment of 64 rows completes its block: its
    slot then gets the state at the block's end (fla-core's state kernel's arithmetic); the others' slots are only
    read."""
    lens = [cu[j + 1] - cu[j] for j in range(len(cu) - 1)]
    if any(n > CHUNK or n < 1 for n in lens):
        raise ValueError(f"partial_blocks_in_slots: every segment must have 1..{CHUNK} rows, got {lens}")
    _check("partial_blocks_in_slots", q, pool, v.shape[1], k.shape[2], v.shape[2])

    qn, kn, gc, w, u, cu_t = block_intermediates(q, k, v, g, beta, cu)
    whole = [j for j, n in enumerate(lens) if n == CHUNK]
    return partial_block_outputs(qn, kn, w, u, gc, pool, slots, cu_t, scale,
                                 index_on(whole, q.device) if whole else None)


def padded_blocks_in_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           pool: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`partial_blocks_in_slots` with nothing read on the host, so that a CUDA graph can capture it (the chunk
    mode's decode steps, ``VLLM_BI_CHUNK_DECODE=padded``): segment ``j`` is rows ``64 j .. 64 j + 63`` of the
    inputs, of which the first ``lens[j]`` (device, 1..64) are its block's rows since the boundary and the rest
    padding (any finite values). Returns ``o [64 N, HV, V]``; rows past a segment's ``lens`` are not written.
    A segment of 64 rows writes the state at its block's end into its slot.

    The same bits as :func:`partial_blocks_in_slots` on the unpadded segments: fla-core's launches before the
    state kernel give a block's row the same bits whatever rows follow it (``benchmarks/row_prefix_bits.py``, on
    the H200), and the kernels here read no row past ``lens``."""
    N = slots.shape[0]
    _check("padded_blocks_in_slots", q, pool, v.shape[1], k.shape[2], v.shape[2])
    if q.shape[0] != N * CHUNK:
        raise ValueError(f"padded_blocks_in_slots: {N} segments need {N * CHUNK} rows, got {q.shape[0]}")
    qn, kn, gc, w, u, cu_t = block_intermediates(q, k, v, g, beta, [CHUNK * j for j in range(N + 1)])
    return partial_block_outputs(qn, kn, w, u, gc, pool, slots, cu_t, scale, index_on(range(N), q.device),
                                 ends=cu_t[:-1] + lens)


def block_intermediates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        cu: list[int]) -> tuple[torch.Tensor, ...]:
    """fla-core's launches before its state and output kernels, on segments of one block each (``cu``: host
    offsets, every segment starting at a boundary): ``(qn, kn, gc, w, u, cu_t)``: q and k l2-normalised, the gate's
    cumulative sum per block (log2 scale), the WY form's ``w [T, HV, K]`` and ``u [T, HV, V]``, and ``cu`` on the
    device. Their configs are pinned (``gdn_chunk.pin_fla_chunk_configs``), so they give ``gdn_chunk_varlen``'s bits."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2


    pin_fla_chunk_configs()
    dev = q.device
    cu_t = index_on(cu, dev)
    chunks = index_on([x for j in range(len(cu) - 1) for x in (j, 0)], dev).view(-1, 2)  # one chunk per segment
    qn, _ = l2norm_fwd(q.unsqueeze(0).contiguous())
    kn, _ = l2norm_fwd(k.unsqueeze(0).contiguous())
    gc = chunk_local_cumsum(g.unsqueeze(0).contiguous(), chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu_t,
                            chunk_indices=chunks)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=kn, v=v.unsqueeze(0).contiguous(), g=gc,
                                              beta=beta.unsqueeze(0).contiguous(), cu_seqlens=cu_t,
                                              chunk_indices=chunks, chunk_size=CHUNK)
    return qn[0], kn[0], gc[0], w[0], u[0], cu_t


def chunk_in_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   pool: torch.Tensor, slots: torch.Tensor, cu: list[int], fresh=(), scale: float | None = None
                   ) -> torch.Tensor:
    """The chunk mode's core for one server step with the boundary states in their slots (CUDA): the inputs as
    :func:`vllm_bi.gdn.chunk.gdn_chunk_varlen` takes them (every segment of ``cu`` starting at a block
    boundary), sequence ``j``'s boundary state in slot ``slots[j]`` of ``pool [S, HV, K, V]`` fp32, ``fresh`` the
    (host) indices of the new sequences, whose state starts from zeros. Returns ``o [T, HV, V]``.

    A sequence that is not new and whose segment stays inside one block (every decode step but one in ``CHUNK``)
    runs :func:`partial_blocks_in_slots`: its state is read in place and its slot is left as it is. With
    :data:`WHOLE_BLOCKS_IN_SLOTS`, a segment that completes its block (64 rows) goes there too, and its slot gets the
    state at the block's end. The others (new ones, longer prefills) gather their states, run
    ``gdn_chunk_varlen`` and store the states at their last boundary back into their slots. Each sequence's bits
    are those of ``gdn_chunk_varlen`` on it alone (the GPU tests); how the step splits does not change them."""

    N, dev = len(cu) - 1, q.device
    new = set(int(j) for j in fresh)
    most = CHUNK if WHOLE_BLOCKS_IN_SLOTS else CHUNK - 1  # the longest segment the partial-block path takes
    part = [j for j in range(N) if j not in new and cu[j + 1] - cu[j] <= most]
    full = [j for j in range(N) if j in new or cu[j + 1] - cu[j] > most]
    o = None if len(part) in (0, N) else torch.empty_like(v)
    for group in (part, full):
        if not group:
            continue
        if len(group) == N:  # every row, in place
            x, seg, sl = (q, k, v, g, beta), cu, slots
        else:
            rows, seg = _packed([(cu[j], cu[j + 1]) for j in group], dev)
            x, sl = [t[rows] for t in (q, k, v, g, beta)], slots[index_on(group, dev)]
        if group is part:
            og = partial_blocks_in_slots(*x, pool, sl, seg, q.shape[-1] ** -0.5 if scale is None else scale)
        else:
            states = torch.index_select(pool, 0, sl)  # [n, HV, K, V]
            zeros = [i for i, j in enumerate(group) if j in new]
            if zeros:
                states[index_on(zeros, dev)] = 0
            states = states.transpose(-1, -2)  # [n, HV, V, K] as the core takes them
            if not states.is_cuda:  # the torch core's bits follow the state's strides: its one layout (gdn_varlen)
                states = states.contiguous()
            og, finals = gdn_chunk_varlen(*x, states, seg, scale)
            pool.index_copy_(0, sl, finals.transpose(-1, -2).to(pool.dtype))
        if o is None:
            return og
        o[rows] = og.to(o.dtype)
    return o if o is not None else torch.empty_like(v)
