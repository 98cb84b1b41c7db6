"""The server's recurrent GDN step on CUDA with the states read from, and written back to, their cache slots.

The recurrent mode used to gather every scheduled request's fp32 state
out of vLLM's state cache, run fla-core's fused recurrent kernel on the copy, and store the final states back:
three passes over the states where the kernel needs one. At Qwen3.5-9B dimensions a 256-request decode moves
537 MB per pass, and the GPU time of a decode step per layer was 1.18 ms against stock vLLM's 0.75 ms
(``docs/results/2026-12-01-h200-gdn-decode-gpu-time.md``), while stock updates its slots in place.

:func:`recurrent_in_slots` is one Triton kernel that does fla-core's fused recurrent arithmetic
(``fla.ops.gated_delta_rule.fused_recurrent``, the trainer's forward) on each request's slot in place. For
the bits to be the trainer's, it repeats that kernel's per-element operations in the same order, on the same
tile (``[K, 8]`` of the ``[K, V]`` state per program, one warp, three stages), with fla-core's own ``exp``:

* q and k of each token: fp32, divided by ``sqrt(sum(x * x) + 1e-6)``; q then times ``scale``;
* the state tile times ``exp(g)`` (a per-key-channel ``g``, Kimi Delta Attention's, scales each row of the tile:
  fla-core's ``gk``); ``v' = beta * (v - sum_k(S * k))``; ``S += k v'^T``; ``o = sum_k(S * q)``;
* the state starts as ``0 + S0`` (fla-core adds its loaded initial state to zeros), or 0 for a new request.

Only the addresses differ. A speculative step's rows (``spec_slots``) run through :func:`_spec_in_slots`, one
sequence per request with the state after each row stored into that row's slot: the bits of one call per row. It is
a kernel of its own, its per-token arithmetic the same line for line, so that the decode kernel stays the one the
GPU gate runs until a GPU run shows the speculative one exact (``VLLM_BI_SPEC_VERIFY``).

Other tiles (:class:`Tile`: more values of the state per program, more warps, other pipelining) run the same
operations per element, but a reduction's order follows the tile, so their bits are their own: a trainer then runs
this kernel for its forward too (:func:`vllm_bi.gdn.recurrent.gdn_recurrent_varlen`).

``tests/gpu/test_gdn_cuda.py`` checks ``torch.equal`` against fla-core's kernel on
the GPU; ``tests/ops/test_gdn_slots.py`` checks the logic through Triton's interpreter on CPU.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

__all__ = ["FLA_TILE", "Tile", "check_slot_pool", "current_tile", "parse_tile", "recurrent_in_slots"]


class Tile(NamedTuple):
    """How :func:`recurrent_in_slots` cuts the work: ``bv`` values of the ``[K, V]`` state per program, and Triton's
    ``warps`` and ``stages``. A token's bits depend on the tile: server and trainer use one."""

    bv: int
    warps: int
    stages: int


FLA_TILE = Tile(8, 1, 3)  # fla-core's fused recurrent launch: all of K, 8 values of V, one warp: its bits


def parse_tile(value: str) -> Tile:
    """``fla`` (or ``none``: no recurrent kernel runs) or ``BVxWARPSxSTAGES`` (the settings' resolved tile, already
    validated) as a :class:`Tile`. ``auto`` is not a tile: :meth:`vllm_bi.settings.Settings.recurrent_tile` resolves it."""
    if value in ("fla", "none"):
        return FLA_TILE
    bv, warps, stages = (int(x) for x in value.split("x"))
    return Tile(bv, warps, stages)


def current_tile() -> Tile:
    """This process's recurrent tile on CUDA (``VLLM_BI_GDN_TILE``)."""
    from vllm_bi.settings import current

    return parse_tile(current().recurrent_tile("cuda"))

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - vllm pulls triton in
    triton = None

if triton is not None:
    try:  # fla-core's exp (tl.exp, or libdevice's fast one under FLA_USE_FAST_OPS=1), as its kernels use it
        from fla.ops.utils.op import exp as fla_exp
    except ImportError:  # CPU installs have no fla-core; the interpreter tests run with tl.exp, its default

        @triton.jit
        def fla_exp(x):
            return tl.exp(x.to(tl.float32))

    @triton.jit
    def _step_in_slots(q, k, v, g, beta, o, pool, slot_stride, slots, fresh, cu, scale,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BVC: tl.constexpr, HAS_FRESH: tl.constexpr, GK: tl.constexpr,
                       ROUND: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        n_vb = tl.cdiv(V, BVC)
        vb, seq_head = pid % n_vb, pid // n_vb
        seq, hv = seq_head // HV, seq_head % HV
        hk = hv // (HV // H)
        first = tl.load(cu + seq).to(tl.int64)
        stop = tl.load(cu + seq + 1).to(tl.int64)
        slot = tl.load(slots + seq).to(tl.int64)
        ks = tl.arange(0, BK)
        vs = vb * BVC + tl.arange(0, BVC)
        k_ok, v_ok = ks < K, vs < V
        tile_ok = k_ok[:, None] & v_ok[None, :]
        state = pool + slot * slot_stride + hv * (K * V) + ks[:, None] * V + vs[None, :]
        S0 = tl.load(state, mask=tile_ok, other=0).to(tl.float32)
        if HAS_FRESH:
            S0 = tl.where(tl.load(fresh + seq) != 0, 0.0, S0)
        if ROUND:  # a bf16 pool: the state carried as stored (no 0 + S), so a reload gives the bits carried on
            S = S0
        else:  # fla-core's start, 0 + S
            S = tl.zeros([BK, BVC], dtype=tl.float32)
            S += S0
        for t in tl.range(first, stop):
            qt = tl.load(q + (t * H + hk) * K + ks, mask=k_ok, other=0).to(tl.float32)
            kt = tl.load(k + (t * H + hk) * K + ks, mask=k_ok, other=0).to(tl.float32)
            vt = tl.load(v + (t * HV + hv) * V + vs, mask=v_ok, other=0).to(tl.float32)
            qt = qt / tl.sqrt(tl.sum(qt * qt) + 1e-6)
            kt = kt / tl.sqrt(tl.sum(kt * kt) + 1e-6)
            qt = qt * scale
            bt = tl.load(beta + t * HV + hv).to(tl.float32)
            if GK:  # a decay per key channel (Kimi Delta Attention): fla-core's gk
                S *= fla_exp(tl.load(g + (t * HV + hv) * K + ks, mask=k_ok, other=0).to(tl.float32))[:, None]
            else:
                S *= fla_exp(tl.load(g + t * HV + hv).to(tl.float32))
            vt = bt * (vt - tl.sum(S * kt[:, None], 0))
            S += kt[:, None] * vt
            ot = tl.sum(S * qt[:, None], 0)
            tl.store(o + (t * HV + hv) * V + vs, ot.to(o.dtype.element_ty), mask=v_ok)
            if ROUND:  # a bf16 pool: every token's state as a call that stored and reloaded it would see it
                S = S.to(pool.dtype.element_ty).to(tl.float32)
        tl.store(state, S.to(pool.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def _spec_in_slots(q, k, v, g, beta, o, pool, slot_stride, slots, table, table_stride, cu, scale,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BVC: tl.constexpr, GK: tl.constexpr, ROUND: tl.constexpr):
        # _step_in_slots's program and per-token arithmetic; after token t the state goes into slot
        # table[seq, t - first], then on as a call that loaded it from there would: through 0 + S for an fp32
        # pool, as stored for a bf16 one (ROUND, as _step_in_slots)
        pid = tl.program_id(0).to(tl.int64)
        n_vb = tl.cdiv(V, BVC)
        vb, seq_head = pid % n_vb, pid // n_vb
        seq, hv = seq_head // HV, seq_head % HV
        hk = hv // (HV // H)
        first = tl.load(cu + seq).to(tl.int64)
        stop = tl.load(cu + seq + 1).to(tl.int64)
        slot = tl.load(slots + seq).to(tl.int64)
        ks = tl.arange(0, BK)
        vs = vb * BVC + tl.arange(0, BVC)
        k_ok, v_ok = ks < K, vs < V
        tile_ok = k_ok[:, None] & v_ok[None, :]
        in_slot = hv * (K * V) + ks[:, None] * V + vs[None, :]
        S0 = tl.load(pool + slot * slot_stride + in_slot, mask=tile_ok, other=0).to(tl.float32)
        if ROUND:  # a bf16 pool: the state carried as stored (no 0 + S), so a reload gives the bits carried on
            S = S0
        else:  # fla-core's start, 0 + S
            S = tl.zeros([BK, BVC], dtype=tl.float32)
            S += S0
        for t in tl.range(first, stop):
            qt = tl.load(q + (t * H + hk) * K + ks, mask=k_ok, other=0).to(tl.float32)
            kt = tl.load(k + (t * H + hk) * K + ks, mask=k_ok, other=0).to(tl.float32)
            vt = tl.load(v + (t * HV + hv) * V + vs, mask=v_ok, other=0).to(tl.float32)
            qt = qt / tl.sqrt(tl.sum(qt * qt) + 1e-6)
            kt = kt / tl.sqrt(tl.sum(kt * kt) + 1e-6)
            qt = qt * scale
            bt = tl.load(beta + t * HV + hv).to(tl.float32)
            if GK:
                S *= fla_exp(tl.load(g + (t * HV + hv) * K + ks, mask=k_ok, other=0).to(tl.float32))[:, None]
            else:
                S *= fla_exp(tl.load(g + t * HV + hv).to(tl.float32))
            vt = bt * (vt - tl.sum(S * kt[:, None], 0))
            S += kt[:, None] * vt
            ot = tl.sum(S * qt[:, None], 0)
            tl.store(o + (t * HV + hv) * V + vs, ot.to(o.dtype.element_ty), mask=v_ok)
            dst = tl.load(table + seq * table_stride + (t - first)).to(tl.int64)
            tl.store(pool + dst * slot_stride + in_slot, S.to(pool.dtype.element_ty), mask=tile_ok)
            if ROUND:
                S = S.to(pool.dtype.element_ty).to(tl.float32)
            else:
                S = tl.zeros([BK, BVC], dtype=tl.float32) + S.to(pool.dtype.element_ty).to(tl.float32)


def check_slot_pool(who: str, x: torch.Tensor, pool: torch.Tensor, HV: int, K: int, V: int) -> None:
    """What a kernel over vLLM's state slots needs: Triton, CUDA inputs (CPU only under ``TRITON_INTERPRET=1``,
    for tests), and ``pool [S, HV, K, V]`` fp32 or bf16 (:func:`vllm_bi.gdn.recurrent.state_dtype`) with each slot
    contiguous (the stride between slots is free)."""
    if triton is None:
        raise RuntimeError(f"{who} needs triton")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{who} runs on CUDA (on CPU only under TRITON_INTERPRET=1, for tests)")
    if pool.dtype not in (torch.float32, torch.bfloat16) or pool.stride()[1:] != (K * V, V, 1):
        raise ValueError(f"{who}: the state pool must be fp32 or bf16 with contiguous slots, got {pool.dtype} with strides "
                         f"{pool.stride()}")
    if tuple(pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"{who}: state pool {tuple(pool.shape)} does not hold [HV, K, V] = {(HV, K, V)} per slot")


def recurrent_in_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       pool: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor, scale: float,
                       fresh: torch.Tensor | None = None, spec_slots: torch.Tensor | None = None,
                       tile: Tile | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run packed sequences through the recurrence, each from and into its state slot.

    ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]`` (``g`` may be ``[T, HV, K]``, a decay per key
    channel) (l2norm of q and k inside, as fla-core's
    ``use_qk_l2norm_in_kernel``); ``pool [S, HV, K, V]`` fp32 or bf16, fla-core's state order, each slot contiguous
    (vLLM may pad the stride between slots), updated in place (a bf16 pool: every token's state rounded to bf16 before
    the next token, so a call's bits are those of one call per token; :func:`vllm_bi.gdn.recurrent.state_dtype`);
    ``slots [N]`` each sequence's slot (device; distinct, except vLLM's padding rows, which all use slot 0,
    the null block); ``cu [N + 1]`` offsets (device); ``fresh [N]`` nonzero where a sequence starts from zeros.
    Returns ``o [T, HV, V]`` in ``v.dtype``.

    ``spec_slots [N, P]`` (device; a speculative step's slot table; no ``fresh``): sequence ``j`` then starts from
    slot ``slots[j]`` and, after its token at position ``p`` (``p < P`` tokens from its first), its state goes into
    slot ``spec_slots[j, p]`` (``slots[j]`` is written only where it is one of those). Every output and every stored
    state has the bits of running the tokens one at a time, each call from the slot the previous one wrote: the
    state stays in registers, then goes through ``0 + S`` as a call's load would (the same value, ``-0.0`` made
    ``+0.0``). A destination may be the source slot: each program reads its tile of the source once, before its
    first token, and no two programs touch the same tile. The slots written must differ between sequences.

    ``tile``: how the work is cut (default :func:`current_tile`, ``VLLM_BI_GDN_TILE``); each tile has its own bits.
    ``out``: where ``o`` goes (``[T, HV, V]``, contiguous, ``v.dtype``; the caller's buffer), else a new tensor."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    check_slot_pool("recurrent_in_slots", q, pool, HV, K, V)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    N = slots.shape[0]
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous()):
        raise ValueError(f"recurrent_in_slots: out must be a contiguous {tuple(v.shape)} {v.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    o = torch.empty_like(v) if out is None else out
    if N == 0 or T == 0:
        return o
    tile = current_tile() if tile is None else tile
    grid = (triton.cdiv(V, tile.bv) * N * HV,)
    if spec_slots is not None:
        if spec_slots.dim() != 2 or spec_slots.shape[0] != N or fresh is not None:
            raise ValueError(f"recurrent_in_slots: spec_slots {tuple(spec_slots.shape)} must be [N, P] with N = {N}, "
                             "without fresh")
        table = spec_slots.contiguous()
        _spec_in_slots[grid](q, k, v, g, beta, o, pool, pool.stride(0), slots, table, table.stride(0), cu, scale,
                             H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BVC=tile.bv, GK=g.dim() == 3,
                             ROUND=pool.dtype != torch.float32, num_warps=tile.warps, num_stages=tile.stages)
        return o
    _step_in_slots[grid](q, k, v, g, beta, o, pool, pool.stride(0), slots, fresh if fresh is not None else slots, cu, scale,
                         H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BVC=tile.bv, HAS_FRESH=fresh is not None,
                         GK=g.dim() == 3, ROUND=pool.dtype != torch.float32, num_warps=tile.warps,
                         num_stages=tile.stages)
    return o
