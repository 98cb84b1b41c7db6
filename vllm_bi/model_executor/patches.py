"""Every change vllm_bi makes to vLLM 0.32 under ``VLLM_BATCH_INVARIANT=1``, in one ledger.

Each entry names the patched symbol, why, how, and when it can go. They are
applied by :func:`apply_all` (from the plugin, in every vLLM process), are
idempotent, and are never applied with batch invariance off. ``patches/`` in
the repository holds the same GDN change as an upstream-style diff.

==============================================  ===========================================================
symbol                                          why / how
==============================================  ===========================================================
``selector GDN check``                          stock refuses BI for GDN_ATTN. ``register_backend`` points
                                                GDN_ATTN at ``BIGDNAttentionBackend`` (claims BI) — true
                                                only with the next entry.
``QwenGatedDeltaNetAttention.forward_cpu``      stock runs a chunked C++ prefill kernel, a different decode
                                                kernel and a bf16 state. -> ``gdn.bi_gdn_forward``: one
                                                recurrent path, fp32 state, explicit zero state.
``kernel_warmup.qwen_triton_warmup`` (CUDA)     warms vLLM's GDN Triton kernels, which BI never runs, and
                                                asserts stock conv-state shapes (chunk mode widens them).
                                                -> no-op.
``EngineArgs.create_engine_config``             fp32 SSM cache (auto -> float32, explicit other dtype ->
                                                refuse), eager mode on CPU (inductor would re-fuse the ops),
                                                speculative decoding refused.
``batch_invariant.enable_batch_invariant_mode`` CPU: stock registers Triton kernels on the CPU key.
                                                -> ``cpu_overrides`` (CPU only).
``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod`` (CPU)
                                                oneDNN/sgl GEMMs are M-dependent and drop the weight.
                                                -> keep the weight, ``ops.linear.bi_linear``.
``RowParallelLinear.forward`` (TP > 1)          partial products rounded before the all-reduce differ from
                                                TP = 1. -> exact float64 partials, gathered and added, one
                                                rounding (TP = 2 == TP = 1 == trainer); also the MoE shared
                                                expert's down projection (reduce_results=False).
``MoERunner._maybe_reduce_*`` (CPU, TP > 1)     the experts already hold exact full sums -> no all-reduce.
                                                PP > 1, MoE + EP/SP, MoE + TP on CUDA and TP with
                                                VLLM_BI_CUDA_OPS=vllm are refused
                                                (engine-config check).
``GemmaRMSNorm`` / ``RMSNorm`` / ``RMSNormGated`` (CPU)  -> ``ops.norm`` (row-wise reductions).
``SiluAndMul`` / ``RotaryEmbedding`` (CPU)      -> ``ops.activation`` / ``ops.rotary`` (same numbers as the
                                                trainer's).
``CPUUnquantizedExperts`` + ``cpu_router._softmax_topk``
                                                stock CPU experts are not BI (MoE backend refused).
                                                -> ``ops.moe`` with unpacked weights.
``topk_topp_sampler.random_sample``,           CPU generators have no offset: a seeded request whose
``TopKTopPSampler.forward_cpu``, runner         prompt is chunked kills the engine. -> per-request
``_update_states``                              generator keyed by (seed, draw index), rewindable.
``Sampler.compute_logprobs`` (CPU)              -> ``ops.softmax.log_softmax`` (the trainer's function).
``CPUAttentionBackendImpl.forward`` /        stock kernel packs the cache per ISA and tiles by batch (and
``do_kv_cache_update`` (CPU)                    died with SIGILL under BI on AVX2). -> ``ops.attention``
                                                over a plain [blocks, Hkv, block, 2D] cache layout.
``ModelRegistry`` Qwen3_5ForCausalLM (CPU),   vLLM's qwen3_5.py imports the vision tower (torchvision,
``Qwen3_5MoeForCausalLM``                       unusable with CPU torch). -> text-only classes in
                                                ``models/qwen3_5_text.py`` from Qwen3-Next's layers.
``CPUModelRunner.load_model``                   after loading, refuse any module type vllm_bi has not made
                                                batch-invariant.
``Worker.vllm_bi_weight_digest`` (new method)   lets the trainer check over ``/collective_rpc`` that the
                                                server holds its weights (``vllm_bi.weights``).
CUDA (``model_executor/cuda.py``; GEMMs, mean,   vLLM's own BI mode covers the rest on CUDA; the entries
softmax, RMSNorm, attention: vLLM's BI mode)    above marked CPU are not applied there.
``QwenGatedDeltaNetAttention.forward_cuda``     stock: FLA chunked prefill, two different decode kernels,
                                                bf16 state. -> ``gdn.bi_gdn_forward`` (as on CPU; the core
                                                runs fla-core's fused recurrent kernel, fp32 state).
``RMSNormGated.forward_cuda`` (CUDA)            FLA ``layer_norm_fwd`` groups rows by token count.
                                                -> vLLM's ``forward_native`` (BI ``mean``).
``GemmaRMSNorm.forward_cuda`` (CUDA)            vLLM IR ``rms_norm`` (provider picked at run time).
                                                -> same formula with vLLM's BI ``mean``.
``VLLM_BI_CUDA_OPS=vllm_bi`` (CUDA, default)   the CPU routing above (linear, norms, SiLU-mul, rotary,
                                                logprobs incl. Model Runner V2's ``compute_token_logprobs``)
                                                plus TRITON_ATTN's forward -> ``attention.bi_attn_forward``:
                                                the trainer's ops on the server (needed for trainer ==
                                                server on GPU), MoE (``cuda_moe``), the op-library aten
                                                overrides on the CUDA key, no fused q/k-norm + RoPE kernel.
                                                H200: trainer == server on every model tested.
                                                ``VLLM_BI_CUDA_OPS=vllm``: vLLM's BI kernels (serving only).
``EngineArgs.create_engine_config`` (CUDA)      eager mode: the GDN core reads metadata on the host;
                                                attention backend TRITON_ATTN when none is chosen (FA3
                                                decode != prefill for ~500-token contexts on H200).
``gpu_model_runner.count_nans_per_row``,        a NaN or +inf logit would be sampled and served (``nonfinite``).
V2 ``sampler.get_num_nans``,                    -> vLLM's per-request NaN count (VLLM_COMPUTE_NANS_IN_LOGITS)
``Scheduler.update_from_output``,               counts +inf too; the scheduler fails such a request (error
``GenerateBaseServing._raise_if_error``         status, HTTP 500 with a message), the others go on. On by
                                                default; VLLM_BI_NONFINITE_GUARD=0 turns it off.
==============================================  ===========================================================

Removal: each entry goes when vLLM ships the equivalent (GDN BI upstream, CPU BI mode).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from vllm_bi.attention.gdn_chunk import gdn_mode
from vllm_bi.settings import current as current_settings

__all__ = ["apply_all", "PATCHED", "BIGenerator"]

logger = logging.getLogger("vllm_bi")

PATCHED: list[str] = []


def _patch(owner, name: str, new, label: str | None = None) -> None:
    setattr(owner, name, new)
    PATCHED.append(label or f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__name__', owner)}.{name}")


# --------------------------------------------------------------------------- engine config


class BatchInvarianceConfigError(ValueError):
    """A configuration vllm_bi cannot make batch-invariant."""


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_vllm_bi", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        from vllm.platforms import current_platform

        ssm = getattr(self, "mamba_ssm_cache_dtype", "auto")
        if ssm not in ("auto", "float32", None):
            raise BatchInvarianceConfigError(
                f"vllm_bi: VLLM_BATCH_INVARIANT=1 needs a float32 GDN/SSM state cache, but "
                f"--mamba-ssm-cache-dtype is {ssm!r} (a {ssm} state is rounded at every prefill split). "
                "Fix: drop --mamba-ssm-cache-dtype or pass --mamba-ssm-cache-dtype float32."
            )
        if ssm != "float32":
            self.mamba_ssm_cache_dtype = "float32"
            logger.info("vllm_bi: batch invariance: SSM state cache dtype auto -> float32")
        if getattr(self, "speculative_config", None):
            raise BatchInvarianceConfigError(
                "vllm_bi: speculative decoding is not batch-invariant yet; remove --speculative-config "
                "or unset VLLM_BATCH_INVARIANT."
            )
        if current_platform.is_cpu() and not self.enforce_eager:
            self.enforce_eager = True
            logger.info("vllm_bi: batch invariance on CPU: eager mode (torch.compile would re-fuse the ops)")
        _hybrid_prefix_caching(self)
        _refuse_hybrid_on_cuda(current_platform)
        if current_platform.is_cuda():
            from vllm_bi.model_executor.cuda import own_ops_requested

            chosen = self.attention_backend or getattr(self.attention_config, "backend", None)
            if chosen is None:
                self.attention_backend = "TRITON_ATTN"
                logger.warning(
                    "vllm_bi: batch invariance on CUDA: attention backend TRITON_ATTN (with FLASH_ATTN, decode and "
                    "prefill logprobs differed for ~500-token contexts on an H200)"
                )
            elif "TRITON_ATTN" not in str(chosen) and own_ops_requested():
                raise BatchInvarianceConfigError(
                    f"vllm_bi: VLLM_BI_CUDA_OPS=vllm_bi routes TRITON_ATTN's attention only; the chosen backend "
                    f"{chosen} would bypass it. Drop --attention-backend or choose TRITON_ATTN.")
            elif "TRITON_ATTN" not in str(chosen):
                logger.warning(
                    "vllm_bi: attention backend %s: decode/prefill (prompt_logprobs) parity is only "
                    "measured with TRITON_ATTN on CUDA", chosen,
                )
        try:
            settings = current_settings()  # every VLLM_BI_* value checked once, here, at start-up
        except ValueError as e:
            raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
        graphs = current_platform.is_cuda() and settings.cuda_graphs == "decode"
        if graphs:
            if self.enforce_eager:
                raise BatchInvarianceConfigError(
                    "vllm_bi: VLLM_BI_CUDA_GRAPHS=decode captures decode steps, --enforce-eager forbids it; drop one")
            from vllm.config.compilation import CompilationMode, CUDAGraphMode

            self.compilation_config.mode = CompilationMode.NONE  # no torch.compile: it would re-fuse the ops
            self.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            logger.warning("vllm_bi: VLLM_BI_CUDA_GRAPHS=decode: decode steps captured in CUDA graphs, prefills "
                           "eager (experimental: check with `vllm-bi parity`)")
        elif current_platform.is_cpu() and settings.cuda_graphs != "off":
            logger.warning("vllm_bi: VLLM_BI_CUDA_GRAPHS applies to CUDA only; ignored on CPU (eager)")
        elif current_platform.is_cuda() and not self.enforce_eager:
            self.enforce_eager = True
            logger.warning(
                "vllm_bi: batch invariance on CUDA: eager mode (the BI glue plans steps on the host; "
                "VLLM_BI_CUDA_GRAPHS=decode captures decode steps, experimental)"
            )
        config = orig(self, *args, **kwargs)
        _check_parallelism(config, current_platform)
        _check_op_settings(current_platform)
        if graphs:
            _check_graphs(config)
        return config

    create_engine_config._vllm_bi = True
    _patch(EngineArgs, "create_engine_config", create_engine_config)




def _hybrid_prefix_caching(args) -> None:
    """``VLLM_BI_GDN_MODE=hybrid`` turns prefix caching off (and refuses it when asked for). A token's arithmetic
    there depends on its own request's prompt length, so a state cached by another request (a previous turn's
    generated tokens, run in the recurrence) is not the state this request would compute: a cache hit would
    change its bits."""
    try:
        hybrid = current_settings().gdn_mode == "hybrid"
    except ValueError as e:
        raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
    if not hybrid:
        return
    if args.enable_prefix_caching:
        raise BatchInvarianceConfigError(
            f"vllm_bi: VLLM_BI_GDN_MODE=hybrid cannot share prefix-cache states between requests (a token's "
            "arithmetic depends on its request's prompt length); drop --enable-prefix-caching or use "
            f"VLLM_BI_GDN_MODE=chunk or recurrent.")
    args.enable_prefix_caching = False
    logger.warning("vllm_bi: VLLM_BI_GDN_MODE=hybrid: prefix caching off (a state cached by another request would "
                   "have other bits)")


def _refuse_hybrid_on_cuda(platform) -> None:
    """``VLLM_BI_GDN_MODE=hybrid`` on CUDA: refused. The GPU gate (``docs/results/gpu-gate.json``) measured the
    trainer's logprobs equal to the served ones on only 88-98% of tokens for prompts of 5-700 words (exact on CPU on
    the same prompts), so the mode does not deliver what batch invariance claims there."""
    if platform.is_cuda() and gdn_mode() == "hybrid":
        raise BatchInvarianceConfigError(
            f"vllm_bi: VLLM_BI_GDN_MODE=hybrid is not exact on CUDA (the GPU gate measured 88-98% of tokens equal to "
            f"the trainer's, docs/results/2026-12-02-h200-chunk-nan.md); use VLLM_BI_GDN_MODE=chunk (exact, the "
            "fastest prefill) or recurrent.")


def _check_graphs(config) -> None:
    """``VLLM_BI_CUDA_GRAPHS=decode``: refuse what a captured decode step cannot run (``cuda_graphs.py``)."""
    has_moe = int(getattr(config.model_config.hf_text_config, "num_experts", 0) or 0) > 0
    why = current_settings().graph_blockers(has_moe)
    if why:
        raise BatchInvarianceConfigError("vllm_bi: VLLM_BI_CUDA_GRAPHS=decode cannot capture a decode step with "
                                         f"{'; '.join(why)}. Change those or unset VLLM_BI_CUDA_GRAPHS.")


def _check_op_settings(platform) -> None:
    """``VLLM_BI_ATTENTION``, ``VLLM_BI_MOE`` and ``VLLM_BI_GEMM_CONFIGS`` read at engine creation, so a bad value
    stops the server at start-up, not at its first request."""
    from vllm_bi.ops.attention_triton import attention_backend
    from vllm_bi.ops.gemm_configs import load_table, table_path
    from vllm_bi.ops.linear import gemm_mode
    from vllm_bi.ops.moe_triton import moe_backend

    try:
        op = attention_backend("cuda" if platform.is_cuda() else "cpu")
        moe_backend("cuda" if platform.is_cuda() else "cpu")
        tiles = table_path()  # a file or the name of a table shipped with vllm_bi
        if tiles:
            arch, shapes = load_table(tiles)
    except (ValueError, RuntimeError) as e:
        raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
    logger.info("vllm_bi: attention op %s (VLLM_BI_ATTENTION)", op)
    if tiles:
        logger.info("vllm_bi: Triton GEMM tiles for %d weight shapes (%s) from %s%s", len(shapes), arch, tiles,
                    "" if gemm_mode() == "triton" else "; unused: VLLM_BI_GEMM is not 'triton'")


def _check_parallelism(config, platform) -> None:
    par = config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if pp > 1:
        raise BatchInvarianceConfigError(
            f"vllm_bi: pipeline parallelism (--pipeline-parallel-size {pp}) is not verified batch-invariant yet; "
            "use --pipeline-parallel-size 1 or unset VLLM_BATCH_INVARIANT.")
    has_moe = int(getattr(config.model_config.hf_text_config, "num_experts", 0) or 0) > 0
    if tp == 1:
        return
    if not platform.is_cpu() and not current_settings().allow_unverified_tp:
        from vllm_bi.model_executor.cuda import own_ops_requested

        if not own_ops_requested():  # vLLM's own kernels and NCCL's all-reduce order: never measured
            raise BatchInvarianceConfigError(
                f"vllm_bi: tensor parallelism (--tensor-parallel-size {tp}) on GPU is verified with vllm_bi's op "
                "library only; unset VLLM_BI_CUDA_OPS (default vllm_bi) or use --tensor-parallel-size 1 "
                "(VLLM_BI_ALLOW_UNVERIFIED_TP=1 runs it unverified, for measuring).")
    from vllm_bi.ops.moe_triton import moe_backend

    if has_moe and (not platform.is_cpu() or par.enable_expert_parallel or par.use_sequence_parallel_moe):
        raise BatchInvarianceConfigError(
            f"vllm_bi: tensor parallelism (--tensor-parallel-size {tp}) with MoE layers is batch-invariant on "
            "CPU without expert or sequence parallelism only; use --tensor-parallel-size 1.")
    if has_moe and moe_backend("cuda" if platform.is_cuda() else "cpu") != "loop":
        raise BatchInvarianceConfigError(
            f"vllm_bi: tensor parallelism (--tensor-parallel-size {tp}) with MoE layers needs VLLM_BI_MOE=loop (its "
            "exact partial sums); set it (the CPU default) or use --tensor-parallel-size 1.")
    from vllm_bi.ops.linear import gemm_mode

    if gemm_mode() != "fp64":  # row-parallel partials are summed exactly in float64; the trainer's TP=1 GEMM
        raise BatchInvarianceConfigError(  # would be the Triton one: other bits
            f"vllm_bi: tensor parallelism (--tensor-parallel-size {tp}) needs the exact float64 GEMM; unset "
            f"VLLM_BI_GEMM (it is {gemm_mode()!r}) or use --tensor-parallel-size 1.")
    hf = config.model_config.hf_text_config
    gdn_heads = {n: int(getattr(hf, n, 0) or 0) for n in ("linear_num_key_heads", "linear_num_value_heads")}
    uneven = {n: h for n, h in gdn_heads.items() if h and h % tp}
    if uneven:
        raise BatchInvarianceConfigError(
            f"vllm_bi: tensor parallelism {tp} does not divide the model's GDN heads ({uneven}); each rank "
            "needs whole heads. Use a --tensor-parallel-size that divides them.")
    logger.info("vllm_bi: tensor parallelism %d: row-parallel layers all-reduce exact float64 partial sums", tp)


# --------------------------------------------------------------------------- GDN


def _patch_gdn() -> None:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

    from vllm_bi.model_executor.gdn import bi_gdn_forward

    register_backend(
        MambaAttentionBackendEnum.GDN_ATTN,
        "vllm_bi.model_executor.gdn.BIGDNAttentionBackend",
        is_mamba=True,
    )
    PATCHED.append("registry: GDN_ATTN -> vllm_bi.model_executor.gdn.BIGDNAttentionBackend")
    for name in ("forward_cpu", "forward_cuda", "forward_hip", "forward_xpu"):
        if hasattr(QwenGatedDeltaNetAttention, name):
            _patch(QwenGatedDeltaNetAttention, name, bi_gdn_forward)
    try:
        from vllm.model_executor.warmup import kernel_warmup
    except ImportError:
        kernel_warmup = None
    if kernel_warmup is not None and hasattr(kernel_warmup, "qwen_triton_warmup"):
        _patch(kernel_warmup, "qwen_triton_warmup", _skip_qwen_gdn_warmup)
    if gdn_mode() in ("chunk", "hybrid"):
        if gdn_mode() == "hybrid":
            _patch_prompt_lens()
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

        from vllm_bi.model_executor.gdn import chunk_state_shape

        orig = MambaStateShapeCalculator.__dict__["gated_delta_net_state_shape"].__func__
        if not getattr(orig, "_vllm_bi", False):
            _patch(MambaStateShapeCalculator, "gated_delta_net_state_shape", classmethod(chunk_state_shape(orig)))


def _wrap_build_attention_metadata(orig):
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
    from vllm_bi.attention.gdn_chunk import hybrid_switch

    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    return bool((computed < hybrid_switch(input_batch.num_prompt_tokens[:num_reqs])).any())


def _wrap_batch_execution(orig):
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


def _patch_prompt_lens() -> None:
    """The hybrid GDN mode switches arithmetic at each request's prompt length, which vLLM's attention metadata
    does not carry: the model runner hands its input batch's prompt lengths to the GDN metadata builder
    (``gdn.STEP_PROMPT_LENS``) before it builds a step's metadata. And with decode CUDA graphs, a step in which
    a request is still before its switch point is never replayed from a graph (captured steps run the
    recurrence only, ``gdn._build_plan``): vLLM counts one-token prompt chunks as uniform decodes."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(VllmConfig.use_v2_model_runner.fget, "_vllm_bi", False):
        _patch(VllmConfig, "use_v2_model_runner", property(_v1_runner_only))
    if not getattr(GPUModelRunner._build_attention_metadata, "_vllm_bi", False):
        _patch(GPUModelRunner, "_build_attention_metadata",
               _wrap_build_attention_metadata(GPUModelRunner._build_attention_metadata))
    if not getattr(GPUModelRunner._determine_batch_execution_and_padding, "_vllm_bi", False):
        _patch(GPUModelRunner, "_determine_batch_execution_and_padding",
               _wrap_batch_execution(GPUModelRunner._determine_batch_execution_and_padding))


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


_v1_runner_only._vllm_bi = True
_v1_runner_only.said = False


def _skip_qwen_gdn_warmup(runner, model_config) -> None:
    """vLLM's start-up warm-up of its own Qwen GDN Triton kernels: BI mode never runs them (the GDN forward
    is vllm_bi's), and the warm-up assumes stock conv-state shapes (the chunk-aligned mode widens them)."""
    logger.info("vllm_bi: skipping vLLM's Qwen GDN Triton warm-up (those kernels are not used under BI)")


# --------------------------------------------------------------------------- models

QWEN3_5_TEXT = {
    "Qwen3_5ForCausalLM": "vllm_bi.model_executor.models.qwen3_5_text:Qwen3_5TextForCausalLM",
    "Qwen3_5MoeForCausalLM": "vllm_bi.model_executor.models.qwen3_5_text:Qwen3_5MoeTextForCausalLM",
}


def _register_models() -> None:
    from vllm import ModelRegistry

    for arch, path in QWEN3_5_TEXT.items():
        ModelRegistry.register_model(arch, path)
        PATCHED.append(f"registry: {arch} -> {path}")


# --------------------------------------------------------------------------- CPU op library routing


def _patch_cpu_overrides() -> None:
    from vllm.model_executor.determinism import batch_invariant

    from vllm_bi.model_executor.cpu_overrides import enable_cpu_batch_invariant_mode

    _patch(batch_invariant, "enable_batch_invariant_mode", enable_cpu_batch_invariant_mode)


def _bi_linear_apply(self, layer, x, bias=None):
    from vllm_bi.ops.linear import bi_linear

    return bi_linear(x, layer.weight, bias)


def _keep_weight(self, layer) -> None:
    return None


def _exact_tp_sum(y64: torch.Tensor) -> torch.Tensor:
    """Sum a float64 tensor over the TP ranks. vLLM's CPU all-reduce has no float64, so the partials are
    all-gathered bit for bit (as float32 pairs) and added locally; exact partials sum exactly in any order."""
    from vllm.distributed import get_tp_group

    rows, cols = y64.shape
    parts = get_tp_group().all_gather(y64.contiguous().view(torch.float32), dim=0)  # [tp*rows, 2*cols]
    return parts.view(torch.float64).reshape(-1, rows, cols).sum(dim=0)


def _is_shared_expert(layer) -> bool:
    return getattr(layer, "prefix", "").endswith("shared_expert.down_proj")


def _row_parallel_forward(orig):
    """TP > 1: each rank's partial product is an exact float64 sum, the ranks' exact partials are added
    (exactly, so in any order), and the result is rounded once: the same bits as TP = 1."""

    @functools.wraps(orig)
    def forward(self, input_):
        # reduce_results=False leaves the sum to the caller; the one such caller under BI is the MoE
        # shared expert, whose runner-side all-reduce is skipped: its down projection is summed exactly here.
        if self.tp_size == 1 or not (self.reduce_results or _is_shared_expert(self)):
            return orig(self, input_)
        from vllm.distributed import split_tensor_along_last_dim

        x = input_ if self.input_is_parallel else split_tensor_along_last_dim(
            input_, num_partitions=self.tp_size)[self.tp_rank].contiguous()
        lead = x.shape[:-1]
        y = torch.mm(x.reshape(-1, x.shape[-1]).to(torch.float64), self.weight.to(torch.float64).t())
        y = _exact_tp_sum(y)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias.to(torch.float64)
        out = y.to(input_.dtype).reshape(*lead, y.shape[-1])
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)

    forward._vllm_bi = True
    return forward


def _patch_linear() -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        _patch(cls, "process_weights_after_loading", _keep_weight)
        _patch(cls, "apply", _bi_linear_apply)
    if not getattr(RowParallelLinear.forward, "_vllm_bi", False):
        _patch(RowParallelLinear, "forward", _row_parallel_forward(RowParallelLinear.forward))


def _gemma_rms_forward(self, x, residual=None):
    from vllm_bi.ops.norm import rms_norm_maybe_residual

    return rms_norm_maybe_residual(x, residual, self.weight.float() + 1.0, self.variance_epsilon)


def _rms_forward(self, x, residual=None):
    from vllm_bi.ops.norm import rms_norm_maybe_residual

    if getattr(self, "variance_size_override", None) is not None:
        raise NotImplementedError("vllm_bi: RMSNorm with variance_size_override is not batch-invariant yet")
    weight = self.weight.data if getattr(self, "has_weight", True) else None
    return rms_norm_maybe_residual(x, residual, weight, self.variance_epsilon)


def _gated_rms_forward(self, x, z=None):
    from vllm_bi.ops.norm import gated_rms_norm

    if getattr(self, "bias", None) is not None:
        raise NotImplementedError("vllm_bi: RMSNormGated with bias is not batch-invariant yet")
    return gated_rms_norm(x, z, self.weight, self.eps, self.norm_before_gate, self.activation, self.group_size)


def _silu_mul_forward(self, x):
    from vllm_bi.ops.activation import silu_mul

    return silu_mul(x)


def _rotary_forward(self, positions, query, key=None, *args, **kwargs):
    from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache

    if args or kwargs.get("offsets") is not None:
        raise NotImplementedError("vllm_bi: rotary embedding with offsets is not batch-invariant yet")
    if type(self).__name__ != "RotaryEmbedding":
        raise NotImplementedError(f"vllm_bi: {type(self).__name__} is not batch-invariant yet")
    cache = rope_cos_sin_cache(self.rotary_dim, self.max_position_embeddings, self.base, positions.device)
    return apply_rotary(positions, query, key, cache, self.head_size, self.rotary_dim, self.is_neox_style)


def _patch_layers(cpu: bool) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    names = ("forward_native", "forward_cpu") if cpu else ("forward_native",)
    for name in names:
        _patch(GemmaRMSNorm, name, _gemma_rms_forward)
        _patch(RMSNorm, name, _rms_forward)
        _patch(RMSNormGated, name, _gated_rms_forward)
    if cpu:
        _patch(SiluAndMul, "forward_cpu", _silu_mul_forward)
        _patch(RotaryEmbedding, "forward_cpu", _rotary_forward)


def _patch_attention_cpu() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_bi.model_executor.attention import bi_cpu_attn_forward, bi_cpu_kv_cache_update

    _patch(CPUAttentionBackendImpl, "forward", bi_cpu_attn_forward)
    _patch(CPUAttentionBackendImpl, "do_kv_cache_update", bi_cpu_kv_cache_update)


# --------------------------------------------------------------------------- MoE (CPU)


def _experts_apply(
    self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
    expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
    apply_router_weight_on_input,
):
    from vllm_bi.ops.moe import moe_experts

    if expert_map is not None:
        raise NotImplementedError("vllm_bi: expert parallelism is not batch-invariant yet")
    if str(getattr(activation, "name", activation)).upper() not in ("SILU",):
        raise NotImplementedError(f"vllm_bi: MoE activation {activation} is not batch-invariant yet")
    from vllm.distributed import get_tensor_model_parallel_world_size

    # TP: w1/w2 hold this rank's slice of each expert's intermediate dim; the down projections' exact
    # partials are summed over the ranks before rounding, so every rank holds the TP = 1 result (and the
    # MoE runner's all-reduce is skipped, see _moe_runner_reductions).
    exact = _exact_tp_sum if get_tensor_model_parallel_world_size() > 1 else None
    output.copy_(moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
                             sum_partials=exact))


def _moe_runner_reductions() -> None:
    """Under TP the routed experts and the shared expert already hold exact full sums on every rank
    (``_experts_apply``, ``_row_parallel_forward``): the runner's all-reduces would add them twice."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    final, shared = MoERunner._maybe_reduce_final_output, MoERunner._maybe_reduce_shared_expert_output
    if getattr(final, "_vllm_bi", False):
        return

    @functools.wraps(final)
    def _maybe_reduce_final_output(self, states, trunc_size, output_is_reduced=None):
        if self.moe_config.tp_size > 1:
            return final(self, states, trunc_size, True)
        return final(self, states, trunc_size, output_is_reduced)

    @functools.wraps(shared)
    def _maybe_reduce_shared_expert_output(self, shared_output, fused_output_is_reduced=None):
        if self.moe_config.tp_size > 1:
            return shared_output
        return shared(self, shared_output, fused_output_is_reduced)

    _maybe_reduce_final_output._vllm_bi = True
    _patch(MoERunner, "_maybe_reduce_final_output", _maybe_reduce_final_output)
    _patch(MoERunner, "_maybe_reduce_shared_expert_output", _maybe_reduce_shared_expert_output)


def _patch_moe_cpu() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from vllm_bi.ops.moe import softmax_topk

    _patch(CPUUnquantizedExperts, "_supports_batch_invariance", staticmethod(lambda: True))
    _patch(CPUUnquantizedExperts, "process_weights_after_loading", _keep_weight)
    _patch(CPUUnquantizedExperts, "apply", _experts_apply)
    _patch(cpu_router, "_softmax_topk", softmax_topk)
    _moe_runner_reductions()


# --------------------------------------------------------------------------- sampling (CPU)


class BIGenerator(torch.Generator):
    """A per-request CPU generator whose draws are keyed by (seed, draw index).

    vLLM rewinds a request's generator with ``set_offset(get_offset() - 4)``
    when a step's sample is discarded (partial prefill). CPU generators have no
    offset; this one counts draws instead (4 offset units per draw, as on
    CUDA), and :func:`_random_sample` seeds a fresh generator from
    ``(seed, index)`` for each draw, so the noise for output token i is the
    same however the prompt was chunked or batched.
    """

    def __new__(cls, seed: int):
        return super().__new__(cls, "cpu")

    def __init__(self, seed: int):
        self.manual_seed(seed)
        self.bi_seed = int(seed)
        self.bi_draws = 0

    def get_offset(self) -> int:
        return 4 * self.bi_draws

    def set_offset(self, offset: int) -> None:
        self.bi_draws = int(offset) // 4

    def next_draw_generator(self) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed((self.bi_seed * 1_000_003 + self.bi_draws) % (2**63))
        self.bi_draws += 1
        return g


def _random_sample(probs, generators, use_fp64_gumbel: bool = False):
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    q = tts.empty_exponential_noise_like(probs, use_fp64_gumbel)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, gen in generators.items():
        if isinstance(gen, BIGenerator):
            q[i].exponential_(generator=gen.next_draw_generator())
        else:
            q[i].exponential_(generator=gen)
    return tts.sample_with_exponential_noise(probs, q)


def _draw_seed(gen: torch.Generator) -> int:
    g = gen.next_draw_generator() if isinstance(gen, BIGenerator) else gen
    return int(torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long).item())


def _sampler_forward_cpu(self, logits, generators, k, p):
    """vLLM's CPU Gumbel-max sampler, with each seeded request's noise seed drawn by (seed, draw index)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if self.use_fp64_gumbel:
        raise NotImplementedError("vllm_bi: --use-fp64-gumbel is not supported under batch invariance on CPU")
    logits = apply_top_k_top_p(logits, k, p)
    to_return = None
    if self.logprobs_mode == "processed_logits":
        to_return = logits
    elif self.logprobs_mode == "processed_logprobs":
        from vllm_bi.ops.softmax import log_softmax

        to_return = log_softmax(logits, dim=-1, dtype=torch.float32)
    seeds = torch.randint(0, 2**31, (logits.shape[0],), dtype=torch.long)
    for i, gen in generators.items():
        seeds[i] = _draw_seed(gen)
    return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32), seeds), to_return


def _wrap_update_states(orig):
    @functools.wraps(orig)
    def _update_states(self, scheduler_output):
        result = orig(self, scheduler_output)
        for idx, gen in list(self.input_batch.generators.items()):
            if isinstance(gen, BIGenerator):
                continue
            req_id = self.input_batch.req_ids[idx]
            state = self.requests.get(req_id)
            seed = getattr(getattr(state, "sampling_params", None), "seed", None)
            if seed is None:
                continue
            bi = BIGenerator(seed)
            self.input_batch.generators[idx] = bi
            state.generator = bi
        return result

    _update_states._vllm_bi = True
    return _update_states


def _patch_sampling_cpu() -> None:
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    _patch(topk_topp_sampler, "random_sample", _random_sample)
    _patch(topk_topp_sampler.TopKTopPSampler, "forward_cpu", _sampler_forward_cpu)
    if not getattr(CPUModelRunner._update_states, "_vllm_bi", False):
        _patch(CPUModelRunner, "_update_states", _wrap_update_states(CPUModelRunner._update_states))


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    from vllm_bi.ops.softmax import log_softmax

    return log_softmax(logits, dim=-1, dtype=torch.float32)


def _patch_logprobs() -> None:
    from vllm.v1.sample.sampler import Sampler

    _patch(Sampler, "compute_logprobs", staticmethod(_compute_logprobs))


# --------------------------------------------------------------------------- model audit (CPU)


def _wrap_load_model(orig):
    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        from vllm_bi.model_executor.audit import audit_model

        audit_model(self.model)
        return result

    load_model._vllm_bi = True
    return load_model


def _patch_audit_cpu() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if not getattr(CPUModelRunner.load_model, "_vllm_bi", False):
        _patch(CPUModelRunner, "load_model", _wrap_load_model(CPUModelRunner.load_model))


# --------------------------------------------------------------------------- entry


_APPLIED = False


# --------------------------------------------------------------------------- weight digest RPC


def _worker_weight_digest(self) -> dict[str, str]:
    from vllm_bi.weights import weight_digest

    return weight_digest(self.model_runner.get_model().named_parameters())


def _worker_info(self) -> dict:
    """What a trainer must agree with to reproduce this server's bits (``/collective_rpc vllm_bi_info``)."""
    from vllm_bi import __version__
    from vllm_bi.attention.gdn_chunk import CHUNK

    from vllm.platforms import current_platform

    device = "cuda" if current_platform.is_cuda() else "cpu"
    graphs = "NONE"  # CPU: no CUDA graphs, whatever the config says
    if device == "cuda":
        graphs = getattr(getattr(getattr(self, "vllm_config", None), "compilation_config", None), "cudagraph_mode", None)
    # the settings' arithmetic dict (vllm_bi.settings), and what else a trainer checks
    return {"vllm_bi": __version__, **current_settings().arithmetic(device), "chunk": CHUNK, "device": device,
            "cuda_graphs": str(getattr(graphs, "name", graphs))}


def _patch_worker_rpc() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    if not hasattr(Worker, "vllm_bi_weight_digest"):
        _patch(Worker, "vllm_bi_weight_digest", _worker_weight_digest)
    if not hasattr(Worker, "vllm_bi_info"):
        _patch(Worker, "vllm_bi_info", _worker_info)


def apply_all() -> list[str]:
    """Apply every patch for the current platform (idempotent). Returns the ledger of patched symbols."""
    global _APPLIED
    if _APPLIED:
        return PATCHED
    from vllm.platforms import current_platform

    # Processes that never run the model (e.g. the model-inspection subprocess) may see an
    # unspecified platform; only an accelerator platform is refused.
    cpu = not (current_platform.is_cuda_alike() or current_platform.is_xpu())
    # CUDA: serving parity measured on an H200 (docs/results/2026-11-29-h200-vllm-serving.md).
    # ROCm and XPU: never run; refused unless explicitly allowed.
    verified = cpu or current_platform.is_cuda()
    if not verified and not current_settings().allow_unverified_device:
        raise RuntimeError(
            f"vllm_bi: batch invariance is implemented for the CPU and CUDA builds of vLLM; "
            f"the current platform is {current_platform.device_name!r}, which was never verified. "
            "Unset VLLM_BATCH_INVARIANT to run stock vLLM."
        )
    _patch_engine_args()
    _patch_gdn()
    _patch_worker_rpc()
    from vllm_bi.model_executor.nonfinite import apply_nonfinite_guard

    apply_nonfinite_guard(_patch)
    if current_platform.is_cuda():
        from vllm_bi.model_executor.cuda import apply_cuda, apply_cuda_own_ops, own_ops_requested

        if own_ops_requested():
            apply_cuda_own_ops(_patch)
        else:
            apply_cuda(_patch, PATCHED)
    if cpu:
        _register_models()
        _patch_layers(cpu)
        _patch_logprobs()
        _patch_cpu_overrides()
        _patch_linear()
        _patch_moe_cpu()
        _patch_attention_cpu()
        _patch_sampling_cpu()
        _patch_audit_cpu()
    _APPLIED = True
    return PATCHED
