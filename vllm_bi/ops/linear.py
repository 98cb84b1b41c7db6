"""Batch-invariant GEMM: ``y = x @ W.T (+ b)``.

The product is accumulated in float64, on CPU and on CUDA alike. Every bf16×bf16 product is exact
in float64 (16 significant bits), and so is their sum as long as the terms
span fewer than ~2^37 in magnitude (53 − 16 bits) — always true for trained
and random-init weights and activations. An exact sum has no order, so the
result for a row cannot depend on the number of rows, the BLAS kernel MKL or
oneDNN picks for that M, the thread count, or which process computes it; it
is then rounded once to the output dtype. (fp32 operands: products are exact,
sums are within one float64 ulp of exact, and the single rounding to fp32
hides that except on an exact rounding tie.)

On CUDA the float64 GEMM costs 12-13x cuBLAS bf16 at large M (the H200's fp64/bf16 tensor throughput
ratio; ``docs/results/2026-11-29-h200-bi-gemm.md``), and it is the ``portable`` preset's. CUDA's default
(``VLLM_BI_GEMM=auto`` -> ``triton``; 1.0-2.0x cuBLAS at Qwen3.5-9B's shapes with the H200 tiles shipped as
``h200-qwen3.5-9b``, the default table) computes bf16 x bf16 -> bf16 products instead with vLLM's batch-invariant Triton persistent matmul
(fixed tiles, no split-K, one shape-wide BLOCK_K: a row's bits cannot depend on M). Server and trainer then
share that kernel; both must set the same mode (``vllm_bi_info`` reports it; ``vllm-bi parity`` checks it).
Its tiles per weight shape and batch-size bucket can be tuned (``VLLM_BI_GEMM_CONFIGS``, :mod:`.gemm_configs`).
Products asked for in another output dtype (the fp32 lm_head) stay in float64; tensor parallelism is refused
in this mode (its row-parallel partials are float64 sums, the trainer's unsharded GEMM would not be).

cuBLAS with split-K off (vLLM 0.32's own Hopper batch-invariant settings) is not a mode: measured on an H100, a row
of a 64-column GEMM still changed with the batch size, and it took 2-3x cuBLAS's default time at small batches
(``docs/results/2026-12-07-h100-cublas-bits-bf16-state-and-gdn-glue.md``).

Under autograd (the trainer) the forward is unchanged, bit for bit; the backward products need accuracy, not
bits, and run on bf16 tensor cores with fp32 accumulation on CUDA (fp32 elsewhere) in either mode.
"""

from __future__ import annotations

import torch

__all__ = ["gemm_mode", "bi_linear", "bi_mm", "bi_bmm", "NO_SPLIT_K_ENV"]

# cuBLAS's workspace too small for split-K (vLLM 0.32's settings on Hopper and Blackwell), for GEMMs left outside the
# op library. cuBLAS reads them when a process makes its first handle.
NO_SPLIT_K_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def gemm_mode(device: str = "cuda") -> str:
    """The GEMM arithmetic on ``device``: ``fp64`` (exact float64 accumulation; CPU tensors always) or ``triton``
    (CUDA bf16/fp16 GEMMs through vLLM's batch-invariant persistent matmul; the CUDA default). ``VLLM_BI_GEMM``
    chooses; server and trainer must agree (:mod:`vllm_bi.settings`)."""
    from vllm_bi.settings import current

    return current().gemm_on(device)


class _PersistentLinear(torch.autograd.Function):
    """``x @ weight.T (+ bias)`` by vLLM's batch-invariant Triton persistent matmul (the forward the server and
    the trainer share); backward by :func:`_grads` (gradients need no bit parity)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _persistent_mm(x, weight.t(), bias)

    @staticmethod
    def backward(ctx, gy):
        return _grads(ctx, gy)


def _grads(ctx, gy: torch.Tensor):
    """Gradients of ``y = x @ weight.T (+ bias)`` for the trainer: products in the operands' 16-bit dtype with
    fp32 accumulation where ``gy`` has it on CUDA (tensor cores), else in fp32. Gradients need accuracy, not
    bits (the float64 GEMM would cost 12x on the GPU)."""
    x, weight = ctx.saved_tensors
    if gy.is_cuda and gy.dtype == x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        g, xx, ww = gy, x, weight
    else:
        g, xx, ww = gy.float(), x.float(), weight.float()
    gx = torch.mm(g, ww).to(x.dtype) if ctx.needs_input_grad[0] else None
    gw = torch.mm(g.t(), xx).to(weight.dtype) if ctx.needs_input_grad[1] else None
    gb = gy.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
    return gx, gw, gb


class _ExactLinear(torch.autograd.Function):
    """The float64 GEMM under autograd (the trainer): forward exactly :func:`bi_linear`'s (the server's bits),
    backward by :func:`_grads`."""

    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype):
        ctx.save_for_backward(x2, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _fp64_linear(x2, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, gy):
        return (*_grads(ctx, gy), None)


def _fp64_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    y = torch.mm(x2.to(torch.float64), weight.to(torch.float64).t())
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def _persistent_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm.model_executor.determinism.batch_invariant import matmul_persistent

    from vllm_bi.ops.gemm_configs import consistent_tiles, install_gemm_configs

    install_gemm_configs()  # VLLM_BI_GEMM_CONFIGS's tiles, if any (once per process)
    consistent_tiles(b.shape[1], b.shape[0])  # one BLOCK_K per K: a fused layer gives its parts' bits
    return matmul_persistent(a, b, bias)


def _check_device(*ts: torch.Tensor) -> None:
    for t in ts:
        if t is not None and t.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"vllm_bi.ops.linear: no batch-invariant GEMM for device {t.device.type!r} (float64 needed: cpu, cuda)"
            )


def bi_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[..., K] @ weight[N, K].T + bias[N]`` -> ``[..., N]`` in ``out_dtype`` (default x.dtype)."""
    _check_device(x, weight, bias)
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    if (x.is_cuda and out_dtype == x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and (bias is None or bias.dtype == x.dtype)):
        mode = gemm_mode()
        if mode == "triton":
            y = _PersistentLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
            return y.reshape(*lead, weight.shape[0])
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        y = _ExactLinear.apply(x2, weight, bias, out_dtype)
    else:
        y = _fp64_linear(x2, weight, bias, out_dtype)
    return y.reshape(*lead, weight.shape[0])


def bi_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` with exact (float64) accumulation."""
    _check_device(a, b)
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    return torch.mm(a.to(torch.float64), b.to(torch.float64)).to(out_dtype)


def bi_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a[B, M, K] @ b[B, K, N]``, each batch entry by :func:`bi_mm` (no batch-wide kernel choice)."""
    _check_device(a, b)
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    if a.shape[0] == 0:
        return a.new_empty((0, a.shape[1], b.shape[2]), dtype=out_dtype)
    return torch.stack([bi_mm(a[i], b[i], out_dtype) for i in range(a.shape[0])])
