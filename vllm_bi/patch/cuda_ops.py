"""CUDA replacements: the op library's CUDA-only entry points, and vLLM's own kernels' norm fixes.

With the op library (``VLLM_BI_CUDA_OPS=vllm_bi``, the default) a CUDA server runs the trainer's ops: the rows
shared with CPU (:mod:`~vllm_bi.patch.cpu_layers`) on ``forward_cuda`` / ``forward_native``, plus Model Runner V2's
token logprobs (:func:`token_logprobs`), TRITON_ATTN's forward (``model_executor.attention.bi_attn_forward``), and
no fused q/k-norm + RoPE kernel (:func:`wrap_attention_init`). With vLLM's own batch-invariant kernels
(``VLLM_BI_CUDA_OPS=vllm``), which cover the GEMMs, ``mean``, softmax and ``RMSNorm``, two norms still need a fix:
``RMSNormGated.forward_cuda`` (FLA's ``layer_norm_fwd`` groups rows by token count) -> vLLM's ``forward_native``,
and ``GemmaRMSNorm.forward_cuda`` (vLLM IR ``rms_norm``, provider picked at run time) -> the same formula with
vLLM's batch-invariant ``mean``.
"""

from __future__ import annotations

import torch

__all__ = ["gemma_rms_forward_cuda", "gated_rms_forward_cuda", "token_logprobs", "wrap_attention_init",
           "skip_kimi_low_latency_gemm"]


def gemma_rms_forward_cuda(self, x, residual=None):
    """``GemmaRMSNorm`` (``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32) with vLLM's BI ``mean``."""
    orig = x.dtype
    if residual is not None:
        x = x.float() + residual.float()
        residual = x.to(orig)
    x32 = x.float()
    var = torch.mean(x32 * x32, dim=-1, keepdim=True)
    out = (x32 * torch.rsqrt(var + self.variance_epsilon) * (1.0 + self.weight.float())).to(orig)
    return out if residual is None else (out, residual)


def gated_rms_forward_cuda(self, x, z=None):
    if getattr(self, "bias", None) is not None:
        raise NotImplementedError("vllm_bi: RMSNormGated with bias is not batch-invariant yet")
    return self.forward_native(x, z)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Model Runner V2's ``compute_token_logprobs`` through the op library's log-softmax."""
    from vllm_bi.ops.softmax import log_softmax

    return log_softmax(logits, dim=-1, dtype=torch.float32).gather(1, token_ids.to(torch.int64))


def wrap_attention_init(orig):
    """``Qwen3NextAttention.__init__`` with the fused gate-split + q/k-RMSNorm + RoPE kernel off
    (``use_fused_qk_norm_rope_gate``): it bypasses the patched norms and rotary, and the trainer computes them with
    the op library. Measured on the H200: with the fused kernel every attention row but the first (where RoPE is
    the identity) differed from the trainer's (``vllm-bi diag``)."""
    import functools

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.use_fused_qk_norm_rope_gate = False

    return __init__


def skip_kimi_low_latency_gemm(module, dtype) -> None:
    """``enable_kimi_k3_low_latency_gemm`` under batch invariance: no linear layer's quant method is swapped for
    vLLM's shape-selected low-latency GEMMs (on an SM90 / SM100 GPU they would replace ``bi_linear`` for every
    projection whose shape their tables list); the layers keep the op library's GEMM."""
    import logging

    logging.getLogger("vllm_bi").info("vllm_bi: Kimi's low-latency GEMMs not installed (the op library's GEMM)")
