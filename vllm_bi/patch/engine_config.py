"""The engine configuration under ``VLLM_BATCH_INVARIANT=1``: what vllm_bi sets, and what it refuses at start-up.

``EngineArgs.create_engine_config`` is wrapped (ledger row in :mod:`vllm_bi.patch.ledger`) so that every check
runs once, in the process that builds the engine, before any model is loaded:

- the GDN/SSM state cache is float32, or bfloat16 under ``VLLM_BI_GDN_STATE=bf16`` (``auto`` becomes that dtype;
  another explicit dtype is refused);
- speculative decoding: the MTP drafter in the recurrent GDN mode, drafts verified by exact match, prefix caching
  off; on CPU, and on CUDA in Model Runner V2 with eager steps (anything else refused with the fix);
- CPU runs eagerly (torch.compile would re-fuse the ops); CUDA captures decode steps in CUDA graphs when
  ``VLLM_BI_CUDA_GRAPHS`` resolves to ``decode`` (:meth:`vllm_bi.settings.Settings.decode_graphs`,
  :func:`_check_graphs`) and runs every other step eagerly, with TRITON_ATTN as the attention backend when none
  is chosen; one log line says which arithmetic the defaults resolved to;
- the default preset under tensor parallelism on CUDA becomes the portable one (:func:`_auto_under_tp`);
- every ``VLLM_BI_*`` value is validated (:mod:`vllm_bi.settings`), and the op settings' tables are read;
- parallelism: pipeline parallelism refused; tensor parallelism only where its sums are exact
  (:func:`_check_parallelism`);
- Kimi Linear runs without vLLM's fused GEMM + all-reduce (:func:`_kimi_linear`); on CPU over CPU_MLA, keeping
  chunked prefill and prefix caching, which vLLM's CPU platform turns off for MLA models
  (:func:`wrap_cpu_platform_config`); on CUDA (the ``kimi-linear`` feature of :mod:`vllm_bi.settings`, refused by
  :func:`vllm_bi.patch.model_families.refusal` while neither gated nor previewed) over TRITON_MLA, in the recurrent
  GDN mode, with eager steps;
- a model with recurrent-state layers other than the Qwen GDN layer (Mamba, Mamba2, short convolutions, other linear
  attention) is refused with the layer type named (:mod:`vllm_bi.patch.model_families`).
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_bi.patch import model_families
from vllm_bi.settings import current as current_settings
from vllm_bi.settings import reload as reload_settings
from vllm_bi.settings import TUNE

__all__ = ["BatchInvarianceConfigError", "wrap_create_engine_config", "wrap_cpu_platform_config"]

logger = logging.getLogger("vllm_bi")


class BatchInvarianceConfigError(ValueError):
    """A configuration vllm_bi cannot make batch-invariant."""


def wrap_create_engine_config(orig):
    """``EngineArgs.create_engine_config`` with vllm_bi's checks and defaults first (see the module doc)."""

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        from vllm.platforms import current_platform

        try:
            current_settings()  # a bad VLLM_BI_* value is refused by name before anything reads it
        except ValueError as e:
            raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
        ssm = getattr(self, "mamba_ssm_cache_dtype", "auto")
        from vllm_bi.gdn.recurrent import state_dtype

        want = str(state_dtype()).removeprefix("torch.")  # --mamba-ssm-cache-dtype's name of VLLM_BI_GDN_STATE's dtype
        if ssm not in ("auto", want, None):
            raise BatchInvarianceConfigError(
                f"vllm_bi: VLLM_BATCH_INVARIANT=1 with VLLM_BI_GDN_STATE={current_settings().gdn_state} needs a {want} "
                f"GDN/SSM state cache, but --mamba-ssm-cache-dtype is {ssm!r} (a state in another dtype is rounded "
                f"where a prefill split falls). Fix: drop --mamba-ssm-cache-dtype or pass --mamba-ssm-cache-dtype {want}."
            )
        if ssm != want:
            self.mamba_ssm_cache_dtype = want
            logger.info("vllm_bi: batch invariance: SSM state cache dtype auto -> %s", want)
        if getattr(self, "speculative_config", None):
            _check_speculative(self, current_platform)
        if current_platform.is_cpu() and not self.enforce_eager:
            self.enforce_eager = True
            logger.info("vllm_bi: batch invariance on CPU: eager mode (torch.compile would re-fuse the ops)")
        kimi = _kimi_linear(self, current_platform)
        if current_platform.is_cuda() and not kimi:
            chosen = _chosen_attention_backend(self)
            if chosen is None:
                self.attention_backend = "TRITON_ATTN"
                logger.warning(
                    "vllm_bi: batch invariance on CUDA: attention backend TRITON_ATTN (with FLASH_ATTN, decode and "
                    "prefill logprobs differed for ~500-token contexts on an H200)"
                )
            elif "TRITON_ATTN" not in str(chosen) and current_settings().cuda_ops == "vllm_bi":
                raise BatchInvarianceConfigError(
                    f"vllm_bi: VLLM_BI_CUDA_OPS=vllm_bi routes TRITON_ATTN's attention only; the chosen backend "
                    f"{chosen} would bypass it. Drop --attention-backend or choose TRITON_ATTN.")
            elif "TRITON_ATTN" not in str(chosen):
                logger.warning(
                    "vllm_bi: attention backend %s: decode/prefill (prompt_logprobs) parity is only "
                    "measured with TRITON_ATTN on CUDA", chosen,
                )
        try:
            _auto_under_tp(self, current_platform)
            settings = current_settings()  # every VLLM_BI_* value checked once, here, at start-up
        except ValueError as e:
            raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
        graphs, eager_why = settings.decode_graphs(bool(self.enforce_eager))
        graphs = graphs and current_platform.is_cuda()
        if current_platform.is_cuda():
            logger.warning("vllm_bi: arithmetic on CUDA: GEMM %s%s, GDN %s, decode %s (VLLM_BI_PRESET=%s; "
                           "`vllm-bi info` lists every setting)", settings.gemm_on("cuda"),
                           f" (tiles {settings.gemm_table_name()})" if settings.gemm_on("cuda") == "triton" else "",
                           settings.gdn_summary("cuda"),
                           "in CUDA graphs" if graphs else f"eager ({eager_why or 'VLLM_BI_CUDA_GRAPHS=off'})",
                           settings.preset)
        if graphs:
            if self.enforce_eager:
                raise BatchInvarianceConfigError(
                    "vllm_bi: VLLM_BI_CUDA_GRAPHS=decode captures decode steps, --enforce-eager forbids it; drop one")
            from vllm.config.compilation import CompilationMode, CUDAGraphMode

            self.compilation_config.mode = CompilationMode.NONE  # no torch.compile: it would re-fuse the ops
            self.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            logger.info("vllm_bi: decode steps captured in CUDA graphs, prefills eager")
        elif current_platform.is_cpu() and settings.cuda_graphs == "decode":
            logger.warning("vllm_bi: VLLM_BI_CUDA_GRAPHS applies to CUDA only; ignored on CPU (eager)")
        elif current_platform.is_cuda() and not self.enforce_eager:
            self.enforce_eager = True
            logger.info("vllm_bi: batch invariance on CUDA: eager steps")
        if settings.gemm_configs == TUNE and not settings.tunes_gemm("cuda" if current_platform.is_cuda() else "cpu"):
            logger.warning("vllm_bi: VLLM_BI_GEMM_CONFIGS=tune tunes CUDA's Triton GEMM only; ignored here (the "
                           "GEMM is float64)")
        config = orig(self, *args, **kwargs)
        why = model_families.refusal(config.model_config)  # another family's recurrent-state layers
        if why:
            raise BatchInvarianceConfigError(why)
        _check_parallelism(config, current_platform)
        _check_op_settings(current_platform)
        if graphs:
            _check_graphs(config)
        return config

    return create_engine_config


def _auto_under_tp(args, platform) -> None:
    """``VLLM_BI_PRESET=auto`` (the default) under tensor parallelism on CUDA means the portable arithmetic: the
    Triton GEMM is refused there (its row-parallel partials would not be the trainer's unsharded GEMM) and decode
    graphs were never measured with TP. The choice goes into this process's environment, so the engine's workers
    and their ``vllm_bi_info`` report it; a variable the user set still wins."""
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    if not platform.is_cuda() or tp == 1 or current_settings().preset != "auto":
        return
    os.environ["VLLM_BI_PRESET"] = "portable"
    reload_settings()
    logger.warning("vllm_bi: tensor parallel size %d on CUDA: the portable arithmetic (float64 GEMM, eager "
                   "decode) instead of the fast default; the trainer needs VLLM_BI_PRESET=portable too", tp)


SPEC_METHODS = ("mtp", "qwen3_5_mtp", "qwen3_next_mtp")  # the model's own multi-token-prediction drafter


def _check_speculative(args, platform) -> None:
    """``--speculative-config`` under batch invariance: the model's MTP drafter, in the recurrent GDN mode, without
    prefix caching, on CPU, and on CUDA (while ``speculative`` is a CUDA feature, :data:`vllm_bi.settings.CUDA_FEATURES`)
    in vLLM's Model Runner V2 with eager steps. Each verified row has a one-token decode's bits
    (:func:`vllm_bi.model_executor.gdn.verify_rows`), and verification keeps a draft exactly when it equals the
    sample decoding without drafts would draw at that position (:func:`vllm_bi.patch.sampling.verify_drafts` on CPU,
    :func:`vllm_bi.patch.sampling.verify_drafts_v2` on CUDA), so a request's tokens and logprobs are those of
    decoding without drafts. On CUDA that holds only when both decode with V2's sampler (noise keyed by seed and
    position): the V1 runner's per-request generators draw other noise for the same seed."""
    spec = args.speculative_config
    spec = spec if isinstance(spec, dict) else vars(spec) if hasattr(spec, "__dict__") else {}
    method = spec.get("method")
    try:
        settings = current_settings()
    except ValueError as e:
        raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
    cuda = platform.is_cuda()
    if not platform.is_cpu() and not (cuda and settings.cuda_feature("speculative")):
        from vllm_bi.settings import CUDA_FEATURES

        where = "CPU and CUDA" if "speculative" in CUDA_FEATURES else "CPU"
        fix = ", or set VLLM_BI_CUDA_PREVIEW=speculative to measure it unverified" if cuda else ""
        raise BatchInvarianceConfigError(f"vllm_bi: speculative decoding under batch invariance is served on {where} "
                                         f"only; remove --speculative-config{fix}.")
    if method not in SPEC_METHODS:
        raise BatchInvarianceConfigError(
            f"vllm_bi: speculative decoding method {method!r} is not supported under batch invariance; use the "
            "model's own drafter, --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'.")
    for key, default in (("rejection_sample_method", "standard"), ("enable_adaptive_verification", False)):
        if spec.get(key, default) not in (default, None):
            raise BatchInvarianceConfigError(
                f"vllm_bi: speculative decoding verifies drafts by exact match under batch invariance; drop {key} "
                "from --speculative-config.")
    if settings.gdn_mode != "recurrent":
        raise BatchInvarianceConfigError(
            f"vllm_bi: speculative decoding runs in the recurrent GDN mode only (VLLM_BI_GDN_MODE is "
            f"{settings.gdn_mode!r}); set VLLM_BI_GDN_MODE=recurrent or drop --speculative-config.")
    if str(getattr(args, "logprobs_mode", "raw_logprobs")).startswith("processed"):
        raise BatchInvarianceConfigError(
            "vllm_bi: speculative decoding returns raw logprobs under batch invariance; drop --logprobs-mode or "
            "--speculative-config.")
    if args.enable_prefix_caching:
        raise BatchInvarianceConfigError(
            "vllm_bi: speculative decoding with prefix caching is not batch-invariant here (vLLM's CPU build lacks "
            "the state-copy kernel it needs, and CUDA was never measured); drop --enable-prefix-caching or "
            "--speculative-config.")
    args.enable_prefix_caching = False
    if cuda:
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1").strip().lower() in ("0", "false"):
            raise BatchInvarianceConfigError(
                "vllm_bi: speculative decoding on CUDA verifies drafts in Model Runner V2, whose sampler keys its "
                "noise by seed and position; unset VLLM_USE_V2_MODEL_RUNNER or drop --speculative-config.")
        if settings.cuda_graphs == "decode":
            raise BatchInvarianceConfigError(
                "vllm_bi: speculative decoding on CUDA runs eager steps (a verify step plans its GDN rows on the "
                "host); unset VLLM_BI_CUDA_GRAPHS or drop --speculative-config.")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the runner the server without drafts uses, in every process
        args.enforce_eager = True
    logger.warning("vllm_bi: speculative decoding (%s): prefix caching off, drafts verified by exact match%s", method,
                   "; Model Runner V2, eager steps" if cuda else "")


def _chosen_attention_backend(args):
    """The attention backend the user asked for (``--attention-backend`` or ``--attention-config``), or None."""
    return args.attention_backend or getattr(args.attention_config, "backend", None)


KIMI_MLA_BACKEND = {"cpu": "CPU_MLA", "cuda": "TRITON_MLA"}  # whose metadata builder the MLA forward wraps


def _kimi_linear(args, platform) -> bool:
    """A Kimi Linear checkpoint: vLLM's fused GEMM + all-reduce kernel off (``VLLM_KIMI_K3_GEMM_AR=0`` for the
    engine's processes: it is not the op library's GEMM, and it needs CUTLASS's Python package, which a CPU install
    lacks); refused when set on. The attention backend is the one whose metadata builder the batch-invariant MLA
    forward wraps (:data:`KIMI_MLA_BACKEND`): CPU_MLA on CPU (vLLM would pick AMX_MLA on a CPU with AMX tiles),
    TRITON_MLA on CUDA; another one is refused. On CUDA, when the ``kimi-linear`` feature is on (gated or
    ``VLLM_BI_CUDA_PREVIEW``), the KDA layers run in the recurrent GDN mode only and every step eagerly (its glue
    plans each step on the host), with the torch attention op, so the chunk mode, ``VLLM_BI_CUDA_GRAPHS=decode`` and
    ``VLLM_BI_ATTENTION=triton`` are refused by name; with the
    feature off nothing is set here and :func:`vllm_bi.patch.model_families.refusal` refuses the model. Returns
    whether it chose the attention backend (the CUDA default, TRITON_ATTN, is then not set)."""
    if model_families.local_architecture(args.model) != "KimiLinearForCausalLM":
        return False
    if os.environ.get("VLLM_KIMI_K3_GEMM_AR", "0") not in ("0", ""):
        raise BatchInvarianceConfigError(
            "vllm_bi: VLLM_KIMI_K3_GEMM_AR fuses o_proj's GEMM with its all-reduce, which is not the trainer's "
            "GEMM; unset it or set it to 0")
    os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"
    if platform.is_cpu():
        device = "cpu"
    elif platform.is_cuda():
        device = "cuda"
        try:
            settings = current_settings()
        except ValueError as e:
            raise BatchInvarianceConfigError(f"vllm_bi: {e}") from None
        if not settings.cuda_feature("kimi-linear"):
            return False
        if settings.gdn_mode != "recurrent":
            raise BatchInvarianceConfigError(
                f"vllm_bi: Kimi Linear on CUDA runs its KDA layers in the recurrent GDN mode only (VLLM_BI_GDN_MODE "
                f"is {settings.gdn_mode!r}); set VLLM_BI_GDN_MODE=recurrent")
        if settings.cuda_graphs == "decode":
            origin = (f" (from VLLM_BI_PRESET={settings.preset})" if settings.source("cuda_graphs") == "preset"
                      else "")
            raise BatchInvarianceConfigError(
                f"vllm_bi: VLLM_BI_CUDA_GRAPHS=decode{origin} captures decode steps, which Kimi Linear's glue plans on "
                "the host; set VLLM_BI_CUDA_GRAPHS=off for Kimi Linear on CUDA")
        if settings.attention_op("cuda", mla=True) != "torch":
            raise BatchInvarianceConfigError(
                "vllm_bi: Kimi Linear on CUDA attends with the torch attention op (the Triton kernel takes "
                "power-of-two head dims; MLA's are 128 + 64); unset VLLM_BI_ATTENTION or set it to auto or torch")
    else:
        return False
    backend = KIMI_MLA_BACKEND[device]
    chosen = _chosen_attention_backend(args)
    if chosen is None:
        args.attention_backend = backend
    elif backend not in str(chosen):
        raise BatchInvarianceConfigError(
            f"vllm_bi: Kimi Linear's batch-invariant MLA forward reads the {backend} backend's metadata; the chosen "
            f"attention backend {chosen} would not give it. Drop --attention-backend or choose {backend}.")
    if device == "cuda":
        args.enforce_eager = True
        from vllm_bi.settings import CUDA_FEATURES

        logger.warning("vllm_bi: Kimi Linear on CUDA%s: attention backend %s, KDA in the recurrent GDN mode, eager "
                       "steps", "" if "kimi-linear" in CUDA_FEATURES else
                       " (VLLM_BI_CUDA_PREVIEW: no GPU gate has shown it exact yet)", backend)
    return True


def wrap_cpu_platform_config(orig):
    """``CpuPlatform.check_and_update_config`` that keeps chunked prefill, prefix caching and the step's token budget
    as asked for a Kimi Linear model. vLLM's CPU platform turns the first two off for every MLA model because its
    MLA kernels have no chunked context; the batch-invariant MLA forward
    (:func:`vllm_bi.model_executor.attention.bi_mla_forward`) reads every row's keys from the latent cache itself,
    whatever part of the prompt an earlier step or another request computed."""
    func = orig.__func__

    @functools.wraps(func)
    def check_and_update_config(cls, vllm_config):
        mc = vllm_config.model_config
        kimi = mc is not None and "KimiLinearForCausalLM" in (getattr(mc, "architectures", None) or ())
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        asked = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        func(cls, vllm_config)
        if kimi:
            sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = asked

    return classmethod(check_and_update_config)


def _check_graphs(config) -> None:
    """``VLLM_BI_CUDA_GRAPHS=decode``: refuse what a captured decode step cannot run.

    By default vllm_bi runs CUDA steps eagerly: its glue plans each step on the host. A step of one-token decodes
    needs no host plan: the GDN glue (recurrent mode) reads its state slots from the metadata's device
    tensor, the chunk mode with ``VLLM_BI_CHUNK_DECODE=padded`` builds its block indices on the device from the
    computed-token counts, and the Triton attention builds its tiles on the device. With this setting vLLM captures such steps whole
    (``cudagraph_mode=FULL_DECODE_ONLY``, no torch.compile) and replays them; prefills and mixed steps stay eager. A
    captured step runs the same kernels on the same rows as an eager one, so its bits are the same; padded rows read
    and write vLLM's null slot and block. :meth:`vllm_bi.settings.Settings.graph_blockers` lists what a decode step
    still reads on the host (and is refused here)."""
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
    if tiles and gemm_mode("cuda" if platform.is_cuda() else "cpu") == "triton":
        logger.info("vllm_bi: Triton GEMM tiles for %d weight shapes (%s) from %s", len(shapes), arch, tiles)


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
        if not current_settings().cuda_ops == "vllm_bi":  # vLLM's own kernels and NCCL's all-reduce order: never measured
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

    gemm = gemm_mode("cuda" if platform.is_cuda() else "cpu")
    if gemm != "fp64":  # row-parallel partials are summed exactly in float64; the trainer's TP=1 GEMM
        raise BatchInvarianceConfigError(  # would be the Triton one: other bits
            f"vllm_bi: tensor parallelism (--tensor-parallel-size {tp}) needs the exact float64 GEMM; set "
            f"VLLM_BI_GEMM=fp64 (it is {gemm!r}) or use --tensor-parallel-size 1.")
    hf = config.model_config.hf_text_config
    gdn_heads = {n: int(getattr(hf, n, 0) or 0) for n in ("linear_num_key_heads", "linear_num_value_heads")}
    uneven = {n: h for n, h in gdn_heads.items() if h and h % tp}
    if uneven:
        raise BatchInvarianceConfigError(
            f"vllm_bi: tensor parallelism {tp} does not divide the model's GDN heads ({uneven}); each rank "
            "needs whole heads. Use a --tensor-parallel-size that divides them.")
    logger.info("vllm_bi: tensor parallelism %d: row-parallel layers all-reduce exact float64 partial sums", tp)
