"""Causal attention as one Triton kernel on tensor cores, batch-invariant: the CUDA path of the attention op.

A *tile* is up to ``BLOCK_R`` consecutive query rows of one sequence; one program computes one tile for one KV
head, with that head's ``G`` query heads folded into the matrix rows (``BLOCK_M = BLOCK_R * G'`` rows, ``G'``
the group size rounded up to a power of two; padded rows are masked). A decode is a tile of one row; a prefill
of ``n`` rows is ``ceil(n / BLOCK_R)`` tiles. The program walks the sequence's keys from key 0 in blocks of
``BLOCK_N`` (key ``j`` lives in cache block ``table[seq, j // block_size]``) with an online softmax in fp32:

* ``S = Q K^T`` on tensor cores (bf16 inputs, fp32 accumulation), scaled; keys after a row's position masked;
* running max ``m``, denominator ``l`` and accumulator ``O`` updated once per key block, in key order;
  ``O += P V`` with ``P`` rounded to the cache dtype, as fused attention kernels do;
* output ``O / l``, rounded once.

Why a row's bits do not depend on its tile: every program runs the same compiled kernel (the block sizes, warps
and stages below are module constants, part of the arithmetic), a matrix-multiply row depends only on its own
operand row, and the row reductions (max and sum over a key block) take the same path for every row. Blocks past
a row's own position, walked because a later row of its tile needs them, are fully masked for it: ``m`` stays,
``alpha = 1``, ``P = 0``, so ``l`` and ``O`` keep their bits. A row is thus computed identically as a decode,
in a prefill (at any place in its tile), in a split prefill, and whatever is batched with it.

The server reads vLLM's paged cache (``kv_cache [num_blocks, Hkv, block_size, 2 D]``, key in ``[..., :D]``);
the trainer packs its sequences' keys in the same layout with a block size of 1 (:func:`packed_attention`) and
runs the same kernel, with a backward by PyTorch's attention (gradients need accuracy, not bits).

``VLLM_BI_ATTENTION`` picks the op: ``auto`` (this kernel on CUDA, :mod:`vllm_bi.ops.attention` on CPU and for
multi-head latent attention, whose head dims are no power of two), ``torch`` or ``triton`` everywhere. Server and trainer read it alike; their bits match only if they agree (the trainer checks
the server's setting). The default is ``auto``: on the H200 the kernel is exact (alone == batched == split, trainer
== server path), takes 0.5-4x SDPA's time against the torch op's 26-4600x, and served models through it gave the
trainer's bits on every token (qwen3.5, qwen3.5-moe, 9b-dims, the chunk GDN mode, 4 RL steps at 0.0;
``docs/results/2026-11-30-h200-triton-attention-served.md``).

On CPU the kernel runs only under ``TRITON_INTERPRET=1`` (tests), with fp32 products summed per row without
``tl.dot``: the interpreter's bf16 ``tl.dot`` is wrong, and its fp32 one is numpy's matmul, whose row results can
depend on the row's place in the tile (OpenBLAS 0.3.30; ``vllm_bi.ops.moe_triton``'s module doc).
"""

from __future__ import annotations


import torch

__all__ = ["BLOCK_M", "BLOCK_N", "attention_backend", "packed_attention", "paged_attention",
           "rows_per_tile", "tiles_for"]

# part of the arithmetic: changing any of these changes bits (server and trainer must agree)
BLOCK_M = 64  # matrix rows per program: query rows x (padded) query heads per KV head
BLOCK_N = 32  # keys per step of the walk
NUM_WARPS = 4
NUM_STAGES = 2

_KERNEL = None


def attention_backend(device: torch.device | str, mla: bool = False) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``, from ``VLLM_BI_ATTENTION`` (auto, torch, triton);
    ``mla``: for multi-head latent attention (``auto`` takes the torch op there)."""
    from vllm_bi.ops._choice import check_triton_device
    from vllm_bi.settings import current

    dev_type = torch.device(device).type
    choice = current().attention_op(dev_type, mla)  # auto: Triton on CUDA (served parity on the H200), torch on CPU
    check_triton_device("VLLM_BI_ATTENTION", choice, dev_type)
    return choice


def _group_pad(h: int, hkv: int) -> int:
    if hkv <= 0 or h % hkv:
        raise ValueError(f"attention: {h} query heads are not a multiple of {hkv} KV heads")
    g = 1
    while g < h // hkv:
        g *= 2
    if g > BLOCK_M:
        raise ValueError(f"attention: {h // hkv} query heads per KV head exceed the kernel's {BLOCK_M} rows")
    return g


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def attention_tiles_kernel(q_ptr, o_ptr, kv_ptr, table_ptr, tile_ptr, scale, block_size, table_w,
                                   stride_blk, stride_head, stride_tok,
                                   H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                                   GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   ROW_SUMS: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            kvh = tl.program_id(1)
            seq = tl.load(tile_ptr + t * 4).to(tl.int64)
            row0 = tl.load(tile_ptr + t * 4 + 1).to(tl.int64)
            nrows = tl.load(tile_ptr + t * 4 + 2)
            pos0 = tl.load(tile_ptr + t * 4 + 3)
            i = tl.arange(0, BLOCK_M)
            r = i // GP  # query row within the tile
            g = i % GP  # query head within the KV head's group
            live = (r < nrows) & (g < G)
            head = kvh * G + g
            d = tl.arange(0, D)
            q = tl.load(q_ptr + ((row0 + r) * H + head)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
            pos = pos0 + r
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            last = pos0 + nrows - 1
            for start in range(0, last + 1, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                kj = j <= last
                blk = tl.load(table_ptr + seq * table_w + j // block_size, mask=kj, other=0).to(tl.int64)
                base = blk * stride_blk + kvh * stride_head + (j % block_size) * stride_tok
                k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kj[:, None], other=0.0)
                v = tl.load(kv_ptr + base[:, None] + D + d[None, :], mask=kj[:, None], other=0.0)
                if ROW_SUMS:  # Triton's CPU interpreter: products summed per row (module doc)
                    s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
                else:
                    s = tl.dot(q, tl.trans(k)) * scale
                s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])  # masked -> exactly 0
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if ROW_SUMS:
                    pv = p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :]
                    acc = acc * alpha[:, None] + tl.sum(pv, axis=1)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(o_ptr + ((row0 + r) * H + head)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=live[:, None])

        _KERNEL = attention_tiles_kernel
    return _KERNEL


def rows_per_tile(h: int, hkv: int) -> int:
    """Query rows per tile for ``h`` query and ``hkv`` KV heads."""
    return BLOCK_M // _group_pad(h, hkv)


def tiles_for(h: int, hkv: int, q_starts: list[int], n_rows: list[int], first_pos: list[int]) -> torch.Tensor:
    """Host tile list ``[n_tiles, 4]`` int32 of (sequence, first q row, rows, first row's position): sequence ``i``
    owns q rows ``q_starts[i] : q_starts[i] + n_rows[i]`` at positions ``first_pos[i] ...``."""
    per = rows_per_tile(h, hkv)
    tiles = [(i, s + o, min(per, n - o), p + o)
             for i, (s, n, p) in enumerate(zip(q_starts, n_rows, first_pos)) for o in range(0, n, per)]
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 4)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, tiles: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, D]`` query rows; ``kv_cache [blocks, Hkv, block_size, 2 D]`` (any strides but the last: a hybrid
    model's blocks may be padded to its GDN state pages); ``table [N, W]`` block
    table (int); ``tiles`` from :func:`tiles_for`, on ``q``'s device. Writes the tiles' rows of ``out`` (default:
    a new ``[T, H, D]`` in ``q.dtype``; rows in no tile are left as they are) and returns it. No autograd."""
    T, H, D = q.shape
    _, hkv, bs, two_d = kv_cache.shape
    gp = _group_pad(H, hkv)
    if two_d != 2 * D or D & (D - 1) or D < 16:
        raise ValueError(f"attention: q {tuple(q.shape)} and cache {tuple(kv_cache.shape)} do not fit (cache last "
                         "dim 2 D, D a power of two >= 16)")
    if kv_cache.stride(3) != 1:
        raise ValueError(f"attention: the KV cache's last dim must be contiguous (strides {kv_cache.stride()})")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"attention: out must be a contiguous {tuple(q.shape)} tensor (got {tuple(out.shape)}, "
                         f"strides {out.stride()})")
    if tiles.shape[0]:
        _kernel()[(tiles.shape[0], hkv)](
            q.contiguous(), out, kv_cache, table.contiguous(), tiles, float(scale), bs, table.shape[1],
            *kv_cache.stride()[:3], H=H, HKV=hkv, D=D, G=H // hkv, GP=gp, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            ROW_SUMS=q.device.type != "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _packed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    T, hkv, D = k.shape
    kv = torch.cat([k, v], dim=-1).view(T, hkv, 1, 2 * D)  # block size 1: block j of sequence i is token cu[i] + j
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    width = max(lens, default=0)
    table = (torch.tensor(cu[:-1], dtype=torch.int32).view(-1, 1) + torch.arange(max(width, 1), dtype=torch.int32))
    table = torch.minimum(table, torch.tensor(max(T - 1, 0), dtype=torch.int32))  # entries past an end: never read
    tiles = tiles_for(q.shape[1], hkv, cu[:-1], lens, [0] * len(lens))
    return paged_attention(q, kv, table.to(q.device), tiles.to(q.device), scale)


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, scale):
        ctx.save_for_backward(q, k, v)
        ctx.cu, ctx.scale = cu, scale
        return _packed_forward(q, k, v, cu, scale)

    @staticmethod
    def backward(ctx, grad_out):
        # the same function's gradient through PyTorch's attention, one sequence at a time (accuracy, not bits)
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b in zip(ctx.cu[:-1], ctx.cu[1:]):
            if a == b:
                continue
            with torch.enable_grad():
                qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0).detach().requires_grad_() for x in (q, k, v))
                oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=ctx.scale,
                                                                      enable_gqa=True)
                gq, gk, gv = torch.autograd.grad(oi, (qi, ki, vi), grad_out[a:b].transpose(0, 1).unsqueeze(0))
            dq[a:b], dk[a:b], dv[a:b] = (g.squeeze(0).transpose(0, 1) for g in (gq, gk, gv))
        return dq, dk, dv, None, None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences (sequence ``i`` owns rows ``cu[i]:cu[i+1]``, from position 0): ``q
    [T, H, D]``, ``k, v [T, Hkv, D]``. The server's kernel and bits; differentiable in ``q``, ``k``, ``v``."""
    return _PackedAttention.apply(q, k, v, list(cu), float(scale))
