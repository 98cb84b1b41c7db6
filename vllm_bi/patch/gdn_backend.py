"""The GDN layer under batch invariance: vLLM's GDN backend and layer forward routed to vllm_bi's glue.

Stock vLLM refuses batch invariance for its GDN backend, runs a chunked prefill kernel, two different decode
kernels and a bf16 state. Under ``VLLM_BATCH_INVARIANT=1`` the backend registry points ``GDN_ATTN`` at
``model_executor.gdn.BIGDNAttentionBackend`` and every ``QwenGatedDeltaNetAttention.forward_*`` at
``model_executor.gdn.bi_gdn_forward`` (one arithmetic for prefill, decode and mixed steps, fp32 state, explicit
zero state for a new sequence). The chunk-aligned mode widens the conv state (a block's raw rows): the wrapper below
provides it.
"""

from __future__ import annotations

import logging

__all__ = ["skip_qwen_gdn_warmup", "wrap_state_shape", "wrap_kda_state_shape"]

logger = logging.getLogger("vllm_bi")


def skip_qwen_gdn_warmup(runner, model_config) -> None:
    """vLLM's start-up warm-up of its own Qwen GDN Triton kernels: BI mode never runs them (the GDN forward
    is vllm_bi's), and the warm-up assumes stock conv-state shapes (the chunk-aligned mode widens them)."""
    logger.info("vllm_bi: skipping vLLM's Qwen GDN Triton warm-up (those kernels are not used under BI)")


def wrap_state_shape(orig):
    """``MambaStateShapeCalculator.gated_delta_net_state_shape`` (a classmethod) in the chunk-aligned mode: the
    conv state holds a block's raw rows (``model_executor.gdn.chunk_state_shape``)."""
    from vllm_bi.model_executor.gdn import chunk_state_shape

    return classmethod(chunk_state_shape(orig.__func__))


def wrap_kda_state_shape(orig):
    """``MambaStateShapeCalculator.kda_state_shape`` (Kimi Linear's KDA layers) in the chunk-aligned mode: the same
    widening (``model_executor.gdn.chunk_kda_state_shape``)."""
    from vllm_bi.model_executor.gdn import chunk_kda_state_shape

    return classmethod(chunk_kda_state_shape(orig.__func__))
