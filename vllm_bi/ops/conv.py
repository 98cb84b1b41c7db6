"""The CUDA path of the GDN short convolution (:func:`vllm_bi.gdn.layer.causal_conv1d_varlen`):
one Triton kernel over the packed batch.

Each output element ``y[t, d] = act(sum_w weight[d, w] * ext_j[p + w])`` (``j`` the token's sequence, ``p``
its position in it, ``ext_j = [conv_state_j; x_j]``) is computed by one program from its own W inputs,
accumulated in fp32 in the fixed order w = 0..W-1: nothing is reduced across tokens or channels, and the
block sizes only decide which program computes an element, not how. So a token's output is the same whatever
it is packed with (``tests/gpu/test_gdn_conv_cuda.py`` measures it on the GPU; the kernel's logic is checked
on CPU through Triton's interpreter, ``tests/ops/test_gdn_conv_triton.py``).

Server and trainer both run this kernel on CUDA, so their bits agree; they need not equal the torch path's
(the compiler may contract a multiply and an add into one FMA). The backward is two Triton kernels as well
(``dz`` through SiLU with each token block's share of ``dweight``, then ``dx``): gradients need only be right,
not batch-invariant, and are checked against float64 autograd.

Measured on the H200 at Qwen3.5-9B GDN dimensions (8 x 8192 tokens, 8192 channels; ``benchmarks/profile_gdn.py``,
docs/results/2026-11-30-h200-gdn-cost.md): the torch path took 31.7 ms, this forward kernel 2.6 ms, fla-core's
conv kernel 1.05 ms.
"""

from __future__ import annotations

import torch

__all__ = ["triton_causal_conv1d", "triton_causal_conv1d_backward", "CausalConv1dTriton", "ring_causal_conv1d",
           "slot_causal_conv1d"]

BLOCK_T, BLOCK_D = 16, 256
# The ring conv's tiles (tokens, channels, warps): the fastest of benchmarks/decode_tiles.py's settings on the H200
# at 256 x 33 decode rows (0.192 ms against 0.230 ms with the plain conv's; every setting gave the same bits).
RING_BLOCKS = (4, 256, 4)

try:  # Triton is needed on CUDA (and by the interpreter tests on CPU); the CPU path never calls these
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - vllm pulls triton in
    triton = None

if triton is not None:

    @triton.jit
    def tap(x_ptr, st_ptr, j, p, s0, dd, m, D, w, W: tl.constexpr):
        # ext_j[p + w] as fp32: x_j[i] for i = p + w - (W-1) >= 0, else conv_state_j[(W-1) + i]
        i = p + (w - (W - 1))
        in_x = (i >= 0)[:, None]
        xv = tl.load(x_ptr + (s0 + i)[:, None] * D + dd, mask=m & in_x, other=0.0)
        sv = tl.load(st_ptr + (j * (W - 1) + (W - 1) + i)[:, None] * D + dd, mask=m & (~in_x), other=0.0)
        return tl.where(in_x, xv, sv.to(xv.dtype)).to(tl.float32)

    @triton.jit
    def wtap(w_ptr, d, md, w, W: tl.constexpr):
        # weight[d, w] as fp32
        return tl.load(w_ptr + d.to(tl.int64) * W + w, mask=md, other=0.0).to(tl.float32)

    @triton.jit
    def act(acc, SILU: tl.constexpr):
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        return acc

    @triton.jit
    def rows(seq_ptr, pos_ptr, start_ptr, T, D, BT: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        mt, md = t < T, d < D
        j = tl.load(seq_ptr + t, mask=mt, other=0).to(tl.int64)
        p = tl.load(pos_ptr + t, mask=mt, other=0).to(tl.int64)
        s0 = tl.load(start_ptr + j, mask=mt, other=0).to(tl.int64)
        return t, d, mt, md, j, p, s0, d.to(tl.int64)[None, :], mt[:, None] & md[None, :]

    @triton.jit
    def causal_conv1d_kernel(x_ptr, w_ptr, st_ptr, seq_ptr, pos_ptr, start_ptr, y_ptr, T, D,
                             W: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        t, d, mt, md, j, p, s0, dd, m = rows(seq_ptr, pos_ptr, start_ptr, T, D, BT, BD)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for w in tl.static_range(W):
            wv = wtap(w_ptr, d, md, w, W)
            acc += tap(x_ptr, st_ptr, j, p, s0, dd, m, D, w, W) * wv[None, :]
        acc = act(acc, SILU)
        tl.store(y_ptr + t.to(tl.int64)[:, None] * D + dd, acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def store_qkv(q_ptr, k_ptr, v_ptr, t, dd, m, y, D, KD: tl.constexpr):
        # the conv's output columns [0, KD), [KD, 2KD) and [2KD, D) into q, k and v, each contiguous
        y = y.to(q_ptr.dtype.element_ty)
        tt = t.to(tl.int64)[:, None]
        tl.store(q_ptr + tt * KD + dd, y, mask=m & (dd < KD))
        tl.store(k_ptr + tt * KD + (dd - KD), y, mask=m & (dd >= KD) & (dd < 2 * KD))
        tl.store(v_ptr + tt * (D - 2 * KD) + (dd - 2 * KD), y, mask=m & (dd >= 2 * KD))

    @triton.jit
    def causal_conv1d_ring_kernel(src_ptr, ext_ptr, w_ptr, seq_ptr, q_ptr, k_ptr, v_ptr, T, D, R, s_slot, s_row,
                                  s_col, KD: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
                                  BD: tl.constexpr):
        # causal_conv1d_kernel's arithmetic, its inputs read where they lie: token t of sequence j takes its W
        # taps from ext entries t + j*(W-1) + w, each a row slot*R + row of src (or -1: a zero row); the output
        # columns [0, KD), [KD, 2KD) and [2KD, D) go to q, k and v, each contiguous
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        mt, md = t < T, d < D
        j = tl.load(seq_ptr + t, mask=mt, other=0).to(tl.int64)
        e = t.to(tl.int64) + j * (W - 1)
        dd = d.to(tl.int64)[None, :]
        m = mt[:, None] & md[None, :]
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for w in tl.static_range(W):
            wv = wtap(w_ptr, d, md, w, W)
            r = tl.load(ext_ptr + e + w, mask=mt, other=-1)
            at = (r // R) * s_slot + (r % R) * s_row
            xv = tl.load(src_ptr + at[:, None] + dd * s_col, mask=m & (r >= 0)[:, None], other=0.0)
            acc += xv.to(tl.float32) * wv[None, :]
        store_qkv(q_ptr, k_ptr, v_ptr, t, dd, m, act(acc, SILU), D, KD)

    @triton.jit
    def slot_tap(x_ptr, sx, cache_ptr, base, keep, c_row, c_col, p, s0, dd, m, w, W: tl.constexpr):
        # tap's ext_j[p + w] with x_j's rows in x (row stride sx) and conv_state_j's rows in its cache slot (base: the
        # slot's offset per token); a new request's (keep false) read as zeros
        i = p + (w - (W - 1))
        in_x = (i >= 0)[:, None]
        xv = tl.load(x_ptr + (s0 + i)[:, None] * sx + dd, mask=m & in_x, other=0.0)
        sv = tl.load(cache_ptr + base[:, None] + ((W - 1) + i)[:, None] * c_row + dd * c_col,
                     mask=m & (~in_x) & keep[:, None], other=0.0)
        return tl.where(in_x, xv, sv.to(xv.dtype)).to(tl.float32)

    @triton.jit
    def causal_conv1d_slots_kernel(x_ptr, sx, w_ptr, cache_ptr, c_slot, c_row, c_col, slots_ptr, fresh_ptr,
                                   seq_ptr, pos_ptr, start_ptr, q_ptr, k_ptr, v_ptr, T, D, KD: tl.constexpr,
                                   W: tl.constexpr, SILU: tl.constexpr, HAS_FRESH: tl.constexpr, BT: tl.constexpr,
                                   BD: tl.constexpr):
        # causal_conv1d_kernel's arithmetic with each sequence's conv state read in its cache slot, the output
        # columns written apart as the ring kernel writes them
        t, d, mt, md, j, p, s0, dd, m = rows(seq_ptr, pos_ptr, start_ptr, T, D, BT, BD)
        base = tl.load(slots_ptr + j, mask=mt, other=0).to(tl.int64) * c_slot
        keep = mt
        if HAS_FRESH:
            keep = keep & (tl.load(fresh_ptr + j, mask=mt, other=1) == 0)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for w in tl.static_range(W):
            wv = wtap(w_ptr, d, md, w, W)
            acc += slot_tap(x_ptr, sx, cache_ptr, base, keep, c_row, c_col, p, s0, dd, m, w, W) * wv[None, :]
        store_qkv(q_ptr, k_ptr, v_ptr, t, dd, m, act(acc, SILU), D, KD)

    @triton.jit
    def conv_state_to_slots_kernel(x_ptr, sx, cache_ptr, c_slot, c_row, c_col, slots_ptr, fresh_ptr, start_ptr,
                                   len_ptr, D, W: tl.constexpr, BW: tl.constexpr, HAS_FRESH: tl.constexpr,
                                   BD: tl.constexpr):
        # sequence j's new conv state, the last W - 1 rows of ext_j = [conv_state_j; x_j], into its slot in place:
        # row r is ext_j[n_j + r], a row of x or a later row of the old state; every load precedes every store
        j = tl.program_id(0)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dd = d.to(tl.int64)[None, :]
        r = tl.arange(0, BW).to(tl.int64)
        n = tl.load(len_ptr + j).to(tl.int64)
        s0 = tl.load(start_ptr + j).to(tl.int64)
        base = cache_ptr + tl.load(slots_ptr + j).to(tl.int64) * c_slot
        e = n + r
        from_x = (e >= W - 1)[:, None]
        m = (r < W - 1)[:, None] & (d < D)[None, :]
        xv = tl.load(x_ptr + (s0 + e - (W - 1))[:, None] * sx + dd, mask=m & from_x, other=0.0)
        keep = m & (~from_x)
        if HAS_FRESH:
            keep = keep & (tl.load(fresh_ptr + j + 0 * r) == 0)[:, None]  # the flag per row (a vector mask)
        sv = tl.load(base + e[:, None] * c_row + dd * c_col, mask=keep, other=0.0)
        new = tl.where(from_x, xv, sv.to(xv.dtype)).to(cache_ptr.dtype.element_ty)
        tl.debug_barrier()  # a row stored below may be another thread's old row loaded above
        tl.store(base + r[:, None] * c_row + dd * c_col, new, mask=m)

    @triton.jit
    def conv_bwd_dz_kernel(x_ptr, w_ptr, st_ptr, seq_ptr, pos_ptr, start_ptr, gy_ptr, dz_ptr, dw_ptr, T, D,
                           W: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        # dz = dL/d(pre-activation), and this token block's share of dL/dweight: sum_t dz[t] * ext[p_t + w]
        t, d, mt, md, j, p, s0, dd, m = rows(seq_ptr, pos_ptr, start_ptr, T, D, BT, BD)
        rowoff = t.to(tl.int64)[:, None] * D + dd
        dz = tl.load(gy_ptr + rowoff, mask=m, other=0.0).to(tl.float32)
        if SILU:
            z = tl.zeros([BT, BD], dtype=tl.float32)
            for w in tl.static_range(W):
                wv = wtap(w_ptr, d, md, w, W)
                z += tap(x_ptr, st_ptr, j, p, s0, dd, m, D, w, W) * wv[None, :]
            sg = 1.0 / (1.0 + tl.exp(-z))
            dz = dz * sg * (1.0 + z * (1.0 - sg))
        tl.store(dz_ptr + rowoff, dz, mask=m)
        for w in tl.static_range(W):
            part = tl.sum(dz * tap(x_ptr, st_ptr, j, p, s0, dd, m, D, w, W), axis=0)
            tl.store(dw_ptr + (tl.program_id(0) * D + d.to(tl.int64)) * W + w, part, mask=md)

    @triton.jit
    def conv_bwd_dx_kernel(dz_ptr, w_ptr, seq_ptr, pos_ptr, start_ptr, len_ptr, dx_ptr, T, D,
                           W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        # x_j[i] feeds outputs i + (W-1) - w of its own sequence, w = 0..W-1
        t, d, mt, md, j, p, s0, dd, m = rows(seq_ptr, pos_ptr, start_ptr, T, D, BT, BD)
        n = tl.load(len_ptr + j, mask=mt, other=0).to(tl.int64)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for w in tl.static_range(W):
            q = p + (W - 1 - w)
            g = tl.load(dz_ptr + (s0 + q)[:, None] * D + dd, mask=m & (q < n)[:, None], other=0.0)
            wv = wtap(w_ptr, d, md, w, W)
            acc += g * wv[None, :]
        tl.store(dx_ptr + t.to(tl.int64)[:, None] * D + dd, acc.to(dx_ptr.dtype.element_ty), mask=m)


def _kernels():
    """(forward, backward dz + dweight shares, backward dx)."""
    if triton is None:
        raise RuntimeError("vllm_bi: the CUDA GDN conv needs Triton (installed with vLLM)")
    return causal_conv1d_kernel, conv_bwd_dz_kernel, conv_bwd_dx_kernel


def _grid(T, D, bt=BLOCK_T, bd=BLOCK_D):
    return (triton.cdiv(T, bt), triton.cdiv(D, bd))


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, seq: torch.Tensor,
                         pos: torch.Tensor, starts: torch.Tensor, silu: bool,
                         blocks: tuple[int, int, int] = (BLOCK_T, BLOCK_D, 4)) -> torch.Tensor:
    """``x [T, D]``, ``weight [D, W]``, ``conv_states [N, W-1, D]``; per token its sequence ``seq [T]`` and
    position ``pos [T]``, per sequence its first row ``starts [N]`` (int tensors on x's device). Returns
    ``y [T, D]`` in x's dtype (no autograd; runs on CPU tensors under ``TRITON_INTERPRET=1``). ``blocks``
    (tokens, channels, warps per program) decide only which program computes an element, not its bits
    (``benchmarks/profile_gdn.py --conv-blocks`` times the choices; the GPU test checks the bits agree)."""
    T, D = x.shape
    bt, bd, warps = blocks
    x, weight, conv_states = x.contiguous(), weight.contiguous(), conv_states.contiguous()
    y = torch.empty_like(x)
    if T:
        _kernels()[0][_grid(T, D, bt, bd)](x, weight, conv_states, seq, pos, starts, y, T, D, W=weight.shape[-1],
                                           SILU=silu, BT=bt, BD=bd, num_warps=warps)
    return y


def triton_causal_conv1d_backward(gy, x, weight, conv_states, seq, pos, starts, lens, silu):
    """Gradients ``(dx, dweight, dconv_states)`` of :func:`triton_causal_conv1d` for the output gradient ``gy``:
    ``dz`` (through SiLU, recomputing the pre-activation) and each token block's ``dweight`` share in one
    kernel, ``dx`` in another; the shares are summed in torch and ``dconv_states`` (N x (W-1) rows) is
    gathered in torch. fp32 throughout; gradients need be right, not batch-invariant."""
    T, D = x.shape
    W = weight.shape[-1]
    x, weight, conv_states, gy = x.contiguous(), weight.contiguous(), conv_states.contiguous(), gy.contiguous()
    dz = torch.empty(T, D, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    grid = _grid(T, D)
    shares = torch.empty(grid[0], D, W, dtype=torch.float32, device=x.device)
    if T:
        fwd, bwd_dz, bwd_dx = _kernels()
        bwd_dz[grid](x, weight, conv_states, seq, pos, starts, gy, dz, shares, T, D, W=W, SILU=silu, BT=BLOCK_T,
                     BD=BLOCK_D, num_warps=4)
        bwd_dx[grid](dz, weight, seq, pos, starts, lens, dx, T, D, W=W, BT=BLOCK_T, BD=BLOCK_D, num_warps=4)
    dweight = shares.sum(0).to(weight.dtype)
    # conv_state_j[r] feeds outputs r - w (w <= r) of sequence j
    N = conv_states.shape[0]
    dst = torch.zeros(N, W - 1, D, dtype=torch.float32, device=x.device)
    for r in range(W - 1):
        for w in range(r + 1):
            q = r - w
            ok = (lens > q)[:, None]
            rows = (starts + q).clamp(0, max(T - 1, 0)).long()
            g = dz[rows] if T else torch.zeros(N, D, device=x.device)
            dst[:, r] += torch.where(ok, g, 0.0) * weight[:, w].float()
    return dx, dweight, dst.to(conv_states.dtype)


def ring_causal_conv1d(src: torch.Tensor, ext: torch.Tensor, seq: torch.Tensor, weight: torch.Tensor, silu: bool,
                       key_dim: int, blocks: tuple[int, int, int] = RING_BLOCKS
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`triton_causal_conv1d`'s outputs, bit for bit, from rows read in place and written apart (no autograd):
    the chunk mode's decode step reads each partial block and its conv rows straight from the history ring.

    ``src [S, R, C]`` (any strides; its first ``D = weight.shape[0]`` columns are the conv's input), ``seq [T]``
    each output token's sequence, ``ext`` for sequence ``j`` its ``W - 1 + n_j`` input rows in order (its conv
    state, then its tokens), each ``slot * R + row`` of ``src`` or ``-1`` for a zero row; sequence ``j``'s entries
    start at ``cu_j + j * (W - 1)``. Returns ``(q [T, key_dim], k [T, key_dim], v [T, D - 2 * key_dim])``, each
    contiguous, in ``src``'s dtype: the columns a plain conv would give, without the copies that split them."""
    _kernels()  # Triton is there
    T, (D, W) = seq.shape[0], weight.shape
    bt, bd, warps = blocks
    q, k = (torch.empty(T, key_dim, dtype=src.dtype, device=src.device) for _ in range(2))
    v = torch.empty(T, D - 2 * key_dim, dtype=src.dtype, device=src.device)
    if T:
        causal_conv1d_ring_kernel[_grid(T, D, bt, bd)](
            src, ext, weight.contiguous(), seq, q, k, v, T, D, src.shape[1], *src.stride(), KD=key_dim, W=W,
            SILU=silu, BT=bt, BD=bd, num_warps=warps)
    return q, k, v


STATE_BLOCK_D = 512  # channels per program of the conv-state update (its W - 1 rows each)


def slot_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, dim_first: bool,
                       slots: torch.Tensor, fresh: torch.Tensor | None, seq: torch.Tensor, pos: torch.Tensor,
                       starts: torch.Tensor, lens: torch.Tensor, silu: bool, key_dim: int,
                       blocks: tuple[int, int, int] = (BLOCK_T, BLOCK_D, 4)
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`triton_causal_conv1d`'s outputs, bit for bit, with each sequence's conv state read in vLLM's conv cache
    and its new one written back there (no autograd): a server step without the gather of the states, the zeroing of
    the new requests' and the store of the new ones.

    ``x [T, D]`` the step's rows, sequence ``j`` owning rows ``starts[j] .. starts[j] + lens[j]`` (any row stride:
    a column slice of the projection is read where it lies); ``cache [S, W-1, D]`` (``[S, D, W-1]`` with
    ``dim_first``; any strides), sequence ``j``'s state in slot ``slots[j]``, or zeros where ``fresh[j]`` is nonzero;
    per token its sequence ``seq`` and position ``pos``. Two launches: the conv, which reads every old state, then
    the update, which writes the new ones (the last ``W - 1`` rows of ``[state_j; x_j]``, rounded through ``x``'s
    dtype as the gathered path rounds them). Slots written must differ between sequences, except vLLM's padding
    rows' (slot 0, the null block). Returns ``(q [T, key_dim], k [T, key_dim], v [T, D - 2 * key_dim])``, each
    contiguous, in ``x``'s dtype."""
    _kernels()  # Triton is there
    T, D = x.shape
    W = weight.shape[-1]
    if x.stride(1) != 1:
        x = x.contiguous()
    c = cache.transpose(1, 2) if dim_first else cache  # [S, W-1, D] seen
    if c.shape[1] != W - 1 or c.shape[2] != D:
        raise ValueError(f"slot_causal_conv1d: conv cache slots {tuple(c.shape[1:])} (rows, channels) do not hold "
                         f"the {W - 1} x {D} state of a width-{W} conv")
    bt, bd, warps = blocks
    q, k = (torch.empty(T, key_dim, dtype=x.dtype, device=x.device) for _ in range(2))
    v = torch.empty(T, D - 2 * key_dim, dtype=x.dtype, device=x.device)
    N = slots.shape[0]
    flags = fresh if fresh is not None else slots
    if T:
        causal_conv1d_slots_kernel[_grid(T, D, bt, bd)](
            x, x.stride(0), weight.contiguous(), c, *c.stride(), slots, flags, seq, pos, starts, q, k, v, T, D,
            KD=key_dim, W=W, SILU=silu, HAS_FRESH=fresh is not None, BT=bt, BD=bd, num_warps=warps)
    if N:
        conv_state_to_slots_kernel[(N, triton.cdiv(D, STATE_BLOCK_D))](
            x, x.stride(0), c, *c.stride(), slots, flags, starts, lens, D, W=W,
            BW=triton.next_power_of_2(max(W - 1, 1)), HAS_FRESH=fresh is not None, BD=STATE_BLOCK_D, num_warps=4)
    return q, k, v


class CausalConv1dTriton(torch.autograd.Function):
    """Forward :func:`triton_causal_conv1d`, backward :func:`triton_causal_conv1d_backward`."""

    @staticmethod
    def forward(ctx, x, weight, conv_states, seq, pos, starts, lens, silu):
        ctx.save_for_backward(x, weight, conv_states, seq, pos, starts, lens)
        ctx.silu = silu
        return triton_causal_conv1d(x, weight, conv_states, seq, pos, starts, silu)

    @staticmethod
    def backward(ctx, gy):
        x, weight, conv_states, seq, pos, starts, lens = ctx.saved_tensors
        dx, dw, dst = triton_causal_conv1d_backward(gy, x, weight, conv_states, seq, pos, starts, lens, ctx.silu)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dw if need[1] else None, dst if need[2] else None,
                None, None, None, None, None)
