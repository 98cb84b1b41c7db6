"""Chunk-aligned Gated DeltaNet (the performance mode of DESIGN.md), reference implementation in torch.

The recurrent mode walks every token. The chunked form computes a block of ``C`` tokens with matrix
products from the state at the block's start. It is batch-invariant and split-exact *if* the blocks sit
at absolute positions ``0, C, 2C, ...`` of each sequence and every block is computed with the same shapes
whatever its fill:

* a sequence's state is kept at its last **boundary** (a multiple of ``C``), fp32;
* the tokens after that boundary (the **partial** block, fewer than ``C``) are recomputed with each new
  token — decode recomputes its partial block, a prefill split resumes at the boundary;
* every block is padded to ``C`` tokens with ``k = v = q = 0``, ``beta = 0``, ``g = 0``; row ``t`` of every
  product then depends only on tokens ``<= t`` and on fixed shapes, so a token's output has the same bits
  in a full block, a partial block, a long prefill or a one-token decode.

Per block, value head ``h`` (``G`` = cumulative log-decay from the boundary, ``S0`` the boundary state
``[V, K]``)::

    A[t, j] = beta_t * exp(G_t - G_j) * (k_t . k_j)              j < t   (strictly lower)
    R_t     = beta_t * (v_t - exp(G_t) * S0 k_t)
    (I + A) U = R                                               forward substitution, row by row
    o_t     = exp(G_t) * S0 q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) U_j
    S_C     = exp(G_C) * S0 + sum_j exp(G_C - G_j) U_j k_j^T    (the next boundary)

which is the recurrence of :mod:`vllm_bi.gdn.recurrent` (``S_t = e^{g_t} S_{t-1} + U_t k_t^T``)
unrolled over the block. q and k are l2-normalised (eps 1e-6) and q scaled by ``K^-1/2`` first, as there.
Inputs and shapes as :func:`~vllm_bi.gdn.recurrent.gdn_recurrent`: ``q, k [T, H, K]``,
``v [T, HV, V]``, ``g, beta [T, HV]`` fp32, ``state [HV, V, K]`` fp32. ``g [T, HV, K]``, a log decay per key
channel (Kimi Delta Attention), runs the same blocks with the decays inside the sums over ``K``
(:func:`_block_per_channel`); CPU only (fla-core's chunked kernel takes one decay per head).

Selected with ``VLLM_BI_GDN_MODE=chunk`` (server and trainer alike); :func:`gdn_chunk_varlen` is the one
entry point. CPU: :func:`gdn_chunk_aligned` below, per sequence (the specification). CUDA: fla-core's chunked
kernel (``chunk_gated_delta_rule``, chunk 64), which anchors its chunks at each packed sequence's start, in
two launches so that the state at the last boundary comes out in fp32: the whole blocks of every sequence
(their final states are the new boundary states), then the partial blocks from those states. Every
autotuned fla-core kernel of that forward is pinned to one config (:func:`pin_fla_chunk_configs`), so the
server and the trainer, in any process and for any batch, run the same code. Within a 64-row chunk, row
``t`` of every fla-core intermediate depends on rows ``<= t`` only (later rows enter multiplied by exact
zeros), and the state between chunks stays fp32 (``h`` is its bf16 rounding in both launches), so a token
gets the same bits in a full chunk of a long launch and in a partial chunk of a decode step. The GPU tests
(``tests/gpu/test_gdn_chunk_cuda.py``) check that claim.
"""

from __future__ import annotations

import torch

from vllm_bi.gdn.recurrent import FLAGatedDeltaRule, heads_qk
from vllm_bi.ops.device import index_on, rows_of
from vllm_bi.ops import pointwise
from vllm_bi.ops.linear import bi_bmm
from vllm_bi.settings import current
from vllm_bi.ops.reduce import row_sum

__all__ = ["CHUNK", "gdn_mode", "gdn_chunk_aligned", "gdn_chunk_varlen", "pin_fla_chunk_configs"]

CHUNK = 64


def gdn_mode() -> str:
    """``VLLM_BI_GDN_MODE``: ``recurrent`` (default) or ``chunk``. The server and the trainer must run the same
    mode (:mod:`vllm_bi.settings`)."""
    return current().gdn_mode


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return bi_bmm(a, b, torch.float32)


def _block(q, k, v, g, beta, S0, C: int):
    """One block padded to ``C`` rows; returns (o [C, HV, V], state at the block's end [HV, V, K]).

    Every product is an op-library call (``bi_bmm``: float64 accumulation per head; ``row_sum``;
    ``pointwise.exp``) on shapes fixed by ``C`` and the head sizes, so the server (where vLLM's ``bmm`` may
    be overridden) and the trainer compute the same bits."""
    HV = v.shape[1]
    dev = q.device
    qh, kh, vh = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # [HV, C, *]
    G = torch.cumsum(g, dim=0).transpose(0, 1).contiguous()  # [HV, C] (or [HV, C, K]: a decay per key channel)
    bh = beta.transpose(0, 1)  # [HV, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    zero = torch.zeros((), device=dev)
    kT, S0T = kh.transpose(1, 2), S0.transpose(1, 2)
    if G.dim() == 3:
        return _block_per_channel(qh, kh, vh, G, bh, S0, C, causal, zero)
    decay = torch.where(causal, pointwise.exp(torch.where(causal, G.unsqueeze(2) - G.unsqueeze(1), zero)), zero)
    eG = pointwise.exp(G)  # [HV, C]
    A = (bh.unsqueeze(2) * decay * _bmm(kh, kT)).tril(-1)  # [HV, C, C]
    R = bh.unsqueeze(2) * (vh - eG.unsqueeze(2) * _bmm(kh, S0T))  # [HV, C, V]
    Ut = _substitute(A, R)  # U with tokens on the last dim
    U = Ut.transpose(1, 2)
    o = eG.unsqueeze(2) * _bmm(qh, S0T) + _bmm(decay * _bmm(qh, kT), U)
    last = decay[:, C - 1]  # exp(G_C - G_j), j = 0..C-1
    S = eG[:, C - 1].view(HV, 1, 1) * S0 + _bmm(Ut * last.unsqueeze(1), kh)
    return o.transpose(0, 1), S


def _substitute(A, R):
    """Solve ``(I + A) U = R`` for strictly lower ``A [HV, C, C]``, row by row; returns ``U`` with tokens on the last
    dim, ``[HV, V, C]``. Row ``t`` reads rows ``< t`` only, with fixed shapes."""
    HV, C, V = R.shape
    Ut = torch.zeros((HV, V, C), dtype=torch.float32, device=R.device)
    for t in range(C):
        row = R[:, t] - row_sum(A[:, t].unsqueeze(1) * Ut).squeeze(-1)
        Ut = Ut.clone()  # out of place, so autograd can differentiate through the substitution
        Ut[:, :, t] = row
    return Ut


def _block_per_channel(qh, kh, vh, G, bh, S0, C, causal, zero):
    """:func:`_block` with a log decay per key channel (Kimi Delta Attention): ``G [HV, C, K]``. The state decays
    column by column (``S_t = S_{t-1} diag(e^{g_t}) + U_t k_t^T``), so every decay between two rows sits inside the
    sum over ``K``: ``A[t, j] = beta_t * sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c])``, and likewise ``q_t . k_j`` in
    the output. Those sums are op-library row sums over the ``[HV, C, C, K]`` products; the rest are ``bi_bmm``
    calls as in the per-head form. Every exponent is ``<= 0`` (``G`` falls along the block)."""
    mask = causal.view(1, C, C, 1)
    decay = torch.where(mask, pointwise.exp(torch.where(mask, G.unsqueeze(2) - G.unsqueeze(1), zero)), zero)
    eG = pointwise.exp(G)  # [HV, C, K]
    S0T = S0.transpose(1, 2)  # [HV, K, V]
    A = (bh.unsqueeze(2) * row_sum(kh.unsqueeze(2) * kh.unsqueeze(1) * decay).squeeze(-1)).tril(-1)  # [HV, C, C]
    R = bh.unsqueeze(2) * (vh - _bmm(kh * eG, S0T))  # [HV, C, V]
    Ut = _substitute(A, R)
    qk = row_sum(qh.unsqueeze(2) * kh.unsqueeze(1) * decay).squeeze(-1)  # [HV, C, C], zero above the diagonal
    o = _bmm(qh * eG, S0T) + _bmm(qk, Ut.transpose(1, 2))
    S = S0 * eG[:, C - 1].unsqueeze(1) + _bmm(Ut, kh * decay[:, C - 1])  # decay[:, C-1]: exp(G_C - G_j) per channel
    return o.transpose(0, 1), S


def gdn_chunk_aligned(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the tokens of one sequence that follow a block boundary (its first token sits at a multiple of
    ``chunk``), from ``state``, the fp32 state at that boundary.

    Returns ``(o [T, HV, V] fp32, boundary state, final state)``: the state at the last boundary reached
    (what a chunk-aligned cache keeps, with the ``T % chunk`` tokens after it) and the state after the last
    token (for comparison with the recurrent mode; equal to it within fp32 rounding, not in bits).
    """
    qn, kn = heads_qk(q, k, v, state, scale, "gdn_chunk_aligned")
    T, HV, V = v.shape
    v32, g32, b32 = v.float(), g.float(), beta.float()
    C = chunk
    out = torch.empty((T, HV, V), dtype=torch.float32, device=q.device)
    S, boundary = state, state
    for s in range(0, T, C):
        n = min(C, T - s)
        blk = []
        for x in (qn, kn, v32, g32, b32):
            pad = torch.zeros((C, *x.shape[1:]), dtype=x.dtype, device=x.device)
            pad[:n] = x[s : s + n]
            blk.append(pad)
        o, S_end = _block(*blk, S, C)
        out[s : s + n] = o[:n]
        if n == C:
            S = boundary = S_end
        else:  # partial block: the state after its last real token (padding has g = 0, beta = 0)
            S = S_end
    return out, boundary, S


def gdn_chunk_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: list[int],
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences, each starting at a block boundary from its boundary state: ``q, k [T, H, K]``,
    ``v [T, HV, V]``, ``g, beta [T, HV]`` fp32 (``g [T, HV, K]``: a decay per key channel, CPU only),
    ``states [N, HV, V, K]`` fp32, ``cu_seqlens`` N + 1 offsets.

    Returns ``(o [T, HV, V], boundary states [N, HV, V, K] fp32)``: each sequence's state at the last block
    boundary it reached (its input state when it reached none). ``o`` is fp32 on CPU and ``v.dtype`` on
    CUDA. Differentiable (CUDA: fla-core's chunked backward, or the torch recurrence where fla-core
    refuses it)."""
    cu = [int(x) for x in cu_seqlens]
    if states is None or states.dtype != torch.float32:
        raise ValueError("gdn_chunk_varlen needs explicit fp32 boundary states (zeros for new sequences)")
    if not q.is_cuda:
        outs, bounds = [], []
        for i in range(len(cu) - 1):
            s, e = cu[i], cu[i + 1]
            o, b, _ = gdn_chunk_aligned(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], states[i], scale)
            outs.append(o)
            bounds.append(b)
        return torch.cat(outs), torch.stack(bounds)
    if g.dim() == 3:
        raise NotImplementedError("gdn_chunk_varlen: a decay per key channel (Kimi Delta Attention) runs on CPU only "
                                  "in the chunk GDN mode; use VLLM_BI_GDN_MODE=recurrent")
    return _chunk_varlen_cuda(q, k, v, g, beta, states, cu, scale)


def _packed(ranges, dev):
    """The rows of ``ranges`` packed (device index), and the packed segments' offsets."""
    return rows_of(ranges, dev), [0, *torch.tensor([e - s for s, e in ranges]).cumsum(0).tolist()]


def _chunk_varlen_cuda(q, k, v, g, beta, states, cu, scale):
    """Two fla-core chunked launches: the whole blocks of every sequence (their final states are the boundary
    states), then the partial blocks from those states. A launch that takes every row in order reads the
    packed tensors in place; otherwise its rows are gathered. When every sequence has whole blocks (a prefill
    batch), launch 1 takes every row in place: each sequence is two segments, its whole blocks and its
    partial tail, and the tail's output (from the wrong state) is replaced by launch 2's. Segments are
    independent in fla-core's varlen kernels, so a segment's bits do not depend on its neighbours."""
    pin_fla_chunk_configs()
    C, dev = CHUNK, q.device
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = len(cu) - 1
    whole = [(cu[i + 1] - cu[i]) // C * C for i in range(n)]
    full = [i for i in range(n) if whole[i]]
    part = [i for i in range(n) if cu[i] + whole[i] < cu[i + 1]]
    g = g.to(torch.promote_types(g.dtype, torch.float32))
    bound = states.transpose(-1, -2)  # fla-core keeps [N, HV, K, V] (no copy when states is a view of that)

    def launch(rows, cut, h0):
        # one fla-core chunked launch over `rows` (None: every row, in place), segments `cut`, states h0
        x = [t if rows is None else t[rows] for t in (q, k, v, g, beta)]
        o_, ht = FLAGatedDeltaRule.apply("chunk", *(t.unsqueeze(0) for t in x), h0.contiguous(),
                                         index_on(cut, dev), scale)
        return o_, ht  # o_ [1, rows, HV, V]

    o = None
    if full and len(full) == n:
        cut, h_src, whole_seg = [0], [], []
        for i in range(n):
            whole_seg.append(len(cut) - 1)  # the index of sequence i's whole-block segment
            cut.append(cu[i] + whole[i])
            h_src.append(i)
            if cu[i] + whole[i] < cu[i + 1]:  # its partial tail, recomputed by launch 2
                cut.append(cu[i + 1])
                h_src.append(i)
        tails = len(h_src) > n
        o, ht = launch(None, cut, bound[index_on(h_src, dev)] if tails else bound)
        bound = ht[index_on(whole_seg, dev)] if tails else ht
    elif full:
        rows, cut = _packed([(cu[i], cu[i] + whole[i]) for i in full], dev)
        full_t = index_on(full, dev)
        o_full, ht = launch(rows, cut, bound[full_t])
        o = torch.zeros((1, *v.shape), dtype=o_full.dtype, device=dev).index_copy_(1, rows, o_full)
        bound = bound.index_copy(0, full_t, ht)
    if part:
        if o is None and len(part) == n:  # only partial blocks, every row: in place
            o, _ = launch(None, cu, bound)
        else:
            rows, cut = _packed([(cu[i] + whole[i], cu[i + 1]) for i in part], dev)
            o_part, _ = launch(rows, cut, bound[index_on(part, dev)])
            if o is None:
                o = torch.zeros((1, *v.shape), dtype=o_part.dtype, device=dev)
            o = o.index_copy(1, rows, o_part.to(o.dtype))  # out of place: autograd refuses writes into o_
    if o is None:
        o = torch.zeros((1, *v.shape), dtype=v.dtype, device=dev)
    return o[0], bound.transpose(-1, -2)


# fla-core 0.6.0 kernels of the chunked forward and the config each is pinned to (fields that must match
# one of the kernel's own configs; pinning raises where none does). Autotuning picks by timing, per
# process and per key (l2norm's key changes with the number of rows), and the config decides the
# reduction order; pinned, every process and batch runs the same code. The pins are what fla-core's autotuner
# picked on the H200 for the stock 8 x 8K prefill at Qwen3.5-9B dims (docs/results/2026-11-30-h200-gdn-cost.md:
# the first pins, 4 warps for the kkt solve and 2 stages for the state kernel, cost 2.6 + 1.1 ms there
# against 0.7 + 0.8 ms).
FLA_CHUNK_PINS = {
    ("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel"): {"num_warps": 1},
    ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"):
        {"BK": 64, "num_warps": 1, "num_stages": 3},
    ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"): {"num_warps": 4, "num_stages": 3},
    ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"):
        {"BV": 32, "num_warps": 4, "num_stages": 4},
    ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"): {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3},
    ("fla.modules.norm.l2norm", "l2norm_fwd_kernel"): {"BT": 16, "num_warps": 4},
    ("fla.modules.norm.l2norm", "l2norm_fwd_kernel_row"): {"num_warps": 8},
}
# fla-core re-dispatches the whole op to other backends when these are on; the chunk-aligned mode needs its
# own Triton kernels
_FLA_ENV_OFF = {"FLA_FLASH_QLA": "0", "FLA_INTRACARD_CP": "0"}
_pinned: dict[str, str] = {}


def _matches(cfg, want: dict) -> bool:
    have = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return all(have.get(k) == v for k, v in want.items())


def pin_fla_chunk_configs() -> dict[str, str]:
    """Pin every autotuned kernel of fla-core's chunked GDN forward to one config (idempotent).

    Returns ``{kernel: config}``. Raises ``RuntimeError`` naming the kernel when fla-core does not have it
    where this release expects it (another fla-core version): the chunk-aligned mode cannot then promise
    the same code in every process."""
    if _pinned:
        return _pinned
    import importlib
    import os

    from triton.runtime.autotuner import Autotuner

    for k, v in _FLA_ENV_OFF.items():
        os.environ[k] = v
    pinned = {}
    for (mod, name), want in FLA_CHUNK_PINS.items():
        try:
            kernel = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise RuntimeError(
                f"vllm_bi: the chunk-aligned GDN mode pins fla-core's {mod}.{name}, which this fla-core does "
                f"not have ({e}); install fla-core==0.6.0 or use VLLM_BI_GDN_MODE=recurrent") from e
        while not isinstance(kernel, Autotuner) and hasattr(kernel, "fn"):
            kernel = kernel.fn
        if not isinstance(kernel, Autotuner):
            raise RuntimeError(f"vllm_bi: fla-core's {mod}.{name} is not autotuned here; cannot pin it")
        cfg = next((c for c in kernel.configs if _matches(c, want)), None)
        if cfg is None:
            raise RuntimeError(
                f"vllm_bi: fla-core's {mod}.{name} has no config {want} (its configs: "
                f"{[str(c) for c in kernel.configs]}); install fla-core==0.6.0 or use VLLM_BI_GDN_MODE=recurrent")
        kernel.configs = [cfg]
        kernel.cache.clear()
        pinned[name] = str(cfg)
    _pinned.update(pinned)
    return _pinned
