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

import functools

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.reduce import row_sum

__all__ = [
    "gdn_gating", "l2norm", "gdn_recurrent", "gdn_recurrent_varlen", "gdn_torch_varlen", "causal_conv1d",
    "causal_conv1d_varlen", "rows_of", "host_to", "index_on",
    "gdn_sequence", "gdn_varlen", "RingRows",
]

L2NORM_EPS = 1e-6


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; both fp32 ``[T, HV]``."""
    g = -pointwise.exp(A_log.float()) * pointwise.softplus(a.float() + dt_bias.float())
    beta = pointwise.sigmoid(b.float())
    return g, beta


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

    ``q`` and ``k`` are raw (l2-normalised here). ``state`` is not modified.
    """
    if q.device.type != "cpu":
        raise NotImplementedError(
            "vllm_bi.attention.gdn_recurrent: only the CPU implementation exists in this release"
        )
    qn, kn = heads_qk(q, k, v, state, scale, "gdn_recurrent")
    T, HV, V = v.shape
    v32 = v.float()
    decay = pointwise.exp(g.float())
    beta = beta.float()
    S = state.clone()
    out = torch.empty((T, HV, V), dtype=torch.float32)
    for t in range(T):
        k_t = kn[t].unsqueeze(1)  # [HV, 1, K]
        S = S * decay[t].view(HV, 1, 1)
        kv = row_sum(S * k_t).squeeze(-1)  # [HV, V]
        delta = (v32[t] - kv) * beta[t].view(HV, 1)
        S = S + delta.unsqueeze(-1) * k_t
        out[t] = row_sum(S * qn[t].unsqueeze(1)).squeeze(-1)
    return out, S


class FLAGatedDeltaRule(torch.autograd.Function):
    """A fla-core forward with a backward that works on every GPU.

    Forward: ``kind="recurrent"`` is fla-core's fused recurrent kernel (vllm_bi's recurrent mode),
    ``kind="chunk"`` its chunked kernel (the chunk-aligned mode; callers pin its configs,
    :func:`vllm_bi.attention.gdn_chunk.pin_fla_chunk_configs`). fla-core layout: ``q, k [1, T, H, K]``,
    ``v [1, T, HV, V]``, ``g, beta [1, T, HV]``, ``h0 [N, HV, K, V]`` fp32, ``cu`` a LongTensor; l2norm of q
    and k in the kernel. Returns ``(o, final states)``.

    Backward: fla-core's chunked backward. ``kind="chunk"`` keeps the forward's own autograd graph (fla-core's
    forward is the same computation with or without gradients, so the bits are the server's) and differentiates
    it; ``kind="recurrent"`` recomputes the forward with the chunked kernel first. Where fla-core refuses its
    chunked backward (Hopper with Triton < 3.7.1 and no tilelang), the same math in torch
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
            else:
                grads = _recompute_grads(_FLA_FORWARDS["chunk"], q, k, v, g, beta, h0, cu, ctx.scale, do, dht)
        except RuntimeError as e:
            if _HOPPER_REFUSAL not in str(e):
                raise
            _warn_fallback(e)
            grads = _recompute_grads(gdn_torch_varlen, q, k, v, g, beta, h0, cu, ctx.scale, do, dht)
        return (None, *grads, None, None)


def _fla_recurrent(q, k, v, g, beta, h0, cu, scale):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
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

    ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g, beta [1, T, HV]`` (fp32), ``h0 [N, HV, K, V]`` fp32,
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
            S = S * torch.exp(gg[t])[:, None, None]
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
    """Packed sequences: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``, ``states [N, HV, V, K]`` fp32.

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


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence, continuing from ``conv_state``: :func:`causal_conv1d_varlen`
    with one sequence. ``x: [T, D]``, ``weight: [D, W]``, ``conv_state: [W-1, D]``; returns
    ``(y [T, D], new_state [W-1, D])``."""
    y, st = causal_conv1d_varlen(x, [0, x.shape[0]], weight, conv_state.unsqueeze(0), activation)
    return y, st[0]


def host_to(t: torch.Tensor, device) -> torch.Tensor:
    """A host-built (index) tensor on ``device``. On CUDA it goes through pinned memory without blocking: a
    copy from pageable memory makes PyTorch synchronise the stream, which stops the host from queueing work
    ahead of the GPU (the GDN core makes several such copies per layer). Values are copied, never computed."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    pinned = t.pin_memory()
    out = pinned.to(device, non_blocking=True)
    if torch.cuda.is_current_stream_capturing():  # the graph replays this copy: its source must stay
        _CAPTURED.append(pinned)
    return out


def step_cached(md, key: str, dev, build):
    """``build()`` once per scheduler step: kept on the step's metadata object ``md`` (under ``key``, for ``dev``),
    which all layers of the step share, so the host reads the scheduler's device tensors once per step (each
    read synchronises the stream)."""
    cached = getattr(md, key, None)
    if cached is not None and cached[0] == dev:
        return cached[1]
    value = build()
    try:
        setattr(md, key, (dev, value))
    except AttributeError:  # a metadata class with __slots__: built per layer
        pass
    return value


# Tensors a captured CUDA graph reads (index tensors from the caches below, pinned sources of captured copies):
# a graph replays by address, so they must outlive the caches' evictions. Kept for the process's life.
_CAPTURED: list[torch.Tensor] = []


def kept(t: torch.Tensor) -> torch.Tensor:
    """``t``, kept alive for the process's life when a CUDA graph is being captured (it may read ``t``)."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        _CAPTURED.append(t)
    return t


# Index tensors are pure functions of the batch layout, which is the same for every GDN layer of a step (and
# often of the next step): they are built and copied once and then reused. Callers only read them.
_INDEX_CACHE = 64


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _index_on(values: tuple[int, ...], device: str) -> torch.Tensor:
    return host_to(torch.tensor(values, dtype=torch.long), device)


def index_on(values, device) -> torch.Tensor:
    """A short index vector (offsets, sequence ids) on ``device``, built once per distinct content (shared:
    read only)."""
    return kept(_index_on(tuple(int(v) for v in values), str(torch.device(device))))


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _rows_of(ranges: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    lens = torch.tensor([e - s for s, e in ranges], dtype=torch.long)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.long)
    offsets = lens.cumsum(0) - lens
    rows = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - offsets, lens)
    return host_to(rows, device)


def rows_of(ranges: list[tuple[int, int]], device) -> torch.Tensor:
    """The row indices ``s..e-1`` of every range, concatenated (built and copied once per distinct layout;
    shared: read only)."""
    return kept(_rows_of(tuple((int(s), int(e)) for s, e in ranges), str(torch.device(device))))


def causal_conv1d_varlen(
    x: torch.Tensor,
    cu_seqlens: list[int],
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of packed sequences, each continuing from its conv state.

    ``x: [T, D]`` (model dtype), sequence ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``; ``weight: [D, W]``;
    ``conv_states: [N, W-1, D]`` (each sequence's previous W-1 raw inputs, zeros for a new one). With
    ``ext_j = [conv_state_j; x_j]``, each output is ``act(sum_w weight[:, w] * ext_j[t + w])`` accumulated in
    fp32 in the fixed order w = 0..W-1, rounded to x.dtype: elementwise per token, so no sequence's numbers
    depend on the others. CPU: every tap is one gather over the packed batch (no per-sequence loop). CUDA: one
    Triton kernel (:mod:`vllm_bi.ops.conv`, with a Triton backward). The host builds every index once and
    sends it in one copy.
    Returns ``(y [T, D], new conv states [N, W-1, D])`` (the last W-1 rows of each ``ext_j``).
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")
    W = weight.shape[-1]
    N = len(cu_seqlens) - 1
    T, D = x.shape
    dev = tuple(kept(t) for t in _conv_index(tuple(int(c) for c in cu_seqlens), W, str(x.device)))
    states_x = conv_states.to(x.dtype).reshape(N * (W - 1), D)
    old = states_x[dev[1]]
    new_states = (torch.where(dev[2].bool()[:, None], x[dev[0]], old) if T else old).reshape(N, W - 1, D)

    if x.is_cuda:
        from vllm_bi.ops.conv import CausalConv1dTriton

        y = CausalConv1dTriton.apply(x, weight, conv_states, *dev[3:], activation is not None)
    else:
        y = _conv_torch(x, weight, conv_states, dev[3], activation)
    return y, new_states


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _conv_index(cu_seqlens: tuple[int, ...], W: int, device: str):
    """The conv's indices for one batch layout (built once, shared, read only), on ``device``: the rows of the
    new conv states (from x, from the old state, which of the two), then on CUDA the Triton kernel's per-token
    sequence and position and per-sequence start and length, elsewhere the torch path's rows of
    ``[all conv states; x]`` for every tap (``_conv_torch``)."""
    N = len(cu_seqlens) - 1
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    T = int(cu[-1])
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(N), lens)
    pos = torch.arange(T) - cu[seq]  # position of each token in its sequence
    # new state row r of sequence j is ext_j[len_j + r]: x_j[i] with i = len_j + r - (W-1) when i >= 0, else
    # conv_state_j[len_j + r]
    jj = torch.arange(N).repeat_interleave(W - 1)
    e = lens[jj] + torch.arange(W - 1).repeat(N)
    in_x = e >= W - 1
    x_row = (cu[jj] + e - (W - 1)).clamp(0, max(T - 1, 0))
    st_row = jj * (W - 1) + e.clamp(max=W - 2)
    if device.startswith("cuda"):
        host = [x_row, st_row, in_x.long(), seq, pos, cu[:-1], lens]
    else:
        # src = [all conv states; x]; ext_j[i] is src[j*(W-1) + i] for i < W-1, else src[N*(W-1) + cu_j + i - (W-1)]
        i = torch.cat([pos + w for w in range(W)])
        j = seq.repeat(W)
        host = [x_row, st_row, in_x.long(), torch.where(i < W - 1, j * (W - 1) + i, N * (W - 1) + cu[j] + i - (W - 1))]
    return host_to(torch.cat(host), device).split([h.numel() for h in host])


def _conv_torch(x, weight, conv_states, idx, activation):
    """The conv of :func:`causal_conv1d_varlen` in differentiable torch ops: one gather per tap from
    ``src = [all conv states; x]``, rows ``idx`` (tap w's rows at ``w*T .. (w+1)*T``, from ``_conv_index``)."""
    W = weight.shape[-1]
    N = conv_states.shape[0]
    T, D = x.shape
    src = torch.cat([conv_states.to(x.dtype).reshape(N * (W - 1), D), x])
    xe = src.float()
    w32 = weight.float()
    acc = xe[idx[0:T]] * w32[:, 0]
    for w in range(1, W):
        acc = acc + xe[idx[w * T : (w + 1) * T]] * w32[:, w]
    if activation is not None:
        acc = pointwise.silu(acc)
    return acc.to(x.dtype)


def gdn_sequence(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence through the GDN core: short conv, q/k/v split, gating, recurrence.

    The per-sequence definition that :func:`gdn_varlen` (what the server's ``model_executor/gdn.py``
    and the trainer's ``models/hybrid.py`` call) must reproduce exactly (``tests/ops/test_gdn_varlen.py``). ``mixed_qkv [T, 2*Hk*K + HV*V]`` (model
    dtype), ``conv_weight [D, W]``, ``conv_state [W-1, D]``, ``a, b [T, HV]``, ``state [HV, V, K]``
    fp32. Returns ``(o [T, HV, V] fp32, new conv state, new fp32 state)``.
    """
    T = mixed_qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    x, new_conv_state = causal_conv1d(mixed_qkv, conv_weight, conv_state, activation)
    q = x[:, :key_dim].reshape(T, num_k_heads, head_k_dim)
    k = x[:, key_dim : 2 * key_dim].reshape(T, num_k_heads, head_k_dim)
    v = x[:, 2 * key_dim :].reshape(T, -1, head_v_dim)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    o, new_state = gdn_recurrent(q, k, v, g, beta, state)
    return o, new_conv_state, new_state


class RingRows:
    """The conv's input rows of a step, read where they lie in the chunk mode's history ring (its decode steps,
    ``model_executor/gdn.py``) instead of gathered first: ``src [S, R, C]`` the ring (any strides; the conv reads
    its first ``D`` columns), ``seq [T]`` each token's sequence (device), and ``ext``: for each sequence, in order,
    its ``W - 1`` conv-state rows then its tokens' rows, each ``slot * R + row`` of ``src`` or ``-1`` for a zero
    row (:func:`vllm_bi.ops.conv.ring_causal_conv1d`). CUDA reads them in the conv kernel; elsewhere
    :meth:`gather` builds the plain conv's inputs from the same indices."""

    def __init__(self, src: torch.Tensor, ext: torch.Tensor, seq: torch.Tensor):
        self.src, self.ext, self.seq = src, ext, seq

    def gather(self, weight_shape, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x [T, D], conv_states [N, W-1, D])`` for :func:`causal_conv1d_varlen`, sequences packed as ``cu``."""
        (D, W), R, dev = weight_shape, self.src.shape[1], self.src.device
        r = self.ext.clamp(min=0)
        rows = torch.where((self.ext >= 0)[:, None], self.src[r // R, r % R, :D], 0)
        N, T = len(cu) - 1, cu[-1]
        first = torch.tensor(cu[:-1], device=dev) + torch.arange(N, device=dev) * (W - 1)  # each one's entries
        conv = rows[first[:, None] + torch.arange(W - 1, device=dev)]
        return rows[torch.arange(T, device=dev) + self.seq * (W - 1) + (W - 1)], conv


def gdn_varlen(
    mixed_qkv: torch.Tensor | RingRows,
    ranges: list[tuple[int, int]],
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    activation: str | None = "silu",
    mode: str = "recurrent",
    packed: bool = False,
    chunk_rows: list[int] | None = None,
    slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Several sequences through the GDN core at once: :func:`gdn_sequence` for a packed batch.

    ``mode="chunk"``: the recurrence is :func:`vllm_bi.attention.gdn_chunk.gdn_chunk_varlen` instead
    (each sequence's first row must sit at a block boundary and ``states`` are the boundary states);
    the returned states are then the states at each sequence's last boundary. ``mode="hybrid"``: each
    sequence's first ``chunk_rows[j]`` rows run in the chunk arithmetic and the rest in the recurrence
    (:func:`vllm_bi.attention.gdn_chunk.gdn_hybrid_varlen`, which says which state comes back).

    Sequence ``j`` owns rows ``ranges[j] = (s, e)`` of ``mixed_qkv``, ``a`` and ``b``;
    ``conv_states [N, W-1, D]`` and fp32 ``states [N, HV, V, K]`` are where each one starts
    (zeros for a new sequence). The conv and the gating are elementwise per token and the
    recurrence is :func:`gdn_recurrent_varlen`, so no sequence's numbers depend on the others.
    ``mixed_qkv`` may be :class:`RingRows` (no autograd; the sequences packed in order; ``conv_states`` unused),
    and the new conv states are then None on CUDA.
    Returns ``(outputs per sequence [e-s, HV, V], new conv states [N, W-1, D], new fp32 states)``; with
    ``packed=True`` the outputs are one tensor ``[sum(e-s), HV, V]``, the sequences in order. Under autograd
    take the packed form: each per-sequence slice costs the backward a zero tensor of the whole output's size
    (at 64 x 1K tokens that doubled a layer's training time on the H200).

    ``slots`` (CUDA, the server's step): ``states`` is then vLLM's whole state pool seen in fla-core's order
    ``[S, HV, K, V]`` fp32 and sequence ``j`` starts from slot ``slots[j]``; the returned states are None.
    Recurrent mode: ``fresh`` is an int32 device flag per sequence (nonzero: from zeros), and the final state is
    written back into the slot in place (:func:`vllm_bi.attention.gdn_slots.recurrent_in_slots`, fla-core's
    fused recurrent arithmetic). Chunk mode: ``fresh`` holds the host indices of the new sequences, and the
    state at each sequence's last boundary is written back where that boundary moved
    (:func:`vllm_bi.attention.gdn_chunk_decode.chunk_in_slots`).
    """
    key_dim = num_k_heads * head_k_dim
    cu = [0]
    for s, e in ranges:
        cu.append(cu[-1] + (e - s))
    ring = mixed_qkv if isinstance(mixed_qkv, RingRows) else None
    if ring is not None and torch.is_grad_enabled() and conv_weight.requires_grad:
        raise RuntimeError("gdn_varlen: RingRows (the server's decode conv) has no backward; the trainer passes "
                           "its mixed_qkv rows as a tensor")
    if ring is not None and not ring.src.is_cuda:  # CPU: the rows gathered out of the ring, then the plain conv
        mixed_qkv, conv_states = ring.gather(conv_weight.shape, cu)
        ring = None
    if all(ranges[j][1] == ranges[j + 1][0] for j in range(len(ranges) - 1)):  # packed in order: views
        x_in = None if ring is not None else mixed_qkv[ranges[0][0] : ranges[-1][1]]
        a, b = (t[ranges[0][0] : ranges[-1][1]] for t in (a, b))
    elif ring is not None:
        raise ValueError("gdn_varlen: RingRows need the sequences packed in order")
    else:
        rows = rows_of(ranges, a.device)
        x_in, a, b = mixed_qkv[rows], a[rows], b[rows]
    if ring is not None:  # CUDA: one kernel reads the rows in the ring and writes q, k, v apart
        from vllm_bi.ops.conv import ring_causal_conv1d

        q, k, v = ring_causal_conv1d(ring.src, ring.ext, ring.seq, conv_weight, activation is not None, key_dim)
        new_conv, T = None, q.shape[0]
        q, k, v = q.view(T, num_k_heads, head_k_dim), k.view(T, num_k_heads, head_k_dim), v.view(T, -1, head_v_dim)
    else:
        x, new_conv = causal_conv1d_varlen(x_in, cu, conv_weight, conv_states, activation)
        T = x.shape[0]
        q = x[:, :key_dim].reshape(T, num_k_heads, head_k_dim).contiguous()
        k = x[:, key_dim : 2 * key_dim].reshape(T, num_k_heads, head_k_dim).contiguous()
        v = x[:, 2 * key_dim :].reshape(T, -1, head_v_dim).contiguous()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    if slots is not None:
        if mode == "recurrent":
            from vllm_bi.attention.gdn_slots import recurrent_in_slots

            o = recurrent_in_slots(q, k, v, g, beta, states, slots, index_on(cu, q.device), head_k_dim**-0.5,
                                   fresh)
        elif mode == "chunk":
            from vllm_bi.attention.gdn_chunk_decode import chunk_in_slots

            o = chunk_in_slots(q, k, v, g.contiguous(), beta.contiguous(), states, slots, cu,
                               () if fresh is None else fresh)
        else:
            raise ValueError(f"gdn_varlen: states in slots need the recurrent or chunk mode, not {mode!r}")
        return (o if packed else [o[cu[j] : cu[j + 1]] for j in range(len(ranges))]), new_conv, None
    if mode == "chunk":
        from vllm_bi.attention.gdn_chunk import gdn_chunk_varlen as core
    elif mode == "recurrent":
        core = gdn_recurrent_varlen
    elif mode == "hybrid":
        from vllm_bi.attention.gdn_chunk import gdn_hybrid_varlen

        if chunk_rows is None:
            raise ValueError("GDN mode 'hybrid' needs chunk_rows (each sequence's rows in the chunk arithmetic)")

        def core(q, k, v, g, beta, states, cu):
            return gdn_hybrid_varlen(q, k, v, g, beta, states, cu, chunk_rows)
    else:
        raise ValueError(f"GDN mode {mode!r}: choose 'recurrent', 'chunk' or 'hybrid'")
    if not states.is_cuda:
        # the torch cores' matmuls pick their kernels (and so their bits) by the state's strides: one
        # layout, whatever memory the caller's states sit in (CUDA's fla-core path makes its own copy)
        states = states.contiguous()
    o, finals = core(q, k, v, g.contiguous(), beta.contiguous(), states, cu)
    if packed:
        return o, new_conv, finals
    return [o[cu[j] : cu[j + 1]] for j in range(len(ranges))], new_conv, finals
