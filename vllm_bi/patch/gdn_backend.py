"""The GDN layer under batch invariance: vLLM's GDN backend and layer forward routed to vllm_bi's glue.

Stock vLLM refuses batch invariance for its GDN backend, runs a chunked prefill kernel, two different decode
kernels and a bf16 state. Under ``VLLM_BATCH_INVARIANT=1`` the backend registry points ``GDN_ATTN`` at
``model_executor.gdn.BIGDNAttentionBackend`` and every ``QwenGatedDeltaNetAttention.forward_*`` at
``model_executor.gdn.bi_gdn_forward`` (one arithmetic for prefill, decode and mixed steps, fp32 state, explicit
zero state for a new sequence). The chunk-aligned and hybrid modes widen the conv state (a block's raw rows), and
the hybrid mode needs each request's prompt length in the step's metadata: the wrappers below provide them.
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_bi.patch.engine_config import BatchInvarianceConfigError

__all__ = ["skip_qwen_gdn_warmup", "wrap_state_shape", "V1_RUNNER_ONLY", "wrap_build_attention_metadata",
           "wrap_batch_execution", "prompt_chunk_scheduled"]

logger = logging.getLogger("vllm_bi")


def skip_qwen_gdn_warmup(runner, model_config) -> None:
    """vLLM's start-up warm-up of its own Qwen GDN Triton kernels: BI mode never runs them (the GDN forward
    is vllm_bi's), and the warm-up assumes stock conv-state shapes (the chunk-aligned mode widens them)."""
    logger.info("vllm_bi: skipping vLLM's Qwen GDN Triton warm-up (those kernels are not used under BI)")


def wrap_state_shape(orig):
    """``MambaStateShapeCalculator.gated_delta_net_state_shape`` (a classmethod) in the chunk-aligned and hybrid
    modes: the conv state holds a block's raw rows (``model_executor.gdn.chunk_state_shape``)."""
    from vllm_bi.model_executor.gdn import chunk_state_shape

    return classmethod(chunk_state_shape(orig.__func__))


def wrap_build_attention_metadata(orig):
    """The hybrid GDN mode switches arithmetic at each request's prompt length, which vLLM's attention metadata
    does not carry: the model runner hands its input batch's prompt lengths to the GDN metadata builder
    (``gdn.STEP_PROMPT_LENS``) before it builds a step's metadata. And with decode CUDA graphs, a step in which
    a request is still before its switch point is never replayed from a graph (captured steps run the
    recurrence only, ``gdn._build_plan``): vLLM counts one-token prompt chunks as uniform decodes."""

    @functools.wraps(orig)
    def _build_attention_metadata(self, *args, **kwargs):
        from vllm_bi.model_executor import gdn

        gdn.STEP_PROMPT_LENS = self.input_batch.num_prompt_tokens_cpu_tensor  # rows: this step's requests
        return orig(self, *args, **kwargs)

    _build_attention_metadata._vllm_bi = True
    return _build_attention_metadata


def prompt_chunk_scheduled(input_batch, num_reqs: int) -> bool:
    """Whether a scheduled request is still before its prompt's last block boundary (the hybrid mode's switch):
    its tokens, even a single one that vLLM counts as a decode, need the chunk arithmetic."""
    from vllm_bi.gdn.chunk import hybrid_switch

    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    return bool((computed < hybrid_switch(input_batch.num_prompt_tokens[:num_reqs])).any())


def wrap_batch_execution(orig):
    import inspect

    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        if bound.arguments.get("force_uniform_decode") is None and prompt_chunk_scheduled(
                self.input_batch, bound.arguments["num_reqs"]):
            bound.arguments["force_uniform_decode"] = False  # no decode graph: the step runs eagerly
        return orig(*bound.args, **bound.kwargs)

    _determine_batch_execution_and_padding._vllm_bi = True
    return _determine_batch_execution_and_padding


def _v1_runner_only(config) -> bool:
    """``VllmConfig.use_v2_model_runner`` in the hybrid GDN mode: always False. vLLM 0.32 picks its V2 model
    runner on CUDA (``vllm/v1/worker/gpu/``), and the hybrid mode's prompt lengths and graph guard are wired into
    the V1 runner (``GPUModelRunner``, which the CPU runner also is); on the H200 the V2 runner started without
    them and the GDN metadata builder refused the step. An explicit V2 request is refused."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise BatchInvarianceConfigError(
            "vllm_bi: VLLM_BI_GDN_MODE=hybrid runs on vLLM's V1 model runner only, and VLLM_USE_V2_MODEL_RUNNER=1 "
            "asks for the V2 one. Unset VLLM_USE_V2_MODEL_RUNNER or use VLLM_BI_GDN_MODE=chunk or recurrent.")
    if not _v1_runner_only.said:
        logger.info("vllm_bi: VLLM_BI_GDN_MODE=hybrid: vLLM's V1 model runner (the hybrid mode's prompt lengths "
                    "are wired there)")
        _v1_runner_only.said = True
    return False


_v1_runner_only.said = False
V1_RUNNER_ONLY = property(_v1_runner_only)
