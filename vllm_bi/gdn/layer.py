"""The GDN layer's core for a packed batch: the short causal conv, the q/k/v split, the gating, then one of the
two recurrences (recurrent, chunk-aligned), chosen by ``mode``.

:func:`gdn_varlen` is the one public entry the server's glue (``model_executor/gdn.py``) and the trainer's model
(``models/qwen_gdn.py``) both call; :func:`gdn_sequence` is its one-sequence definition (``tests/ops/test_gdn_varlen.py``
holds them equal).
"""

from __future__ import annotations

import functools

import torch

from vllm_bi.gdn.chunk import gdn_chunk_varlen
from vllm_bi.gdn.chunk_decode import chunk_in_slots, padded_blocks_in_slots
from vllm_bi.gdn.recurrent import gdn_gating, gdn_recurrent, gdn_recurrent_varlen, kda_gating
from vllm_bi.gdn.slots import recurrent_in_slots
from vllm_bi.ops import pointwise
from vllm_bi.ops.device import host_to, index_on, kept, rows_of

__all__ = ["causal_conv1d", "causal_conv1d_varlen", "gdn_sequence", "gdn_varlen", "RingRows", "MODES", "GATINGS",
           "gates"]

MODES = ("recurrent", "chunk")
# the gate of the recurrence: GDN's decay per head (Qwen3-Next, Qwen3.5), or Kimi Delta Attention's per key channel
GATINGS = ("gdn", "kda")


def gates(gating: str, A_log, a, b, dt_bias, lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` fp32 for the recurrence. ``gdn``: ``a, b [T, HV]`` (:func:`~vllm_bi.gdn.recurrent.gdn_gating`).
    ``kda``: ``a [T, H, K]`` the forget-gate projection per key channel, ``b [T, H]`` the raw beta, ``dt_bias [H*K]``
    and the checkpoint's ``lower_bound`` (:func:`~vllm_bi.gdn.recurrent.kda_gating`); ``g`` is then ``[T, H, K]``."""
    if gating == "gdn":
        return gdn_gating(A_log, a, b, dt_bias)
    if gating == "kda":
        return kda_gating(A_log, a, b, dt_bias, lower_bound)
    raise ValueError(f"gating {gating!r}: choose one of {', '.join(GATINGS)}")


def _check_kda(gating: str, device: torch.device, mode: str) -> None:
    """Kimi Delta Attention's per-channel gate runs in the recurrent and chunk modes on CPU, and in the recurrent
    mode on CUDA (fla-core's ``gk`` arithmetic: :mod:`vllm_bi.gdn.recurrent`, :mod:`vllm_bi.gdn.slots`); the chunk
    mode on CUDA and any other device are refused by name."""
    if gating != "kda" or device.type == "cpu":
        return
    if device.type != "cuda":
        raise NotImplementedError(f"Kimi Delta Attention's batch-invariant core runs on CPU and CUDA only (got "
                                  f"{device.type}): serve the model without VLLM_BATCH_INVARIANT=1")
    if mode != "recurrent":
        raise NotImplementedError(f"Kimi Delta Attention on CUDA runs in the recurrent GDN mode only (got {mode!r}): "
                                  "set VLLM_BI_GDN_MODE=recurrent")


_INDEX_CACHE = 64


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence, continuing from ``conv_state``: :func:`causal_conv1d_varlen`
    with one sequence. ``x: [T, D]``, ``weight: [D, W]``, ``conv_state: [W-1, D]``; returns
    ``(y [T, D], new_state [W-1, D])``."""
    y, st = causal_conv1d_varlen(x, [0, x.shape[0]], weight, conv_state.unsqueeze(0), activation)
    return y, st[0]


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


def _token_layout(cu_seqlens: tuple[int, ...]):
    """One batch layout on the host: ``cu``, each sequence's length, each token's sequence and its position in it."""
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return cu, lens, seq, torch.arange(int(cu[-1])) - cu[seq]


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _conv_index(cu_seqlens: tuple[int, ...], W: int, device: str):
    """The conv's indices for one batch layout (built once, shared, read only), on ``device``: the rows of the
    new conv states (from x, from the old state, which of the two), then on CUDA the Triton kernel's per-token
    sequence and position and per-sequence start and length, elsewhere the torch path's rows of
    ``[all conv states; x]`` for every tap (``_conv_torch``)."""
    cu, lens, seq, pos = _token_layout(cu_seqlens)
    N, T = len(lens), int(cu[-1])
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


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _slot_conv_index(cu_seqlens: tuple[int, ...], device: str):
    """:func:`vllm_bi.ops.conv.slot_causal_conv1d`'s indices for one batch layout (built once, shared, read only), on
    ``device``: each token's sequence and position, each sequence's first row and length."""
    cu, lens, seq, pos = _token_layout(cu_seqlens)
    host = [seq, pos, cu[:-1], lens]
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
    gating: str = "gdn",
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence through the GDN core: short conv, q/k/v split, gating, recurrence.

    The per-sequence definition that :func:`gdn_varlen` (what the server's ``model_executor/gdn.py``
    and the trainer's ``models/qwen_gdn.py`` call) must reproduce exactly (``tests/ops/test_gdn_varlen.py``). ``mixed_qkv [T, 2*Hk*K + HV*V]`` (model
    dtype), ``conv_weight [D, W]``, ``conv_state [W-1, D]``, ``a, b [T, HV]``, ``state [HV, V, K]``
    fp32. Returns ``(o [T, HV, V] fp32, new conv state, new fp32 state)``. ``gating="kda"``: Kimi Delta Attention's
    gate (:func:`gates`: ``a [T, H, K]``, ``b [T, H]``, ``lower_bound``), recurrent arithmetic (CPU, CUDA).
    """
    _check_kda(gating, mixed_qkv.device, "recurrent")
    T = mixed_qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    x, new_conv_state = causal_conv1d(mixed_qkv, conv_weight, conv_state, activation)
    q = x[:, :key_dim].reshape(T, num_k_heads, head_k_dim)
    k = x[:, key_dim : 2 * key_dim].reshape(T, num_k_heads, head_k_dim)
    v = x[:, 2 * key_dim :].reshape(T, -1, head_v_dim)
    g, beta = gates(gating, A_log, a, b, dt_bias, lower_bound)
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


class SlotRows:
    """The conv's input rows of a server step with every conv state read from, and the new ones written back into,
    vLLM's conv cache slots (CUDA, the recurrent mode; :func:`vllm_bi.ops.conv.slot_causal_conv1d`): ``x [T, D]``
    the step's rows (a column slice of the projection, read where it lies), ``cache [S, W-1, D]`` (``[S, D, W-1]``
    with ``dim_first``). The slots and new-request flags are :func:`gdn_varlen`'s ``slots`` and ``fresh``, the
    states' own."""

    def __init__(self, x: torch.Tensor, cache: torch.Tensor, dim_first: bool):
        self.x, self.cache, self.dim_first = x, cache, dim_first


def gdn_varlen(
    mixed_qkv: torch.Tensor | RingRows | SlotRows,
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
    slots: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    gating: str = "gdn",
    lower_bound: float | None = None,
    spec_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Several sequences through the GDN core at once: :func:`gdn_sequence` for a packed batch.

    ``mode="chunk"``: the recurrence is :func:`vllm_bi.gdn.chunk.gdn_chunk_varlen` instead
    (each sequence's first row must sit at a block boundary and ``states`` are the boundary states);
    the returned states are then the states at each sequence's last boundary.

    Sequence ``j`` owns rows ``ranges[j] = (s, e)`` of ``mixed_qkv``, ``a`` and ``b``;
    ``conv_states [N, W-1, D]`` and fp32 ``states [N, HV, V, K]`` are where each one starts
    (zeros for a new sequence). The conv and the gating are elementwise per token and the
    recurrence is :func:`gdn_recurrent_varlen`, so no sequence's numbers depend on the others.
    ``mixed_qkv`` may be :class:`RingRows` (no autograd; the sequences packed in order; ``conv_states`` unused),
    and the new conv states are then None on CUDA. ``mixed_qkv`` may be :class:`SlotRows` (the recurrent mode with
    ``slots``, CUDA, no autograd, the sequences packed in order): the conv states are read in and written back into
    their cache slots, ``conv_states`` is unused and the new conv states are None.
    Returns ``(outputs per sequence [e-s, HV, V], new conv states [N, W-1, D], new fp32 states)``; with
    ``packed=True`` the outputs are one tensor ``[sum(e-s), HV, V]``, the sequences in order. Under autograd
    take the packed form: each per-sequence slice costs the backward a zero tensor of the whole output's size
    (at 64 x 1K tokens that doubled a layer's training time on the H200).

    ``slots`` (CUDA, the server's step): ``states`` is then vLLM's whole state pool seen in fla-core's order
    ``[S, HV, K, V]`` fp32 and sequence ``j`` starts from slot ``slots[j]``; the returned states are None.
    Recurrent mode: ``fresh`` is an int32 device flag per sequence (nonzero: from zeros), and the final state is
    written back into the slot in place (:func:`vllm_bi.gdn.slots.recurrent_in_slots`, fla-core's
    fused recurrent arithmetic); with ``spec_slots [N, P]`` (a speculative step's slot table) the state after the
    ``p``-th row of sequence ``j`` goes into slot ``spec_slots[j, p]`` instead (the bits of one row per call).
    Chunk mode: ``fresh`` holds the host indices of the new sequences, and the
    state at each sequence's last boundary is written back where that boundary moved
    (:func:`vllm_bi.gdn.chunk_decode.chunk_in_slots`). Chunk mode with ``lens`` (device, one per sequence): every
    range is one block padded to ``CHUNK`` rows, of which the first ``lens[j]`` are the sequence's
    (:func:`vllm_bi.gdn.chunk_decode.padded_blocks_in_slots`: nothing read on the host; rows past ``lens`` are not
    written).

    ``out [T, HV, V]`` (the recurrent mode with ``slots``; contiguous, ``v``'s dtype): the packed output is
    written there and returned, rather than into a new tensor.

    ``gating="kda"`` (with ``lower_bound``): Kimi Delta Attention's per-channel gate (:func:`gates`); the recurrent
    and chunk modes on CPU, the recurrent mode on CUDA, anything else refused by name.
    """
    _check_kda(gating, conv_weight.device, mode)
    key_dim = num_k_heads * head_k_dim
    cu = [0]
    for s, e in ranges:
        cu.append(cu[-1] + (e - s))
    ring = mixed_qkv if isinstance(mixed_qkv, RingRows) else None
    slotted = mixed_qkv if isinstance(mixed_qkv, SlotRows) else None
    if slotted is not None:
        if slots is None or mode != "recurrent" or spec_slots is not None:
            raise ValueError("gdn_varlen: SlotRows need the recurrent mode's slots (and no spec_slots)")
        if torch.is_grad_enabled() and conv_weight.requires_grad:
            raise RuntimeError("gdn_varlen: SlotRows (the server's conv in its cache slots) has no backward; the "
                               "trainer passes its mixed_qkv rows as a tensor")
        mixed_qkv = slotted.x
    if out is not None and (slots is None or mode != "recurrent"):
        raise ValueError("gdn_varlen: out is the recurrent mode's with slots")
    if ring is not None and torch.is_grad_enabled() and conv_weight.requires_grad:
        raise RuntimeError("gdn_varlen: RingRows (the server's decode conv) has no backward; the trainer passes "
                           "its mixed_qkv rows as a tensor")
    if ring is not None and not ring.src.is_cuda:  # CPU: the rows gathered out of the ring, then the plain conv
        mixed_qkv, conv_states = ring.gather(conv_weight.shape, cu)
        ring = None
    if all(ranges[j][1] == ranges[j + 1][0] for j in range(len(ranges) - 1)):  # packed in order: views
        x_in = None if ring is not None else mixed_qkv[ranges[0][0] : ranges[-1][1]]
        a, b = (t[ranges[0][0] : ranges[-1][1]] for t in (a, b))
    elif ring is not None or slotted is not None:
        raise ValueError("gdn_varlen: RingRows and SlotRows need the sequences packed in order")
    else:
        rows = rows_of(ranges, a.device)
        x_in, a, b = mixed_qkv[rows], a[rows], b[rows]
    if ring is not None:  # CUDA: one kernel reads the rows in the ring and writes q, k, v apart
        from vllm_bi.ops.conv import ring_causal_conv1d

        q, k, v = ring_causal_conv1d(ring.src, ring.ext, ring.seq, conv_weight, activation is not None, key_dim)
        new_conv, T = None, q.shape[0]
        q, k, v = q.view(T, num_k_heads, head_k_dim), k.view(T, num_k_heads, head_k_dim), v.view(T, -1, head_v_dim)
    elif slotted is not None:  # the conv states in their slots, q, k and v written apart
        from vllm_bi.ops.conv import slot_causal_conv1d

        seq, pos, starts, lens = (kept(t) for t in _slot_conv_index(tuple(cu), str(x_in.device)))
        q, k, v = slot_causal_conv1d(x_in, conv_weight, slotted.cache, slotted.dim_first, slots, fresh, seq, pos,
                                     starts, lens, activation is not None, key_dim)
        new_conv, T = None, q.shape[0]
        q, k, v = q.view(T, num_k_heads, head_k_dim), k.view(T, num_k_heads, head_k_dim), v.view(T, -1, head_v_dim)
    else:
        x, new_conv = causal_conv1d_varlen(x_in, cu, conv_weight, conv_states, activation)
        T = x.shape[0]
        q = x[:, :key_dim].reshape(T, num_k_heads, head_k_dim).contiguous()
        k = x[:, key_dim : 2 * key_dim].reshape(T, num_k_heads, head_k_dim).contiguous()
        v = x[:, 2 * key_dim :].reshape(T, -1, head_v_dim).contiguous()
    g, beta = gates(gating, A_log, a, b, dt_bias, lower_bound)
    if spec_slots is not None and (slots is None or mode != "recurrent"):
        raise ValueError("gdn_varlen: spec_slots need slots and the recurrent mode")
    if slots is not None:
        if mode == "recurrent":
            o = recurrent_in_slots(q, k, v, g, beta, states, slots, index_on(cu, q.device), head_k_dim**-0.5,
                                   fresh, spec_slots=spec_slots, out=out)
        elif mode == "chunk" and lens is not None:
            o = padded_blocks_in_slots(q, k, v, g.contiguous(), beta.contiguous(), states, slots, lens,
                                       head_k_dim**-0.5)
        elif mode == "chunk":
            o = chunk_in_slots(q, k, v, g.contiguous(), beta.contiguous(), states, slots, cu,
                               () if fresh is None else fresh)
        else:
            raise ValueError(f"gdn_varlen: states in slots need the recurrent or chunk mode, not {mode!r}")
        return (o if packed else [o[cu[j] : cu[j + 1]] for j in range(len(ranges))]), new_conv, None
    if mode == "chunk":
        core = gdn_chunk_varlen
    elif mode == "recurrent":
        core = gdn_recurrent_varlen
    else:
        raise ValueError(f"GDN mode {mode!r}: choose 'recurrent' or 'chunk'")
    if not states.is_cuda:
        # the torch cores' matmuls pick their kernels (and so their bits) by the state's strides: one
        # layout, whatever memory the caller's states sit in (CUDA's fla-core path makes its own copy)
        states = states.contiguous()
    o, finals = core(q, k, v, g.contiguous(), beta.contiguous(), states, cu)
    if packed:
        return o, new_conv, finals
    return [o[cu[j] : cu[j + 1]] for j in range(len(ranges))], new_conv, finals
