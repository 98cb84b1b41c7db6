"""Refuse to serve a model that holds a layer vllm_bi has not made batch-invariant.

Run after the model is loaded (CPU runner). A module is accepted when its
class is in :data:`BATCH_INVARIANT_LAYERS` (each entry says why), or when it is
a plain container: no parameters of its own and not a vLLM custom op. Layers
with a quantization method must use the unquantized one vllm_bi routes to its
GEMM. Anything else stops the engine with the layer's name and class.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["audit_model", "BATCH_INVARIANT_LAYERS", "UnsupportedLayerError"]


class UnsupportedLayerError(RuntimeError):
    pass


BATCH_INVARIANT_LAYERS: dict[str, str] = {
    # GEMMs (quant_method checked below)
    "ColumnParallelLinear": "ops.linear.bi_linear",
    "MergedColumnParallelLinear": "ops.linear.bi_linear",
    "QKVParallelLinear": "ops.linear.bi_linear",
    "RowParallelLinear": "ops.linear.bi_linear",
    "ReplicatedLinear": "ops.linear.bi_linear",
    "GateLinear": "ops.linear.bi_linear (BI disables the specialised router tiers)",
    "VocabParallelEmbedding": "row lookup; lm_head via ops.linear.bi_linear",
    "ParallelLMHead": "ops.linear.bi_linear",
    "LogitsProcessor": "no arithmetic besides the lm_head GEMM (no soft-cap / scale on these models)",
    # norms and activations
    "GemmaRMSNorm": "ops.norm.rms_norm",
    "RMSNorm": "ops.norm.rms_norm",
    "RMSNormGated": "ops.norm.gated_rms_norm",
    "SiluAndMul": "ops.activation.silu_mul",
    "RotaryEmbedding": "ops.rotary.apply_rotary",
    "ApplyRotaryEmb": "never called: ops.rotary replaces RotaryEmbedding's forward",
    # mixers
    "QwenGatedDeltaNetAttention": "model_executor.gdn.bi_gdn_forward",
    "KimiGatedDeltaNetAttention": "model_executor.gdn.bi_kda_forward (checked below)",
    "MultiHeadLatentAttention": "model_executor.attention.bi_mla_forward (checked below)",
    "Qwen2MoeMLP": "container: gate_up GEMM, SiluAndMul, down GEMM",
    "Attention": "CPU_ATTN impl routed to ops.attention.causal_attention (checked below)",
    # MoE
    "ChunkGatedDeltaRule": "never called: bi_gdn_forward replaces the path that uses it",
    "MoERunner": "routing via ops.moe.softmax_topk, shared expert via the layers above",
    "RoutedExperts": "experts via ops.moe.moe_experts (checked below)",
    "UnquantizedFusedMoEMethod": "holder of the experts kernel checked under RoutedExperts",
}


def _check_routed_experts(m: torch.nn.Module) -> str | None:
    from vllm_bi.patch.cpu_moe import experts_apply

    qm = getattr(m, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(type(experts), "apply", None) is not experts_apply:
        return f"experts kernel {type(experts).__name__} is not vllm_bi's"
    return None


def _check_dispatch(m: torch.nn.Module) -> str | None:
    """A patched custom op must dispatch to vllm_bi's forward (a subclass may override it)."""
    fm = getattr(m, "_forward_method", None)
    fn = getattr(fm, "__func__", fm)
    if getattr(fn, "__module__", "") != "vllm_bi.patch.cpu_layers":
        return f"dispatches to {getattr(fn, '__qualname__', fn)}, not to vllm_bi"
    return None


def _check_attention(m: torch.nn.Module) -> str | None:
    from vllm_bi.model_executor.attention import bi_cpu_attn_forward

    impl = getattr(m, "impl", None)
    if getattr(type(impl), "forward", None) is not bi_cpu_attn_forward:
        return f"attention backend impl {type(impl).__name__} is not vllm_bi's"
    return None


def _check_kda(m: torch.nn.Module) -> str | None:
    from vllm_bi.model_executor.gdn import bi_kda_forward

    if getattr(type(m), "forward", None) is not bi_kda_forward:
        return "its forward is not vllm_bi's"
    return None


def _check_mla(m: torch.nn.Module) -> str | None:
    from vllm_bi.model_executor.attention import bi_mla_forward, mla_unsupported

    if getattr(type(m), "forward", None) is not bi_mla_forward:
        return "its forward is not vllm_bi's"
    reason = mla_unsupported(m)
    return f"{reason} is not batch-invariant yet" if reason else None


# modules whose arithmetic their parent's replaced forward runs itself: accepted only under such a parent
_RUN_BY_PARENT = {"FusedRMSNormGated": ("KimiGatedDeltaNetAttention", "o_norm")}


_EXTRA_CHECKS = {
    "KimiGatedDeltaNetAttention": _check_kda,
    "MultiHeadLatentAttention": _check_mla,
    "Attention": _check_attention,
    "RoutedExperts": _check_routed_experts,
    "GemmaRMSNorm": _check_dispatch,
    "RMSNorm": _check_dispatch,
    "RMSNormGated": _check_dispatch,
    "SiluAndMul": _check_dispatch,
    "RotaryEmbedding": _check_dispatch,
}

_ALLOWED_QUANT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}


def _is_custom_op(m: torch.nn.Module) -> bool:
    for base in type(m).__mro__:
        if base.__name__ in ("CustomOp", "PluggableLayer"):
            return True
    return False


def _known(m: torch.nn.Module) -> str | None:
    for base in type(m).__mro__:
        if base.__name__ in BATCH_INVARIANT_LAYERS:
            return base.__name__
    return None


def audit_model(model: torch.nn.Module) -> dict[str, int]:
    """Check every module; returns ``{accepted class name: count}`` or raises :class:`UnsupportedLayerError`."""
    seen: dict[str, int] = {}
    problems: list[str] = []
    modules = dict(model.named_modules())
    for name, m in model.named_modules():
        known = _known(m)
        owner = _RUN_BY_PARENT.get(type(m).__name__)
        if known is None and owner is not None and "." in name:
            parent_name, attr = name.rsplit(".", 1)
            parent = modules.get(parent_name)
            if (attr == owner[1] and parent is not None and _known(parent) == owner[0]
                    and _EXTRA_CHECKS[owner[0]](parent) is None):
                seen[type(m).__name__] = seen.get(type(m).__name__, 0) + 1
                continue
        own_params = any(True for _ in m.parameters(recurse=False))
        if known is None:
            if own_params or _is_custom_op(m):
                problems.append(f"{name or '<root>'} ({type(m).__name__})")
            continue
        qm = getattr(m, "quant_method", None)
        if qm is not None and type(qm).__name__ not in _ALLOWED_QUANT_METHODS:
            problems.append(f"{name} ({type(m).__name__} with {type(qm).__name__})")
            continue
        check = _EXTRA_CHECKS.get(known)
        reason = check(m) if check else None
        if reason:
            problems.append(f"{name} ({type(m).__name__}: {reason})")
            continue
        seen[type(m).__name__] = seen.get(type(m).__name__, 0) + 1
    if problems:
        raise UnsupportedLayerError(
            "vllm_bi: VLLM_BATCH_INVARIANT=1, but these layers have no batch-invariant implementation "
            "in vllm_bi: " + ", ".join(problems[:10]) + (" ..." if len(problems) > 10 else "")
            + ". Unset VLLM_BATCH_INVARIANT to serve this model without the guarantee."
        )
    return seen


def wrap_load_model(orig):
    """``CPUModelRunner.load_model``, then :func:`audit_model` on the loaded model."""

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        audit_model(self.model)
        return result

    return load_model
