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

which is the recurrence of :mod:`vllm_bi.attention.gdn_recurrent` (``S_t = e^{g_t} S_{t-1} + U_t k_t^T``)
unrolled over the block. q and k are l2-normalised (eps 1e-6) and q scaled by ``K^-1/2`` first, as there.
Inputs and shapes as :func:`~vllm_bi.attention.gdn_recurrent.gdn_recurrent`: ``q, k [T, H, K]``,
``v [T, HV, V]``, ``g, beta [T, HV]`` fp32, ``state [HV, V, K]`` fp32.

Selected with ``VLLM_BI_GDN_MODE=chunk`` (server and trainer alike). This module is the CPU
implementation and the specification a CUDA path (fla-core's chunk kernel with pinned configs) must meet;
on CUDA the mode is refused for now.
"""

from __future__ import annotations

import torch

from vllm_bi.attention.gdn_recurrent import heads_qk
from vllm_bi.ops import pointwise
from vllm_bi.ops.linear import bi_bmm
from vllm_bi.ops.reduce import row_sum

__all__ = ["CHUNK", "GDN_MODE_ENV", "gdn_mode", "gdn_chunk_aligned"]

CHUNK = 64
GDN_MODE_ENV = "VLLM_BI_GDN_MODE"


def gdn_mode() -> str:
    """``VLLM_BI_GDN_MODE``: ``recurrent`` (default) or ``chunk`` (CPU only in this release). The server and
    the trainer must run the same mode; both read it from here."""
    import os

    mode = os.environ.get(GDN_MODE_ENV, "recurrent").strip().lower() or "recurrent"
    if mode not in ("recurrent", "chunk"):
        raise ValueError(f"{GDN_MODE_ENV}={mode!r}: choose 'recurrent' (default) or 'chunk'")
    return mode


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
    G = torch.cumsum(g, dim=0).transpose(0, 1).contiguous()  # [HV, C]
    bh = beta.transpose(0, 1)  # [HV, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    zero = torch.zeros((), device=dev)
    decay = torch.where(causal, pointwise.exp(torch.where(causal, G.unsqueeze(2) - G.unsqueeze(1), zero)), zero)
    eG = pointwise.exp(G)  # [HV, C]
    kT, S0T = kh.transpose(1, 2), S0.transpose(1, 2)
    A = (bh.unsqueeze(2) * decay * _bmm(kh, kT)).tril(-1)  # [HV, C, C]
    R = bh.unsqueeze(2) * (vh - eG.unsqueeze(2) * _bmm(kh, S0T))  # [HV, C, V]
    Ut = torch.zeros((HV, R.shape[2], C), dtype=torch.float32, device=dev)  # U with tokens on the last dim
    for t in range(C):  # forward substitution; row t reads rows < t only, with fixed shapes
        row = R[:, t] - row_sum(A[:, t].unsqueeze(1) * Ut).squeeze(-1)
        Ut = Ut.clone()  # out of place, so autograd can differentiate through the substitution
        Ut[:, :, t] = row
    U = Ut.transpose(1, 2)
    o = eG.unsqueeze(2) * _bmm(qh, S0T) + _bmm(decay * _bmm(qh, kT), U)
    last = decay[:, C - 1]  # exp(G_C - G_j), j = 0..C-1
    S = eG[:, C - 1].view(HV, 1, 1) * S0 + _bmm(Ut * last.unsqueeze(1), kh)
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
