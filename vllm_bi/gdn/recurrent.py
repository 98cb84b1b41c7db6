"""The one place the Gated DeltaNet recurrence runs (recurrent mode of DESIGN.md).

Prefill, decode, mixed batches and the trainer forward all call
:func:`gdn_recurrent`, one sequence at a time, token by token, with an fp32
state ``S[HV, V, K]``. The state a sequence starts from is always passed
explicitly (zeros for a new sequence), only the final state is returned, and
nothing in the arithmetic depends on other sequences or on where a prompt was
split: with an fp32 state cache, a chunked prefill is an exact store/reload.

Per token t, value head h (key head ``h // (HV // H)``)::

    q_t, k_t  = l2norm(q_t), l2norm(k_t)           # x * rsqrt(sum(x^2) + 1e-6), fp32
    S        *= exp(g_t[h])                        # g = -exp(A_log) * softplus(a + dt_bias)
    kv        = sum_k S[v, k] * k_t[k]
    S        += ((v_t - kv) * beta_t[h]) ⊗ k_t     # beta = sigmoid(b)
    o_t[v]    = sum_k S[v, k] * q_t[k] * K^-1/2

Shapes: ``q, k: [T, H, K]``, ``v: [T, HV, V]``, ``g, beta: [T, HV]`` (fp32),
``state: [HV, V, K]`` fp32. Output ``[T, HV, V]`` fp32.

CPU: plain torch ops whose shapes depend only on (H, HV, K, V), so every
token of every sequence is computed by the same kernels in the same order.

CUDA (:func:`gdn_recurrent_varlen`): fla-core's ``fused_recurrent_gated_delta_rule``
over a varlen batch, every sequence given an explicit fp32 initial state (its
``initial_state=None`` path compiles to different code and gives different bits;
see ``shared/docs/gpu-measurements.md``), l2norm in the kernel. Measured
batch-invariant and split-exact on the H200 (``tests/gpu/test_gdn_cuda.py``).
Its backward recomputes with fla-core's chunked kernel (the recurrent one has
none), or with :func:`gdn_torch_varlen` where fla-core refuses that kernel (Hopper with
Triton < 3.7.1 and no tilelang); only the forward must match the server.
"""
from __future__ import annotations

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.device import index_on
from vllm_bi.ops.reduce import row_sum

__all__ = ["gdn_gating", "kda_gating", "l2norm", "heads_qk", "gdn_recurrent", "gdn_recurrent_varlen", "gdn_torch_varlen",
           "FLAGatedDeltaRule", "state_dtype"]

L2NORM_EPS = 1e-6
_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def state_dtype() -> torch.dtype:
    """The dtype the recurrent state is kept in between tokens (``VLLM_BI_GDN_STATE``): ``torch.float32``, or
    ``torch.bfloat16``, where every token's updated state is rounded to bf16 before the next token reads it (its
    output is computed from the unrounded state). Rounding after every token, never only where a call ends, keeps a
    sequence's bits independent of where its prompt was split, at half the fp32 cache's size and traffic. The
    arithmetic stays fp32; the states passed between functions stay fp32 tensors (holding bf16 values)."""
    from vllm_bi.settings import current

    return _STATE_DTYPES[current().gdn_state]


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; both fp32 ``[T, HV]``. Under
    ``VLLM_BI_GDN_GATES=triton`` one kernel computes both (:mod:`vllm_bi.ops.gates_triton`)."""
    from vllm_bi.settings import current

    if current().gdn_gates_op(a.device.type) == "triton":
        from vllm_bi.ops._choice import check_triton_device
        from vllm_bi.ops.gates_triton import gdn_gates

        check_triton_device("VLLM_BI_GDN_GATES", "triton", a.device.type)
        return gdn_gates(A_log, a, b, dt_bias)
    g = -pointwise.exp(A_log.float()) * pointwise.softplus(a.float() + dt_bias.float())
    beta = pointwise.sigmoid(b.float())
    return g, beta


def kda_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention's gates: a log decay per key channel from ``a [T, H, K]`` (the low-rank forget-gate
    projection), ``dt_bias [H * K]`` and ``A_log [H]``, and ``beta = sigmoid(b)`` from ``b [T, H]``; both fp32.
    ``g = -exp(A_log) * softplus(a + dt_bias)``, or with a ``lower_bound`` (in ``[-5, 0)``, the checkpoint's
    ``gate_lower_bound``) ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, which keeps every decay at least
    ``exp(lower_bound)``. ``g`` feeds :func:`gdn_recurrent` as ``[T, H, K]``."""
    H, K = a.shape[-2], a.shape[-1]
    x = a.float() + dt_bias.float().view(H, K)
    rate = pointwise.exp(A_log.float()).view(H, 1)
    if lower_bound is None:
        g = -rate * pointwise.softplus(x)
    else:
        g = lower_bound * pointwise.sigmoid(rate * x)
    return g, pointwise.sigmoid(b.float())


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, fp32."""
    x = x.float()
    return x * pointwise.rsqrt(row_sum(x * x) + L2NORM_EPS)


def heads_qk(q, k, v, state, scale: float | None, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the shapes and the explicit fp32 state; return l2-normalised ``q * scale`` and ``k`` repeated
    to the value heads, ``[T, HV, K]`` fp32 (``scale`` default ``K^-1/2``)."""
    if state is None or state.dtype != torch.float32:
        raise ValueError(f"{who} needs an explicit fp32 state (zeros for a new sequence): got "
                         f"{None if state is None else state.dtype}, expected torch.float32")
    H, K = q.shape[1], q.shape[2]
    HV = v.shape[1]
    if HV % H:
        raise ValueError(f"value heads {HV} not a multiple of key heads {H}")
    scale = K**-0.5 if scale is None else scale
    qn, kn = l2norm(q) * scale, l2norm(k)
    if HV > H:
        qn, kn = qn.repeat_interleave(HV // H, dim=1), kn.repeat_interleave(HV // H, dim=1)
    return qn, kn


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one sequence through the recurrence; returns ``(o [T, HV, V] fp32, final state)``.

    ``q`` and ``k`` are raw (l2-normalised here). ``state`` is not modified. ``g`` is the log decay: ``[T, HV]``, one
    per head (GDN), or ``[T, HV, K]``, one per key channel (Kimi Delta Attention's channel-wise gate); a per-channel
    ``g`` equal across ``K`` gives the per-head one's bits. Under a bf16 :func:`state_dtype` the state is rounded to
    bf16 after every token (and the returned state holds bf16 values).
    """
    if q.device.type != "cpu":
        raise NotImplementedError(
            "vllm_bi.gdn.recurrent: only the CPU implementation exists in this release"
        )
    qn, kn = heads_qk(q, k, v, state, scale, "gdn_recurrent")
    T, HV, V = v.shape
    v32 = v.float()
    decay = pointwise.exp(g.float())
    beta = beta.float()
    gate_shape = (HV, 1, 1) if decay.dim() == 2 else (HV, 1, decay.shape[-1])  # the state is [HV, V, K]
    rounded = state_dtype() != torch.float32
    S = state.clone()
    out = torch.empty((T, HV, V), dtype=torch.float32)
    for t in range(T):
        k_t = kn[t].unsqueeze(1)  # [HV, 1, K]
        S = S * decay[t].view(gate_shape)
        kv = row_sum(S * k_t).squeeze(-1)  # [HV, V]
        delta = (v32[t] - kv) * beta[t].view(HV, 1)
        S = S + delta.unsqueeze(-1) * k_t
        out[t] = row_sum(S * qn[t].unsqueeze(1)).squeeze(-1)
        if rounded:  # the state a later call would load: its bits do not depend on where a call ends
            S = _RoundState.apply(S)
    return out, S


class _RoundState(torch.autograd.Function):
    """An fp32 state rounded to bf16 values (kept fp32); the backward passes the gradient through unchanged, so a
    trainer's gradients are those of the fp32 recurrence (straight through the rounding), as on CUDA, whose
    backward recomputes without rounding."""

    @staticmethod
    def forward(ctx, S):
        return S.to(torch.bfloat16).float()

    @staticmethod
    def backward(ctx, grad):
        return grad


class FLAGatedDeltaRule(torch.autograd.Function):
    """A fla-core forward with a backward that works on every GPU.

    Forward: ``kind="recurrent"`` is fla-core's fused recurrent kernel (vllm_bi's recurrent mode; under a
    ``VLLM_BI_GDN_TILE`` of vllm_bi's own, :func:`vllm_bi.gdn.slots.recurrent_in_slots` with that tile, as the server),
    ``kind="chunk"`` its chunked kernel (the chunk-aligned mode; callers pin its configs,
    :func:`vllm_bi.gdn.chunk.pin_fla_chunk_configs`). fla-core layout: ``q, k [1, T, H, K]``,
    ``v [1, T, HV, V]``, ``g, beta [1, T, HV]``, ``h0 [N, HV, K, V]`` fp32, ``cu`` a LongTensor; l2norm of q
    and k in the kernel. ``g [1, T, HV, K]`` (recurrent only) is a decay per key channel, fla-core's ``gk``.
    Returns ``(o, final states)``.

    Backward: fla-core's chunked backward. ``kind="chunk"`` keeps the forward's own autograd graph (fla-core's
    forward is the same computation with or without gradients, so the bits are the server's) and differentiates
    it; ``kind="recurrent"`` recomputes the forward with the chunked kernel first (with a per-channel decay,
    which that kernel does not take, :func:`gdn_torch_varlen`). Where fla-core refuses its chunked backward (Hopper with Triton < 3.7.1 and no tilelang), the same math in torch
    (:func:`gdn_torch_varlen`). Only the forward has to match the server bit for bit."""

    @staticmethod
    def forward(ctx, kind, q, k, v, g, beta, h0_kv, cu, scale):
        ctx.graph = None
        if kind == "chunk" and any(ctx.needs_input_grad[1:7]):
            with torch.enable_grad():  # no recompute in the backward (measured on a 1x4K training profile)
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, h0_kv)]
                o, ht = _FLA_FORWARDS[kind](*leaves, cu, scale)
            ctx.graph = (leaves, o, ht)
            o, ht = o.detach(), ht.detach()
        else:
            with torch.no_grad():
                o, ht = _FLA_FORWARDS[kind](q, k, v, g, beta, h0_kv, cu, scale)
        ctx.save_for_backward(q, k, v, g, beta, h0_kv, cu)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu = ctx.saved_tensors
        graph, ctx.graph = ctx.graph, None
        try:
            if graph is not None:
                grads = _graph_grads(*graph, do, dht)
            elif g.dim() == 4:  # a decay per key channel: fla-core's gated chunk kernel takes one per head
                grads = _recompute_grads(gdn_torch_varlen, q, k, v, g, beta, h0, cu, ctx.scale, do, dht)
            else:
                grads = _recompute_grads(_FLA_FORWARDS["chunk"], q, k, v, g, beta, h0, cu, ctx.scale, do, dht)
        except RuntimeError as e:
            if _HOPPER_REFUSAL not in str(e):
                raise
            _warn_fallback(e)
            grads = _recompute_grads(gdn_torch_varlen, q, k, v, g, beta, h0, cu, ctx.scale, do, dht)
        return (None, *grads, None, None)


def _fla_recurrent(q, k, v, g, beta, h0, cu, scale):
    from vllm_bi.gdn.slots import FLA_TILE, current_tile, recurrent_in_slots

    tile, dtype = current_tile(), state_dtype()
    if tile != FLA_TILE or dtype != torch.float32:  # vllm_bi's own tile or state rounding: only its kernel has them
        pool = h0.detach().to(dtype).contiguous().clone()
        slots = torch.arange(pool.shape[0], device=pool.device)
        o = recurrent_in_slots(q[0], k[0], v[0], g[0], beta[0], pool, slots, cu, scale, tile=tile)
        return o.unsqueeze(0), pool.float()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    per_channel = g.dim() == 4  # [1, T, HV, K]: Kimi Delta Attention's decay per key channel, fla-core's gk
    return fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=None if per_channel else g, gk=g if per_channel else None, beta=beta, scale=scale,
        initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
    )


_HOPPER_REFUSAL = "3.7.1"  # fla-core 0.6.0: gated chunk backward refused on Hopper with Triton 3.4 - 3.7.0
_warned_fallback = False


def _fla_chunk(q, k, v, g, beta, h0, cu, scale):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
    )


_FLA_FORWARDS = {"recurrent": _fla_recurrent, "chunk": _fla_chunk}


def _recompute_grads(fn, q, k, v, g, beta, h0, cu, scale, do, dht):
    """Gradients of (o, final state) w.r.t. (q, k, v, g, beta, h0), recomputing the forward with ``fn``."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
        o, ht = fn(*leaves, cu, scale)
    return _graph_grads(leaves, o, ht, do, dht)


def _graph_grads(leaves, o, ht, do, dht):
    """Gradients of a forward's (o, final state) w.r.t. its ``leaves``, through its autograd graph."""
    outs, grads = [o], [do]
    if dht is not None:
        outs.append(ht)
        grads.append(dht)
    return torch.autograd.grad(outs, leaves, grads, allow_unused=True)


def _warn_fallback(e: Exception) -> None:
    """Where fla-core refuses its chunked backward (Hopper, Triton < 3.7.1, no tilelang), the backward runs
    :func:`gdn_torch_varlen` (same math, slower); say so once."""
    global _warned_fallback
    if not _warned_fallback:
        import logging

        logging.getLogger("vllm_bi").warning(
            "vllm_bi: fla-core refuses its chunked GDN backward here (%s); using the torch recurrence for "
            "the backward instead (same math, slower). Install tilelang or Triton >= 3.7.1 for the fast one.",
            str(e).splitlines()[0][:160])
        _warned_fallback = True


def gdn_torch_varlen(q, k, v, g, beta, h0, cu, scale):
    """The gated delta rule in differentiable torch ops, fla-core's layout and conventions.

    ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g, beta [1, T, HV]`` (fp32; ``g`` may be ``[1, T, HV, K]``, a
    decay per key channel), ``h0 [N, HV, K, V]`` fp32,
    ``cu`` cumulative sequence lengths (tensor); l2norm of q and k inside, as fla's
    ``use_qk_l2norm_in_kernel``. Computes in fp32 (float64 inputs stay float64) and returns
    ``(o [1, T, HV, V] in v's dtype, final states [N, HV, K, V])``. Token by token: for backward
    recomputation (and tests), not for speed.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    H, HV = q.shape[2], v.shape[2]
    qn, kn = (x[0].to(acc) * torch.rsqrt((x[0].to(acc) ** 2).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    qn = (qn * scale).repeat_interleave(HV // H, dim=1)
    kn = kn.repeat_interleave(HV // H, dim=1)
    vv, gg, bb = v[0].to(acc), g[0].to(acc), beta[0].to(acc)
    bounds = [int(x) for x in cu.tolist()]
    outs, finals = [], []
    for i in range(len(bounds) - 1):
        S = h0[i].to(acc)  # [HV, K, V]
        for t in range(bounds[i], bounds[i + 1]):
            S = S * (torch.exp(gg[t])[:, None, None] if gg.dim() == 2 else torch.exp(gg[t])[:, :, None])
            u = (vv[t] - torch.einsum("hkv,hk->hv", S, kn[t])) * bb[t][:, None]
            S = S + kn[t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, qn[t]))
        finals.append(S)
    return torch.stack(outs).to(v.dtype).unsqueeze(0), torch.stack(finals)


def gdn_recurrent_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: list[int],
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]`` (``g`` may be ``[T, HV, K]``, a
    decay per key channel), ``states [N, HV, V, K]`` fp32.

    Returns ``(o [T, HV, V], final states [N, HV, V, K] fp32)``. ``o`` is fp32 on CPU and
    ``v.dtype`` on CUDA. Every sequence starts from its explicit state (zeros for a new one).
    """
    if states is None or states.dtype != torch.float32:
        raise ValueError("gdn_recurrent_varlen needs explicit fp32 states (zeros for new sequences)")
    cu = [int(x) for x in cu_seqlens]
    if q.is_cuda:
        K = q.shape[-1]
        scale = K**-0.5 if scale is None else scale
        cu_t = index_on(cu, q.device)
        h0 = states.transpose(-1, -2).contiguous()  # fla-core keeps [N, HV, K, V]
        o, ht = FLAGatedDeltaRule.apply(
            "recurrent", q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0), h0, cu_t, scale
        )
        return o[0], ht.transpose(-1, -2)
    outs, finals = [], []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        o, st = gdn_recurrent(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], states[i], scale)
        outs.append(o)
        finals.append(st)
    return torch.cat(outs), torch.stack(finals)
