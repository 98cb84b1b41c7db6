"""Causal attention over a paged KV cache as one Triton kernel: one program per (query row, head).

A candidate CUDA path for :mod:`vllm_bi.ops.attention` (not wired into the server or the trainer yet: its
bits differ from the torch op's, so both sides would switch together, after it is measured on a GPU).

Each program owns one query row at absolute position ``p`` of its sequence and one query head. It walks
that sequence's keys ``0..p`` in blocks of ``BLOCK_N`` from key 0 (the block table maps key ``j`` to
cache block ``table[seq, j // block_size]``), with an online softmax in fp32:

* ``s_j = sum_d q_d k_jd`` (fp32, one fixed-shape reduction per block), scaled;
* running max ``m``, denominator ``l`` and accumulator ``acc`` updated once per block, in key order;
* output ``acc / l``, rounded once.

The loop's bounds, the block partition and every reduction's shape depend on ``p`` and the constants only,
never on the other rows, the batch, the number of query rows of the sequence or the cache's block size. A
row's bits are then the same in a prefill, a split prefill or a one-token decode, and whatever is batched
with it. Keys after ``p`` are masked to exact zeros; cache entries never read are never loaded.

Cache layout (vllm_bi's, also TRITON_ATTN's logical layout on CUDA): ``kv_cache [num_blocks, Hkv,
block_size, 2 D]``, key in ``[..., :D]``, value in ``[..., D:]``.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_N", "paged_attention"]

BLOCK_N = 32  # keys per step of a row's loop: part of the arithmetic (changing it changes bits)

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def paged_attention_kernel(q_ptr, o_ptr, kv_ptr, table_ptr, seq_ptr, pos_ptr, scale,
                                   H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                   TABLE_W, BLOCK_N: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            h = tl.program_id(1)
            kvh = h // (H // HKV)
            seq = tl.load(seq_ptr + row).to(tl.int64)
            p = tl.load(pos_ptr + row)
            d = tl.arange(0, D)
            q = tl.load(q_ptr + (row * H + h) * D + d).to(tl.float32)
            m = tl.full([1], float("-inf"), tl.float32)
            lsum = tl.zeros([1], tl.float32)
            acc = tl.zeros([D], tl.float32)
            for start in range(0, p + 1, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                valid = j <= p
                blk = tl.load(table_ptr + seq * TABLE_W + j // BS, mask=valid, other=0).to(tl.int64)
                base = ((blk * HKV + kvh) * BS + j % BS) * (2 * D)
                k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                v = tl.load(kv_ptr + base[:, None] + D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                s = tl.sum(k * q[None, :], axis=1) * scale
                s = tl.where(valid, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                alpha = tl.exp(m - m_new)
                e = tl.exp(s - m_new)  # masked -> exactly 0
                lsum = lsum * alpha + tl.sum(e, axis=0)
                acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
                m = m_new
            tl.store(o_ptr + (row * H + h) * D + d, (acc / lsum).to(o_ptr.dtype.element_ty))

        _KERNEL = paged_attention_kernel
    return _KERNEL


def paged_attention(q: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, table: torch.Tensor,
                    kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [T, H, D]`` query rows; ``seq [T]`` each row's sequence (a row of ``table``), ``pos [T]`` its absolute
    position; ``table [N, W]`` block table; ``kv_cache [blocks, Hkv, block_size, 2 D]``. Returns ``[T, H, D]``
    in ``q.dtype``. No autograd. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    T, H, D = q.shape
    _, hkv, bs, two_d = kv_cache.shape
    if two_d != 2 * D or H % hkv or D & (D - 1):
        raise ValueError(f"paged_attention: q {tuple(q.shape)} and cache {tuple(kv_cache.shape)} do not fit "
                         "(heads a multiple of the KV heads, cache last dim 2 D, D a power of two)")
    out = torch.empty_like(q)
    if T:
        _kernel()[(T, H)](q.contiguous(), out, kv_cache.contiguous(), table.contiguous(), seq.contiguous(),
                          pos.contiguous(), float(scale), H=H, HKV=hkv, D=D, BS=bs, TABLE_W=table.shape[1],
                          BLOCK_N=BLOCK_N)
    return out
