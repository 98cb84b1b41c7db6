"""The CUDA path of the GDN short convolution (:func:`vllm_bi.attention.gdn_recurrent.causal_conv1d_varlen`):
one Triton kernel over the packed batch.

Each output element ``y[t, d] = act(sum_w weight[d, w] * ext_j[p + w])`` (``j`` the token's sequence, ``p``
its position in it, ``ext_j = [conv_state_j; x_j]``) is computed by one program from its own W inputs,
accumulated in fp32 in the fixed order w = 0..W-1: nothing is reduced across tokens or channels, and the
block sizes only decide which program computes an element, not how. So a token's output is the same whatever
it is packed with (``tests/gpu/test_gdn_conv_cuda.py`` measures it on the GPU; the kernel's logic is checked
on CPU through Triton's interpreter, ``tests/ops/test_gdn_conv_triton.py``).

Server and trainer both run this kernel on CUDA, so their bits agree; they need not equal the torch path's
(the compiler may contract a multiply and an add into one FMA). The backward recomputes the torch path and
differentiates it: gradients need only be right, not batch-invariant.

Measured on the H200 at Qwen3.5-9B GDN dimensions (8 x 8192 tokens, 8192 channels): the torch path took
31.7 ms, fla-core's Triton conv 1.7 ms (``benchmarks/profile_gdn.py``, docs/results/2026-11-30-h200-*.md).
"""

from __future__ import annotations

import torch

__all__ = ["triton_causal_conv1d", "CausalConv1dTriton"]

BLOCK_T, BLOCK_D = 16, 256
_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def causal_conv1d_kernel(x_ptr, w_ptr, st_ptr, seq_ptr, pos_ptr, start_ptr, y_ptr, T, D,
                                 W: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
            t = tl.program_id(0) * BT + tl.arange(0, BT)
            d = tl.program_id(1) * BD + tl.arange(0, BD)
            mt, md = t < T, d < D
            j = tl.load(seq_ptr + t, mask=mt, other=0).to(tl.int64)
            p = tl.load(pos_ptr + t, mask=mt, other=0).to(tl.int64)
            s0 = tl.load(start_ptr + j, mask=mt, other=0).to(tl.int64)
            dd = d.to(tl.int64)[None, :]
            acc = tl.zeros([BT, BD], dtype=tl.float32)
            for w in tl.static_range(W):
                i = p + (w - (W - 1))  # position in x_j; a negative one reads conv_state_j[(W-1) + i]
                in_x = (i >= 0)[:, None]
                m = mt[:, None] & md[None, :]
                xv = tl.load(x_ptr + (s0 + i)[:, None] * D + dd, mask=m & in_x, other=0.0)
                sv = tl.load(st_ptr + (j * (W - 1) + (W - 1) + i)[:, None] * D + dd, mask=m & (~in_x), other=0.0)
                v = tl.where(in_x, xv, sv.to(xv.dtype)).to(tl.float32)
                wv = tl.load(w_ptr + d.to(tl.int64) * W + w, mask=md, other=0.0).to(tl.float32)
                acc += v * wv[None, :]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(y_ptr + t.to(tl.int64)[:, None] * D + dd, acc.to(y_ptr.dtype.element_ty),
                     mask=mt[:, None] & md[None, :])

        _KERNEL = causal_conv1d_kernel
    return _KERNEL


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, seq: torch.Tensor,
                         pos: torch.Tensor, starts: torch.Tensor, silu: bool) -> torch.Tensor:
    """``x [T, D]``, ``weight [D, W]``, ``conv_states [N, W-1, D]``; per token its sequence ``seq [T]`` and
    position ``pos [T]``, per sequence its first row ``starts [N]`` (int tensors on x's device). Returns
    ``y [T, D]`` in x's dtype (no autograd; runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    T, D = x.shape
    W = weight.shape[-1]
    x, weight, conv_states = x.contiguous(), weight.contiguous(), conv_states.contiguous()
    y = torch.empty_like(x)
    if T:
        import triton

        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
        _kernel()[grid](x, weight, conv_states, seq, pos, starts, y, T, D, W=W, SILU=silu, BT=BLOCK_T,
                        BD=BLOCK_D, num_warps=4)
    return y


class CausalConv1dTriton(torch.autograd.Function):
    """Forward: :func:`triton_causal_conv1d`. Backward: ``reference(x, weight, conv_states)`` (the torch
    path, differentiable) recomputed and differentiated."""

    @staticmethod
    def forward(ctx, x, weight, conv_states, seq, pos, starts, silu, reference):
        ctx.save_for_backward(x, weight, conv_states)
        ctx.reference = reference
        return triton_causal_conv1d(x, weight, conv_states, seq, pos, starts, silu)

    @staticmethod
    def backward(ctx, gy):
        x, weight, conv_states = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((x, weight, conv_states),
                                                                          ctx.needs_input_grad[:3])]
            y = ctx.reference(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, gy) if wanted else ())
        out = [next(grads) if t.requires_grad else None for t in leaves]
        return (*out, None, None, None, None, None)
