"""MoE experts as grouped Triton GEMMs, batch-invariant and without a host read (``VLLM_BI_MOE=exact|triton``;
``triton`` is the default on CUDA).

The CPU default experts path (:func:`vllm_bi.ops.moe.moe_experts`, ``VLLM_BI_MOE=loop``) loops over the experts a
step routes to on the host: a read of the routing per layer and a ``nonzero`` per expert, each one a stream
synchronisation, and two float64 products per expert. At Qwen3.5-MoE's 256 experts (Qwen3-Next: 512) a decode
step touches most of them in every MoE layer. Here a step's (token, expert) pairs are sorted by expert on the
device, cut into blocks of ``BLOCK_M`` pairs of one expert, and each projection is one launch over a fixed
upper bound of blocks (empty blocks do nothing). No value goes to the host, so a decode step can be captured in
a CUDA graph.

Why a pair's bits do not depend on the batch: a pair's output row is ``x_row @ W_e^T`` computed by one program
that accumulates over ``K`` in ``BLOCK_K`` steps in a fixed order (``tl.dot``, or per-row sums of products); the
other rows of its block (other tokens routed to the same expert, or masked padding) are other rows of the same
matrix product and do not enter its sums. The block sizes, warps and stages below are module constants: part of
the arithmetic, the same in the server and the trainer. Two arithmetics:

* ``exact``: products and sums in float64, exact for bf16 operands (as :func:`vllm_bi.ops.linear.bi_linear`'s
  float64 GEMM), then rounded by torch as the loop path rounds. The bits are the float64 loop path's, so a server
  on one and a trainer on the other agree; only the host reads are gone.
* ``triton``: bf16 tensor cores with fp32 accumulation, one rounding to the activation dtype: faster at large
  batches, other bits than the loop's, so server and trainer must both use it (``vllm_bi_info`` reports the mode,
  the trainer refuses a mismatch).

The combination is the loop path's: ``silu_mul`` between the projections, each expert output rounded to the
activation dtype, scaled by its routing weight in fp32, the top-k outputs summed in the order of the token's top-k
list and rounded once.

Backward (the trainer): the loop path's autograd, recomputed (gradients need accuracy, not the forward's bits).
On CPU the kernel runs only under ``TRITON_INTERPRET=1`` (tests), with fp32 products summed per row without
``tl.dot``: the interpreter's bf16 ``tl.dot`` is wrong, and its fp32 one is numpy's matmul, whose row results
depend on the row's place in the tile under some OpenBLAS builds (numpy 2.3.5 with OpenBLAS 0.3.30: all 16
rows of a 16 x 64 x 64 product differed from the row alone), which broke trainer == server on CPU.
"""

from __future__ import annotations


import torch

__all__ = ["moe_arithmetic", "moe_backend", "moe_experts_triton", "grouped_linear", "pair_layout"]

# part of the arithmetic: changing any of these changes bits (server and trainer must agree)
BLOCK_M = 16  # (token, expert) pairs per program
BLOCK_N = 64
BLOCK_K = 64
BLOCK_K_EXACT = 8  # the float64 kernel's K step on CUDA: its products live in registers, BLOCK_M x BLOCK_K x BLOCK_N
NUM_WARPS = 4
NUM_STAGES = 3

_KERNEL = None


def moe_backend(device: torch.device | str) -> str:
    """``VLLM_BI_MOE`` for tensors on ``device``: ``"loop"`` (a host loop over the routed experts, products by
    ``bi_linear``; the default off CUDA), ``"exact"`` (grouped float64 kernels, no host read: the loop's bits under
    the default float64 GEMM) or ``"triton"`` (grouped bf16 kernels, no host read, other bits; the default on CUDA:
    1.7-4x stock's experts on the H200 where the loop took 10-143x, exact there,
    ``docs/results/2026-11-30-h200-gdn-layer-targets-and-moe.md``)."""
    from vllm_bi.ops._choice import check_triton_device
    from vllm_bi.settings import current

    dev_type = torch.device(device).type
    choice = current().moe_path(dev_type)
    check_triton_device("VLLM_BI_MOE", "triton" if choice == "exact" else choice, dev_type)
    return choice


def moe_arithmetic(mode: str, gemm: str) -> str:
    """What decides a MoE layer's bits: ``"float64"`` for the exact grouped kernels and for the loop under the
    float64 GEMM (the same bits), else the mode and GEMM mode. A server and a trainer must agree on it."""
    if mode == "exact" or (mode == "loop" and gemm == "fp64"):
        return "float64"
    return mode if mode == "triton" else f"loop with the {gemm} GEMM"


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def grouped_linear_kernel(x_ptr, w_ptr, y_ptr, rows_ptr, blk_e_ptr, blk_s_ptr, blk_c_ptr, N, K,
                                  sx, swe, swn, swk, sy, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                  EXACT: tl.constexpr, ROW_SUMS: tl.constexpr):
            b = tl.program_id(0)
            count = tl.load(blk_c_ptr + b)
            if count > 0:
                e = tl.load(blk_e_ptr + b).to(tl.int64)
                start = tl.load(blk_s_ptr + b).to(tl.int64)
                m = tl.arange(0, BM)
                mm = m < count
                src = tl.load(rows_ptr + start + m, mask=mm, other=0).to(tl.int64)
                n = tl.program_id(1) * BN + tl.arange(0, BN)
                mn = n < N
                kk = tl.arange(0, BK)
                if EXACT:
                    acc = tl.zeros((BM, BN), dtype=tl.float64)
                else:
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
                for k0 in range(0, K, BK):
                    mk = (k0 + kk) < K
                    a = tl.load(x_ptr + src[:, None] * sx + (k0 + kk)[None, :], mask=mm[:, None] & mk[None, :],
                                other=0.0)
                    bt = tl.load(w_ptr + e * swe + n[None, :] * swn + (k0 + kk)[:, None] * swk,
                                 mask=mk[:, None] & mn[None, :], other=0.0)
                    if EXACT or ROW_SUMS:
                        # products summed per row without tl.dot, in the accumulator's dtype. EXACT: bf16 products are
                        # exact in float64 (the loop path's float64 GEMM's arithmetic), and Triton 3.6 does not lower
                        # a float64 tl.dot on the H200 ("fp64 don't support largeK MMA"). ROW_SUMS:
                        # Triton's CPU interpreter (module doc)
                        acc += tl.sum(a.to(acc.dtype)[:, :, None] * bt.to(acc.dtype)[None, :, :], axis=1)
                    else:
                        acc = tl.dot(a, bt, acc)
                tl.store(y_ptr + (start + m)[:, None] * sy + n[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=mm[:, None] & mn[None, :])

        _KERNEL = grouped_linear_kernel
    return _KERNEL


def pair_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks of one step's pairs, built on the device without a host read.

    ``ids [P]`` (int64): each pair's expert. Returns ``(order [P], blk_expert, blk_start, blk_count)``: ``order[s]``
    is the pair at sorted position ``s`` (pairs sorted by expert, stably); block ``b`` holds sorted positions
    ``blk_start[b] .. + blk_count[b]`` of expert ``blk_expert[b]``. There are ``P // BLOCK_M + min(E, P)`` blocks
    (an upper bound, known on the host); the surplus have count 0."""
    P = ids.numel()
    dev = ids.device
    order = torch.sort(ids, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    cum_blk = torch.cumsum(nblk, 0)
    first_blk = cum_blk - nblk
    first_pair = torch.cumsum(counts, 0) - counts
    b = torch.arange(P // BLOCK_M + min(num_experts, P), device=dev)
    e = torch.searchsorted(cum_blk, b, right=True).clamp(max=num_experts - 1)
    j = b - first_blk[e]
    count = torch.where(b < cum_blk[-1], (counts[e] - j * BLOCK_M).clamp(0, BLOCK_M), 0)
    return order, e, first_pair[e] + j * BLOCK_M, count


def grouped_linear(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, layout,
                   out_dtype: torch.dtype, exact: bool = False) -> torch.Tensor:
    """``y[s] = x[rows[s]] @ w[e(s)]^T`` for every sorted position ``s`` of ``layout`` (:func:`pair_layout`):
    ``x [R, K]``, ``rows [P]``, ``w [E, N, K]`` -> ``y [P, N]`` in ``out_dtype`` (``exact``: accumulated in float64
    and returned in float64). No autograd."""
    if exact:
        out_dtype = torch.float64
    _, blk_e, blk_s, blk_c = layout
    P, (N, K) = rows.numel(), w.shape[1:]
    if x.shape[-1] != K or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"moe: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (last dims contiguous, equal)")
    y = torch.empty((P, N), dtype=out_dtype, device=x.device)
    if P:
        import triton

        _kernel()[(blk_e.numel(), triton.cdiv(N, BLOCK_N))](
            x, w, y, rows, blk_e, blk_s, blk_c, N, K, x.stride(0), *w.stride(), y.stride(0), BM=BLOCK_M, BN=BLOCK_N,
            # the interpreter (CPU) keeps BLOCK_K for float64 too: 8x fewer interpreted steps
            BK=BLOCK_K_EXACT if exact and x.device.type == "cuda" else BLOCK_K, EXACT=exact,
            ROW_SUMS=x.device.type != "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y


def _forward(x, w13, w2, topk_weights, topk_ids, on_input, exact):
    from vllm_bi.ops.activation import silu_mul
    from vllm_bi.ops.moe_loop import combine_topk

    T, k = topk_ids.shape
    H = w2.shape[1]
    P = T * k
    ids = topk_ids.reshape(-1).long()
    layout = pair_layout(ids, w13.shape[0])
    order = layout[0]
    pos = torch.arange(P, device=x.device)
    if on_input:  # the routing weight scales each pair's input, rounded to x's dtype (as the loop path)
        xin, rows = (x[order // k].float() * topk_weights.reshape(-1)[order].float()[:, None]).to(x.dtype), pos
    else:
        xin, rows = x, order // k
    # exact: float64 results rounded by torch, as the loop path's float64 GEMMs are
    h = silu_mul(grouped_linear(xin.contiguous(), rows, w13, layout, x.dtype, exact).to(x.dtype))
    y_sorted = grouped_linear(h.contiguous(), pos, w2, layout, x.dtype, exact)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return combine_topk(y.view(T, k, H).to(x.dtype), topk_weights, on_input)


class _TritonExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids, on_input, exact):
        ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids)
        ctx.on_input = on_input
        with torch.no_grad():
            return _forward(x, w13, w2, topk_weights, topk_ids, on_input, exact)

    @staticmethod
    def backward(ctx, grad_out):
        from vllm_bi.ops.moe_loop import moe_experts_loop

        x, w13, w2, tw, ids = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip((x, w13, w2, tw), need)]
            out = moe_experts_loop(*leaves[:3], leaves[3], ids, ctx.on_input)
            wanted = [t for t, n in zip(leaves, need) if n]
            got = iter(torch.autograd.grad(out, wanted, grad_out)) if wanted else iter(())
        return (*(next(got) if n else None for n in need), None, None, None)


def moe_experts_triton(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input: bool = False,
                       exact: bool = False):
    """:func:`vllm_bi.ops.moe.moe_experts` by grouped kernels (module doc; ``exact``: float64); differentiable."""
    T = topk_ids.shape[0]
    if T == 0:
        return torch.zeros((0, w2.shape[1]), dtype=x.dtype, device=x.device)
    return _TritonExperts.apply(x, w13, w2, topk_weights, topk_ids, bool(apply_router_weight_on_input), bool(exact))
