"""The ledger: every change vllm_bi makes to vLLM 0.32 under ``VLLM_BATCH_INVARIANT=1``, as data.

Each :class:`Patch` names the vLLM symbol it replaces (``module:Qualified.attribute``, or a registry entry
``module:REGISTRY[key]``), the platform and settings under which it applies, why stock vLLM is not batch-invariant
there, how vllm_bi replaces it, the upstream pull request that would retire it (or ``none``), and the condition
for removing it. :func:`apply_all` applies exactly the rows that are active for this process, from this table and
nothing else; ``tests/test_patch_ledger.py`` compares the rows with the vLLM attributes that actually differ from a
pristine import in a served model, so an unlisted patch, or a listed one that no longer applies, fails CI.

``python -m vllm_bi.patch.ledger --write docs/patches.md`` writes the ledger as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.abc
import inspect
import logging
import sys

__all__ = ["Patch", "LEDGER", "active_rows", "apply_all", "apply_row", "applied", "resolve", "ledger_table"]

logger = logging.getLogger("vllm_bi")

ALL, CPU, CUDA = "all", "cpu", "cuda"
# when: a settings condition (see active_rows)
OWN_OPS = "op library"          # CPU always; CUDA with VLLM_BI_CUDA_OPS=vllm_bi (default)
VLLM_OPS = "vLLM's BI kernels"  # CUDA with VLLM_BI_CUDA_OPS=vllm
CHUNK_MODE = "chunk GDN mode"
GUARD = "non-finite guard on"   # VLLM_BI_NONFINITE_GUARD (default on)
TUNE = "Triton GEMM, tuned tiles"  # VLLM_BI_GEMM_CONFIGS=tune with the Triton GEMM (CUDA)
SPEC_CUDA = "speculative decoding on CUDA"  # VLLM_BI_CUDA_PREVIEW=speculative until a GPU gate covers it
KIMI = "Kimi Linear on the device"  # CPU always; CUDA with Settings.cuda_feature("kimi-linear")
ONE_TOKEN_CUDA = "one-token prompts under speculation on CUDA"  # Settings.cuda_feature("speculative-one-token")
API_SERVER = "API server process"  # the process that imported vLLM's API server (not the engine, not the workers)
_API_ENTRY = "vllm.entrypoints.launchers.api_server.entry"

NO_PR = "none"
GDN_PR = "none (vLLM's batch-invariant GDN work leaves the CPU path and trainer parity out)"
UPSTREAM_BI = "vLLM ships a batch-invariant CPU path for this op with the trainer's arithmetic"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to vLLM. ``new`` is ``module:name`` of the replacement (or, with ``wraps``, of a function that
    builds it from the original). ``kind``: ``attr`` (set an attribute), ``backend`` (vLLM's attention-backend
    registry), ``model`` (vLLM's model registry), ``on_import`` (set an attribute once vLLM imports the target's
    module: for a module that must not be imported before the engine starts)."""

    target: str
    platform: str
    why: str
    how: str
    new: str
    upstream: str = NO_PR
    remove_when: str = UPSTREAM_BI
    wraps: bool = False
    when: str = ""
    kind: str = "attr"


P = Patch
_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention"
_NORMS = "vllm.model_executor.layers.layernorm"
_LINEAR = "vllm.model_executor.layers.linear"
_ROTARY = "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding"
_SILU = "vllm.model_executor.layers.activation:SiluAndMul"
_ROUTER = "vllm.model_executor.layers.fused_moe.router"
_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner"
_CL = "vllm_bi.patch.cpu_layers"
_NORM_WHY = "vLLM's fused norm kernels pick their reduction by batch size; the trainer's norm is the op library's"

LEDGER: tuple[Patch, ...] = (
    # ------------------------------------------------------------------ engine config
    P("vllm.engine.arg_utils:EngineArgs.create_engine_config", ALL,
      "stock accepts settings that break batch invariance (bf16 SSM state, speculative decoding, torch.compile on "
      "CPU, parallel layouts whose sums are not exact)",
      "fp32 SSM state, eager CPU, CUDA graphs only for decode, settings validated, refusals with the fix "
      "(engine_config)", "vllm_bi.patch.engine_config:wrap_create_engine_config", wraps=True,
      remove_when="never: it is where vllm_bi refuses what it cannot make exact"),
    # ------------------------------------------------------------------ GDN backend
    P("vllm.v1.attention.backends.registry:_MAMBA_ATTN_OVERRIDES[MambaAttentionBackendEnum.GDN_ATTN]", ALL,
      "stock refuses batch invariance for GDN_ATTN", "registered as BIGDNAttentionBackend, which claims it (true "
      "only with the forward rows below)", "vllm_bi.model_executor.gdn:BIGDNAttentionBackend", GDN_PR,
      "vLLM's GDN backend is batch-invariant on every platform with the trainer's arithmetic", kind="backend"),
    *(P(f"{_GDN}.{name}", ALL,
        "stock runs a chunked prefill kernel, different decode kernels and a bf16 state",
        "model_executor.gdn.bi_gdn_forward: one arithmetic per GDN mode, fp32 state, explicit zero state",
        "vllm_bi.model_executor.gdn:bi_gdn_forward", GDN_PR,
        "vLLM's GDN forward is batch-invariant with the trainer's arithmetic")
      for name in ("forward_cpu", "forward_cuda", "forward_hip", "forward_xpu")),
    P("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention.forward", ALL,
      "stock runs Triton KDA kernels (no CPU forward) whose chunked prefill and decode give other bits, and a "
      "CUDA-only state gather",
      "model_executor.gdn.bi_kda_forward: the trainer's KDA layer over the GDN core (recurrent or chunk mode on "
      "CPU, recurrent on CUDA), fp32 state",
      "vllm_bi.model_executor.gdn:bi_kda_forward", GDN_PR,
      "vLLM's KDA forward is batch-invariant with the trainer's arithmetic", when=KIMI),
    # on import: importing the Kimi package before the worker starts pulls in numba, whose module objects vLLM's CPU
    # kernel-override scan at worker start cannot read
    P("vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention.forward", ALL,
      "stock attends in two arithmetics: prefill over decompressed keys and values, decode in the weight-absorbed "
      "latent form (and CPU_MLA's kernels serve one head size and block size)",
      "model_executor.attention.bi_mla_forward: the trainer's MLA, the cached latents decompressed per row and "
      "attended by the op library's attention in prefill and decode alike",
      "vllm_bi.model_executor.attention:bi_mla_forward", NO_PR,
      "vLLM's MLA serves prefill and decode in one batch-invariant arithmetic with the trainer's", when=KIMI,
      kind="on_import"),
    P("vllm.models.kimi_k3.nvidia.model:enable_kimi_k3_low_latency_gemm", CUDA,
      "on SM90 / SM100 GPUs Kimi's model swaps the quant method of every linear layer whose shape vLLM's tables list "
      "for a shape-selected low-latency GEMM", "not installed: the layers keep the op library's GEMM",
      "vllm_bi.patch.cuda_ops:skip_kimi_low_latency_gemm", when=KIMI, kind="on_import",
      remove_when="vLLM installs no low-latency GEMM under VLLM_BATCH_INVARIANT=1"),
    P("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size", CPU,
      "CPU_MLA's decode kernel serves block size 16 only, below the block a hybrid model's state pages need",
      "any block size: the batch-invariant MLA forward reads the latent cache itself",
      "vllm_bi.model_executor.attention:MLA_ANY_BLOCK_SIZE", remove_when="the MLA forward row goes"),
    P("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.get_supported_kernel_block_sizes", CPU,
      "CPU_MLA splits each cache block into kernel blocks of 16; vLLM's CPU runner then zeroes a new block by its "
      "id in the split cache, which is another request's kernel block", "kernel blocks are whole cache blocks",
      "vllm_bi.model_executor.attention:MLA_WHOLE_BLOCKS", remove_when="the MLA forward row goes"),
    P("vllm.platforms.cpu:CpuPlatform.check_and_update_config", CPU,
      "vLLM's CPU platform turns chunked prefill and prefix caching off for every MLA model (its MLA kernels have no "
      "chunked context)",
      "a Kimi Linear model keeps both, and its step token budget: the batch-invariant MLA forward reads every row's "
      "keys from the latent cache", "vllm_bi.patch.engine_config:wrap_cpu_platform_config", wraps=True,
      remove_when="the MLA forward row goes"),
    P("vllm.model_executor.layers.attention.mla_attention:MLACommonMetadataBuilder.build", ALL,
      "the MLA metadata splits the step's block table and lengths between its decode and prefill parts",
      "the whole step's lengths and block table kept on the metadata for the batch-invariant MLA forward (an "
      "extra field: the metadata vLLM's own MLA backends read is unchanged)",
      "vllm_bi.model_executor.attention:wrap_mla_build", wraps=True, when=KIMI,
      remove_when="the MLA forward row goes"),
    P("vllm.model_executor.warmup.kernel_warmup:qwen_triton_warmup", ALL,
      "warms vLLM's GDN Triton kernels, which BI never runs, and assumes stock conv-state shapes",
      "a no-op that logs why", "vllm_bi.patch.gdn_backend:skip_qwen_gdn_warmup",
      remove_when="the GDN forward rows go"),
    P("vllm.model_executor.layers.mamba.mamba_utils:MambaStateShapeCalculator.gated_delta_net_state_shape", ALL,
      "the chunk-aligned mode keeps a block's raw rows in the conv state", "a wider conv state",
      "vllm_bi.patch.gdn_backend:wrap_state_shape", wraps=True, when=CHUNK_MODE,
      remove_when="the GDN forward rows go"),
    P("vllm.model_executor.layers.mamba.mamba_utils:MambaStateShapeCalculator.kda_state_shape", CPU,
      "the chunk-aligned mode keeps a block's raw rows in the conv state (Kimi Linear's KDA layers)",
      "a wider conv state", "vllm_bi.patch.gdn_backend:wrap_kda_state_shape", wraps=True, when=CHUNK_MODE,
      remove_when="the KDA forward row goes"),
    # ------------------------------------------------------------------ worker RPC
    P("vllm.v1.worker.gpu_worker:Worker.vllm_bi_weight_digest", ALL,
      "a trainer must check that the server holds its weights", "new worker method (/collective_rpc)",
      "vllm_bi.patch.worker_rpc:vllm_bi_weight_digest",
      remove_when="vLLM's weight-transfer engine reports a digest"),
    P("vllm.v1.worker.gpu_worker:Worker.vllm_bi_info", ALL,
      "a trainer must agree with the server's arithmetic settings", "new worker method: the settings dict",
      "vllm_bi.patch.worker_rpc:vllm_bi_info", remove_when="never: it is vllm_bi's own contract"),
    P("vllm.v1.worker.gpu_worker:Worker.vllm_bi_model_layout", ALL,
      "a trainer must refuse a server of another model before its first weight push (a failed reload leaves "
      "parameters on the meta device and the next request kills the engine)",
      "new worker method: the served checkpoint's architecture, tensor names and shapes",
      "vllm_bi.patch.worker_rpc:vllm_bi_model_layout", remove_when="never: it is vllm_bi's own contract"),
    # ------------------------------------------------------------------ API server
    P(f"{_API_ENTRY}:build_app", ALL,
      "--api-key guards /v1, /v2, /inference and /cohere only: the dev-mode control routes stay open, and "
      "/collective_rpc calls any worker method by name (one whose result cannot be serialised kills the engine's "
      "output thread)",
      "wrap: every route needs the key when one is set, /collective_rpc runs allow-listed methods only (403 "
      "otherwise), generation routes answer 503 + Retry-After while paused",
      "vllm_bi.patch.control:guard_build_app", wraps=True, when=API_SERVER,
      remove_when="vLLM guards every route with its API key and allow-lists /collective_rpc"),
    # ------------------------------------------------------------------ non-finite guard
    P("vllm.v1.worker.gpu_model_runner:count_nans_per_row", ALL,
      "a NaN or +inf logit would be sampled and served", "count NaN and +inf per request row",
      "vllm_bi.patch.nonfinite:count_nonfinite_per_row", when=GUARD,
      remove_when="vLLM fails requests with non-finite logits"),
    P("vllm.v1.worker.gpu.sample.sampler:get_num_nans", ALL,
      "as above, in Model Runner V2", "count NaN and +inf per request row",
      "vllm_bi.patch.nonfinite:count_nonfinite_per_row", when=GUARD,
      remove_when="vLLM fails requests with non-finite logits"),
    P("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", ALL,
      "the scheduler emits a token sampled from non-finite logits",
      "such a request fails (error status), the others go on",
      "vllm_bi.patch.nonfinite:wrap_update_from_output", wraps=True, when=GUARD,
      remove_when="vLLM fails requests with non-finite logits"),
    P("vllm.entrypoints.generate.base.serving:GenerateBaseServing._raise_if_error", ALL,
      "the client would see a generic error", "HTTP 500 with vllm_bi's message",
      "vllm_bi.patch.nonfinite:raise_if_error", when=GUARD,
      remove_when="vLLM fails requests with non-finite logits"),
    # ------------------------------------------------------------------ the op library in vLLM's layers
    *(P(f"{_LINEAR}:{cls}.{name}", ALL,
        "oneDNN / sgl GEMMs (CPU) and vLLM's BI GEMM (CUDA) give other bits than the trainer's",
        "keep the weight as loaded; ops.linear.bi_linear", f"{_CL}:{fn}", when=OWN_OPS)
      for cls in ("UnquantizedLinearMethod",) for name, fn in
      (("process_weights_after_loading", "keep_weight"), ("apply", "bi_linear_apply"))),
    *(P(f"vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.{name}", ALL,
        "the LM head's GEMM, as above", "keep the weight as loaded; ops.linear.bi_linear", f"{_CL}:{fn}",
        when=OWN_OPS)
      for name, fn in (("process_weights_after_loading", "keep_weight"), ("apply", "bi_linear_apply"))),
    P(f"{_LINEAR}:RowParallelLinear.forward", ALL,
      "under TP, partial products rounded before the all-reduce differ from TP = 1",
      "exact float64 partials, gathered and added, rounded once (also the MoE shared expert's down projection)",
      f"{_CL}:wrap_row_parallel_forward", wraps=True, when=OWN_OPS,
      remove_when="vLLM's TP reductions are exact"),
    P("vllm.v1.sample.sampler:Sampler.compute_logprobs", ALL,
      "the served logprobs must be the trainer's log-softmax", "ops.softmax.log_softmax",
      f"{_CL}:COMPUTE_LOGPROBS", when=OWN_OPS),
    *(P(f"{_NORMS}:{cls}.forward_native", ALL, _NORM_WHY, "ops.norm", f"{_CL}:{fn}", when=OWN_OPS)
      for cls, fn in (("GemmaRMSNorm", "gemma_rms_forward"), ("RMSNorm", "rms_forward"),
                      ("RMSNormGated", "gated_rms_forward"))),
    *(P(f"{_NORMS}:{cls}.forward_cpu", CPU, _NORM_WHY, "ops.norm", f"{_CL}:{fn}")
      for cls, fn in (("GemmaRMSNorm", "gemma_rms_forward"), ("RMSNorm", "rms_forward"),
                      ("RMSNormGated", "gated_rms_forward"))),
    *(P(f"{_NORMS}:{cls}.forward_cuda", CUDA, _NORM_WHY, "ops.norm", f"{_CL}:{fn}", when=OWN_OPS)
      for cls, fn in (("GemmaRMSNorm", "gemma_rms_forward"), ("RMSNorm", "rms_forward"),
                      ("RMSNormGated", "gated_rms_forward"))),
    P(f"{_NORMS}:GemmaRMSNorm.forward_cuda", CUDA, "vLLM IR rms_norm picks its provider at run time",
      "the same formula with vLLM's BI mean", "vllm_bi.patch.cuda_ops:gemma_rms_forward_cuda", when=VLLM_OPS,
      remove_when="vLLM's BI mode covers GemmaRMSNorm"),
    P(f"{_NORMS}:RMSNormGated.forward_cuda", CUDA, "FLA's layer_norm_fwd groups rows by token count",
      "vLLM's forward_native (BI mean)", "vllm_bi.patch.cuda_ops:gated_rms_forward_cuda", when=VLLM_OPS,
      remove_when="vLLM's BI mode covers RMSNormGated"),
    P(f"{_SILU}.forward_cpu", CPU, "stock CPU kernels round the vectorised body and the tail differently",
      "ops.activation.silu_mul", f"{_CL}:silu_mul_forward"),
    P(f"{_ROTARY}.forward_cpu", CPU, "the trainer's rotary table and arithmetic", "ops.rotary",
      f"{_CL}:rotary_forward"),
    *(P(f"{target}.{name}", CUDA, "the trainer's activation / rotary on the server", how, f"{_CL}:{fn}",
        when=OWN_OPS)
      for target, how, fn in ((_SILU, "ops.activation.silu_mul", "silu_mul_forward"),
                              (_ROTARY, "ops.rotary", "rotary_forward"))
      for name in ("forward_cuda", "forward_native")),
    P("vllm.model_executor.determinism.batch_invariant:enable_batch_invariant_mode", CPU,
      "stock registers Triton kernels on the CPU dispatch key", "aten overrides (mean, softmax, bmm, sigmoid, "
      "silu) routed to the op library", "vllm_bi.patch.aten_overrides:enable_cpu_batch_invariant_mode",
      remove_when="vLLM's BI mode supports CPU"),
    P("vllm.model_executor.determinism.batch_invariant:enable_batch_invariant_mode", CUDA,
      "vLLM's overrides give other bits than the trainer's ops for model code calling torch directly",
      "the op library's aten overrides on the CUDA key",
      "vllm_bi.patch.aten_overrides:enable_cuda_own_ops_mode", when=OWN_OPS),
    # ------------------------------------------------------------------ attention
    *(P(f"vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.{name}", CPU,
        "stock kernel packs the cache per ISA and tiles by batch", "ops.attention over a plain cache layout",
        f"vllm_bi.model_executor.attention:{fn}")
      for name, fn in (("forward", "bi_cpu_attn_forward"), ("do_kv_cache_update", "bi_cpu_kv_cache_update"))),
    P("vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward", CUDA,
      "the trainer's attention on the server", "model_executor.attention.bi_attn_forward",
      "vllm_bi.model_executor.attention:bi_attn_forward", when=OWN_OPS),
    P("vllm.model_executor.models.qwen3_next:Qwen3NextAttention.__init__", CUDA,
      "the fused q/k-norm + RoPE kernel bypasses the patched norms and rotary",
      "fused kernel off", "vllm_bi.patch.cuda_ops:wrap_attention_init", wraps=True, when=OWN_OPS),
    *(P(f"vllm.v1.worker.gpu.sample.{mod}:compute_token_logprobs", CUDA,
        "Model Runner V2's logprobs must be the trainer's log-softmax", "ops.softmax.log_softmax",
        "vllm_bi.patch.cuda_ops:token_logprobs", when=OWN_OPS)
      for mod in ("logprob", "prompt_logprob")),
    # ------------------------------------------------------------------ models (CPU)
    *(P(f"vllm.model_executor.models.registry:ModelRegistry.models[{arch}]", CPU,
        "vLLM's qwen3_5.py imports the vision tower (torchvision is unusable with CPU torch)",
        "text-only classes built from Qwen3-Next's layers", f"vllm_bi.model_executor.models.qwen3_5_text:{cls}",
        remove_when="vLLM's Qwen3.5 model imports without torchvision", kind="model")
      for arch, cls in (("Qwen3_5ForCausalLM", "Qwen3_5TextForCausalLM"),
                        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextForCausalLM"),
                        ("Qwen3_5MTP", "Qwen3_5TextMTP"), ("Qwen3_5MoeMTP", "Qwen3_5MoeTextMTP"))),
    P("vllm.v1.worker.gpu_worker:Worker.load_model", CUDA,
      "VLLM_BI_GEMM_CONFIGS=tune: the Triton GEMM's tiles must be chosen for this device and the loaded model's "
      "shapes before the first product", "after loading: the cached table, or tune and cache one (ops.gemm_tune)",
      "vllm_bi.patch.gemm_tuning:wrap_load_model", wraps=True, when=TUNE,
      remove_when="never: vllm_bi's own tuning"),
    P("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", CPU,
      "a layer vllm_bi has not made batch-invariant would run silently", "audit after loading; refuse it",
      "vllm_bi.patch.audit:wrap_load_model", wraps=True, remove_when="never: vllm_bi's own safety net"),
    # ------------------------------------------------------------------ MoE
    *(P(f"vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.{name}", CPU,
        "stock CPU experts are not batch-invariant and pack the weights", how, f"vllm_bi.patch.{mod}:{fn}")
      for name, how, mod, fn in (
          ("_supports_batch_invariance", "claims it (true only with the rows beside it)", "cpu_moe",
           "SUPPORTS_BATCH_INVARIANCE"),
          ("process_weights_after_loading", "keep the weights unpacked", "cpu_layers", "keep_weight"),
          ("apply", "ops.moe.moe_experts", "cpu_moe", "experts_apply"))),
    P(f"{_ROUTER}.cpu_router:_softmax_topk", CPU, "the trainer's router", "ops.moe.softmax_topk",
      "vllm_bi.ops.moe:softmax_topk"),
    P(f"{_ROUTER}.cpu_router:_grouped_topk", CPU, "the trainer's router (its top-k sum runs in another order)",
      "ops.moe.sigmoid_topk for sigmoid scores in one group; other groupings refused",
      "vllm_bi.patch.cpu_moe:grouped_topk"),
    *(P(f"{_RUNNER}.{name}", CPU, "under TP the experts already hold exact full sums",
        "no all-reduce under TP", f"vllm_bi.patch.cpu_moe:{fn}", wraps=True,
        remove_when="vLLM's TP reductions are exact")
      for name, fn in (("_maybe_reduce_final_output", "wrap_reduce_final_output"),
                       ("_maybe_reduce_shared_expert_output", "wrap_reduce_shared_expert_output"))),
    P(f"{_ROUTER}.fused_topk_router:FusedTopKRouter._compute_routing", CUDA,
      "ops.topk_softmax (CUDA C++) is not the trainer's router", "ops.moe.softmax_topk",
      "vllm_bi.patch.cuda_moe:fused_topk_compute_routing", when=OWN_OPS),
    P(f"{_ROUTER}.grouped_topk_router:GroupedTopKRouter._compute_routing", CUDA,
      "vLLM's grouped top-k kernels are not the trainer's router (its top-k sum runs in another order)",
      "ops.moe.sigmoid_topk for sigmoid scores in one group (Kimi Linear's router); other groupings and fused "
      "shared experts refused", "vllm_bi.patch.cuda_moe:grouped_topk_compute_routing", when=OWN_OPS),
    *(P(f"{_ROUTER}.{mod}:{cls}._compute_routing", CUDA, "no batch-invariant implementation",
        "refused with a message", "vllm_bi.patch.cuda_moe:refuse_routing", when=OWN_OPS,
        remove_when="the op library implements this router")
      for mod, cls in (("custom_routing_router", "CustomRoutingRouter"),
                       ("fused_topk_bias_router", "FusedTopKBiasRouter"),
                       ("aiter_shared_routed_fused_moe_router", "AiterSharedRoutedFusedMoERouter"),
                       ("routing_simulator_router", "RoutingSimulatorRouter"),
                       ("zero_expert_router", "ZeroExpertRouter"))),
    P(f"{_ROUTER}.gate_linear:GateLinear.forward", CUDA, "cuBLAS / cuteDSL / fp32 tiers for the router GEMM",
      "ReplicatedLinear.forward (bi_linear)", "vllm_bi.patch.cuda_moe:gate_linear_forward", when=OWN_OPS),
    P(f"{_RUNNER}._maybe_fuse_gate_weights", CUDA,
      "the fused router + shared-expert gate GEMM is not the trainer's", "refused with a message",
      "vllm_bi.patch.cuda_moe:refuse_fused_gate", when=OWN_OPS),
    P("vllm.model_executor.layers.fused_moe.experts.triton_moe:TritonExperts.apply", CUDA,
      "vLLM's Triton experts are not the trainer's", "ops.moe.moe_experts into the output",
      "vllm_bi.patch.cuda_moe:triton_experts_apply", when=OWN_OPS),
    P("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
      ".process_weights_after_loading", CUDA,
      "another backend, padding or shuffled weights would bypass the rows above",
      "check the layer after loading; refuse anything else", "vllm_bi.patch.cuda_moe:wrap_process_weights",
      wraps=True, when=OWN_OPS, remove_when="never: vllm_bi's own safety net"),
    # ------------------------------------------------------------------ sampling and draft verification
    P("vllm.v1.sample.ops.topk_topp_sampler:random_sample", CPU,
      "CPU generators have no offset: a seeded request whose prompt is chunked killed the engine",
      "per-request generator keyed by (seed, draw index)", "vllm_bi.patch.sampling:random_sample",
      remove_when="vLLM's CPU generators support offsets"),
    P("vllm.v1.worker.gpu.model_states.mamba_hybrid:MambaHybridModelState.prepare_attn", CUDA,
      "Model Runner V2 runs a new one-token request padded with placeholder drafts as a 1 + k token prefill: the "
      "GDN state and conv window it leaves include the placeholders, and the request's next step starts from them",
      "such a row counts as a decode (prefill_runs_as_decode), so a speculative row, as V1 counts it; the GDN "
      "glue zeroes its slots", "vllm_bi.model_executor.gdn:wrap_mamba_prepare_attn", wraps=True, when=ONE_TOKEN_CUDA,
      remove_when="vLLM's V2 counts a padded new one-token request as a speculative row"),
    P("vllm.v1.engine.input_processor:InputProcessor._validate_params", ALL,
      "with --speculative-config, penalties, min_tokens and bad words make a position's sample depend on the draft "
      "tokens before it", "such a request is refused (400) when the server decodes speculatively",
      "vllm_bi.patch.sampling:wrap_validate_params", wraps=True,
      remove_when="speculative verification replays each position's sampler state"),
    P("vllm.v1.sample.rejection_sampler:RejectionSampler.forward", CPU,
      "vLLM accepts a draft at a temperature by a probability test, and its bonus token takes the step's first "
      "draw: a request's tokens depend on the drafts", "exact-match verification: each position sampled by the "
      "sampler itself, a seeded draw keyed to the output token index; a draft kept while it equals that sample",
      "vllm_bi.patch.sampling:verify_drafts", remove_when="vLLM verifies drafts by exact match on a keyed sample"),
    P("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__", CUDA,
      "Model Runner V2 accepts a draft at a temperature by a probability test against the draft's logits: a "
      "request's tokens depend on the drafts", "exact-match verification: every row sampled by V2's own sampler "
      "(noise keyed by seed and position), a draft kept while it equals the previous row's sample, on the device",
      "vllm_bi.patch.sampling:verify_drafts_v2", when=SPEC_CUDA,
      remove_when="vLLM verifies drafts by exact match on a keyed sample"),
    P("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu", CPU,
      "as above (the Gumbel-max CPU sampler)", "noise seed drawn by (seed, draw index)",
      "vllm_bi.patch.sampling:sampler_forward_cpu", remove_when="vLLM's CPU generators support offsets"),
    P("vllm.v1.worker.cpu_model_runner:CPUModelRunner._update_states", CPU,
      "seeded requests get stock generators", "replaced by BIGenerator",
      "vllm_bi.patch.sampling:wrap_update_states", wraps=True,
      remove_when="vLLM's CPU generators support offsets"),
)


# ---------------------------------------------------------------------------------------------- applying


def active_rows(device: str, settings=None) -> list[Patch]:
    """The rows that apply on ``device`` (``cpu`` or ``cuda``) under ``settings`` (default: this process's)."""
    if settings is None:
        from vllm_bi.settings import current

        settings = current()
    cond = {"": True, OWN_OPS: settings.ops(device) == "vllm_bi", VLLM_OPS: settings.ops(device) == "vllm",
            CHUNK_MODE: settings.gdn_mode == "chunk",
            KIMI: device == "cpu" or settings.cuda_feature("kimi-linear"),
            GUARD: settings.nonfinite_guard, API_SERVER: _API_ENTRY in sys.modules, TUNE: settings.tunes_gemm(device),
            SPEC_CUDA: settings.cuda_feature("speculative"),
            ONE_TOKEN_CUDA: settings.cuda_feature("speculative-one-token")}
    return [p for p in LEDGER if p.platform in (ALL, device) and cond[p.when]]


def _split(target: str) -> tuple[str, list[str], str | None]:
    module, _, path = target.partition(":")
    key = None
    if path.endswith("]"):
        path, _, key = path[:-1].partition("[")
    return module, path.split("."), key


def resolve(ref: str):
    """The object ``module:Qualified.name`` names."""
    module, parts, _ = _split(ref)
    obj = importlib.import_module(module)
    for p in parts:
        obj = getattr(obj, p)
    return obj


_APPLIED: list[Patch] = []


def applied() -> list[Patch]:
    """The rows this process has applied (empty without batch invariance; an ``on_import`` row once its module is
    imported)."""
    return list(_APPLIED)


def apply_row(p: Patch, set_attr=setattr, on_applied=lambda p: None) -> None:
    """Apply one row (``set_attr(owner, name, value)`` sets an attribute; tests pass ``monkeypatch.setattr``), then
    call ``on_applied(p)``: at once, or for an ``on_import`` row whose module is not imported yet, when it is."""
    module, parts, key = _split(p.target)
    if p.kind == "backend":
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

        cls = resolve(p.new)
        register_backend(getattr(MambaAttentionBackendEnum, key.split(".")[-1]), f"{cls.__module__}.{cls.__qualname__}",
                         is_mamba=True)
        on_applied(p)
        return
    if p.kind == "model":
        from vllm import ModelRegistry

        ModelRegistry.register_model(key, p.new)
        on_applied(p)
        return
    if p.kind == "on_import" and module not in sys.modules:
        _AFTER_IMPORT.watch(module, lambda: apply_row(dataclasses.replace(p, kind="attr"), set_attr,
                                                      lambda _: on_applied(p)))
        return
    owner = importlib.import_module(module)
    for name in parts[:-1]:
        owner = getattr(owner, name)
    attr = parts[-1]
    new = resolve(p.new)
    if p.wraps:
        new = new(inspect.getattr_static(owner, attr))
    try:
        new._vllm_bi = True  # lets vllm_bi's own checks recognise its replacements
    except AttributeError:
        pass
    set_attr(owner, attr, new)
    on_applied(p)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a watched module is first executed (before its importer goes on)."""

    def __init__(self):
        self.pending: dict[str, list] = {}

    def watch(self, module: str, callback) -> None:
        self.pending.setdefault(module, []).append(callback)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(mod):
            execute(mod)
            for callback in self.pending.pop(name, []):
                callback()

        spec.loader.exec_module = exec_module  # the loader is this spec's own
        return spec


_AFTER_IMPORT = _AfterImport()


def apply_all() -> list[Patch]:
    """Apply every active row for this platform and settings, once per process; returns them."""
    if _APPLIED or _AFTER_IMPORT.pending:
        return applied()
    from vllm.platforms import current_platform

    from vllm_bi.settings import current

    settings = current()
    # Processes that never run the model (e.g. the model-inspection subprocess) may see an unspecified platform;
    # only an accelerator platform other than CUDA is refused.
    cpu = not (current_platform.is_cuda_alike() or current_platform.is_xpu())
    if not (cpu or current_platform.is_cuda()) and not settings.allow_unverified_device:
        raise RuntimeError(
            f"vllm_bi: batch invariance is implemented for the CPU and CUDA builds of vLLM; the current platform "
            f"is {current_platform.device_name!r}, which was never verified. Unset VLLM_BATCH_INVARIANT to run "
            "stock vLLM.")
    rows = active_rows("cpu" if cpu else "cuda", settings)
    if settings.nonfinite_guard:
        from vllm_bi.patch.nonfinite import prepare

        prepare()
    for p in rows:
        apply_row(p, on_applied=_APPLIED.append)
    return applied()


# ---------------------------------------------------------------------------------------------- the table


def ledger_table() -> str:
    """The ledger as a Markdown page (``docs/patches.md``)."""
    out = ["# The patch ledger", "",
           "Every change vllm_bi makes to vLLM 0.32 under `VLLM_BATCH_INVARIANT=1`, generated from "
           "`vllm_bi/patch/ledger.py` (`python -m vllm_bi.patch.ledger --write docs/patches.md`; a test keeps this "
           "page equal to it). `tests/test_patch_ledger.py` serves a model and checks that the vLLM attributes that "
           "differ from a pristine import are exactly the active rows. `patches/` holds the GDN change as an "
           "upstream-style diff.", "",
           "Platform `all` rows apply on CPU and CUDA; `when` names the setting a row depends on "
           "(`op library`: CPU always, CUDA with `VLLM_BI_CUDA_OPS=vllm_bi`, the default; `Kimi Linear on the device`: CPU "
           "always, CUDA once `kimi-linear` is in `vllm_bi.settings.CUDA_FEATURES` or with "
           "`VLLM_BI_CUDA_PREVIEW=kimi-linear`; `one-token prompts under speculation on CUDA`: CUDA once "
           "`speculative-one-token` is in `vllm_bi.settings.CUDA_FEATURES` or with "
           "`VLLM_BI_CUDA_PREVIEW=speculative-one-token`).", "",
           "| target | platform | when | why | how | upstream | remove when |", "|---|---|---|---|---|---|---|"]
    for p in LEDGER:
        cells = [f"`{p.target}`", p.platform, p.when or "always", p.why, f"{p.how} (`{p.new}`)", p.upstream,
                 p.remove_when]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_bi.patch.ledger", description="Print or write the patch ledger.")
    ap.add_argument("--write", metavar="PATH", help="write the Markdown table to PATH (e.g. docs/patches.md)")
    args = ap.parse_args(argv)
    text = ledger_table()
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
