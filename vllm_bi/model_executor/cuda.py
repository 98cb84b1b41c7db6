"""CUDA glue for vLLM 0.32 GPU builds under ``VLLM_BATCH_INVARIANT=1`` (applied by ``patches.apply_all``).

On CUDA vLLM's own batch-invariant mode (``vllm.model_executor.determinism.batch_invariant``)
already makes the GEMMs (Triton persistent matmul for ``UnquantizedLinearMethod`` and the
embedding/LM head), ``aten::mean.dim``, softmax/log_softmax, ``RMSNorm.forward_cuda`` and the
FlashAttention backend (``num_splits=1``) batch-invariant. What it leaves out, and this module
covers:

* the GDN core: ``QwenGatedDeltaNetAttention.forward_cuda`` -> ``gdn.bi_gdn_forward``, whose core
  (``gdn.bi_gdn_core``, the same code as on CPU) runs decode, prefill and mixed batches alike: the
  causal conv1d and the gating as elementwise torch ops over each sequence's own tokens, then one
  fla-core fused-recurrent launch over the packed batch (explicit fp32 state per sequence, l2norm in
  the kernel; ``attention.gdn_recurrent.gdn_recurrent_varlen``) and the final states stored back;
* ``RMSNormGated.forward_cuda`` (FLA ``layer_norm_fwd``, rows per program chosen from the token
  count) -> vLLM's ``forward_native``, whose ``mean`` is vLLM's batch-invariant Triton mean;
* ``GemmaRMSNorm.forward_cuda`` (vLLM IR ``rms_norm``, implementation chosen at run time) -> the
  same formula written with ``mean`` (vLLM's batch-invariant Triton mean);
* eager mode: the GDN core reads the scheduler's metadata on the host (``tolist``) and launches a
  per-sequence conv, so it cannot be captured in a CUDA graph or traced by torch.compile.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["apply_cuda", "apply_cuda_own_ops", "cuda_ops_mode", "own_ops_requested", "gemma_rms_forward_cuda", "gated_rms_forward_cuda"]

logger = logging.getLogger("vllm_bi")


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


def apply_cuda(patch, patched: list[str]) -> None:
    """Register the CUDA-only patches (``patch(owner, name, new)`` is ``patches._patch``)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated

    patch(GemmaRMSNorm, "forward_cuda", gemma_rms_forward_cuda)
    patch(RMSNormGated, "forward_cuda", gated_rms_forward_cuda)


# --------------------------------------------------------------------------- the op library on CUDA (default)

def cuda_ops_mode() -> str:
    """``VLLM_BI_CUDA_OPS``: which kernels a CUDA server runs under batch invariance.

    ``vllm_bi`` (default): vllm_bi's op library, the trainer's ops, so the trainer's logprobs equal the
    server's bit for bit. Measured on an H200: trainer == server on every model tested, 768/768 and 512/512
    tokens (``docs/results/2026-11-29-h200-trainer-parity.md``); GEMMs accumulate in float64 (slower).
    ``vllm``: vLLM's own batch-invariant kernels (GEMMs, norms, attention): batch-invariant serving, measured
    on an H200, but the trainer cannot reproduce their bits (1/768 equal); ``vllm-bi parity`` and the RL
    trainer refuse such a server.
    """
    from vllm_bi.settings import current

    return current().cuda_ops


def own_ops_requested() -> bool:
    """True unless ``VLLM_BI_CUDA_OPS=vllm`` (see :func:`cuda_ops_mode`)."""
    return cuda_ops_mode() == "vllm_bi"


def _token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Model Runner V2's ``compute_token_logprobs`` through the op library's log-softmax."""
    from vllm_bi.ops.softmax import log_softmax

    return log_softmax(logits, dim=-1, dtype=torch.float32).gather(1, token_ids.to(torch.int64))


def _no_fused_qk_norm_rope(patch) -> None:
    """Qwen3-Next / Qwen3.5 attention on CUDA fuses the gate split, the q/k RMSNorms and RoPE into one Triton
    kernel (``use_fused_qk_norm_rope_gate``), bypassing the patched norms and rotary; the trainer computes them
    with the op library. Measured on the H200: with the fused kernel every attention row but the first (where
    RoPE is the identity) differed from the trainer's (``vllm-bi diag``). Turn it off."""
    import functools

    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    orig = Qwen3NextAttention.__init__
    if getattr(orig, "_vllm_bi", False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.use_fused_qk_norm_rope_gate = False

    __init__._vllm_bi = True
    patch(Qwen3NextAttention, "__init__", __init__)


def apply_cuda_own_ops(patch) -> None:
    """Route linear, norms, activation, rotary, attention and returned logprobs to ``vllm_bi.ops`` on CUDA."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob

    from vllm_bi.model_executor import patches as P
    from vllm_bi.model_executor.attention import bi_attn_forward

    for cls, fn in ((GemmaRMSNorm, P._gemma_rms_forward), (RMSNorm, P._rms_forward),
                    (RMSNormGated, P._gated_rms_forward)):
        for name in ("forward_cuda", "forward_native"):
            patch(cls, name, fn)
    for name in ("forward_cuda", "forward_native"):  # whichever CustomOp dispatch picks
        patch(SiluAndMul, name, P._silu_mul_forward)
        patch(RotaryEmbedding, name, P._rotary_forward)
    P._patch_linear()
    P._patch_logprobs()
    patch(logprob, "compute_token_logprobs", _token_logprobs)
    patch(prompt_logprob, "compute_token_logprobs", _token_logprobs)
    patch(TritonAttentionImpl, "forward", bi_attn_forward)
    _no_fused_qk_norm_rope(patch)
    # Model code calls torch.sigmoid / F.silu / softmax / mean directly: in this mode they go to the op
    # library on the CUDA key too (vLLM's own overrides would give other bits than the trainer's ops).
    from vllm.model_executor.determinism import batch_invariant

    from vllm_bi.model_executor.cpu_overrides import enable_cuda_own_ops_mode

    patch(batch_invariant, "enable_batch_invariant_mode", enable_cuda_own_ops_mode)
    from vllm_bi.model_executor.cuda_moe import apply_cuda_moe

    apply_cuda_moe(patch)
