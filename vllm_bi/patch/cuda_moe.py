"""MoE on CUDA with the op library (``VLLM_BI_CUDA_OPS=vllm_bi``): router and experts -> ``vllm_bi.ops.moe``.

The path vLLM 0.32 takes on CUDA for an unquantized bf16 Qwen3-Next / Qwen3.5-MoE sparse block (TP = 1, no
EP/DP, eager, ``VLLM_BATCH_INVARIANT=1``), and where this module cuts into it:

``Qwen3NextSparseMoeBlock.forward`` (models/qwen3_next.py; Qwen3.5-MoE reuses the block)
  -> ``self.experts(hidden_states, router_logits=hidden_states)``: ``MoERunner.forward``
     (fused_moe/runner/moe_runner.py) -> ``torch.ops.vllm.moe_forward_shared`` (a custom op registered at
     import; its body ``_moe_forward_shared`` only looks the runner up by layer name and calls
     ``MoERunner._forward_impl``, so class attributes patched before the model is built are what runs)
  -> ``_forward_impl``: shared expert (``Qwen2MoeMLP``: gate_up / down through ``UnquantizedLinearMethod``,
     ``SiluAndMul``, ``sigmoid(shared_expert_gate(x)) * out``), on an aux CUDA stream for small batches;
     router logits ``self.gate(x)`` = ``GateLinear.forward`` -> [patched here: always the
     ``ReplicatedLinear`` tier, i.e. ``UnquantizedLinearMethod.apply`` = ``bi_linear``]
  -> ``_apply_quant_method``: ``FusedTopKRouter.select_experts`` -> ``_compute_routing`` -> ``fused_topk``
     -> ``ops.topk_softmax`` (CUDA C++) [patched here: ``ops.moe.softmax_topk``]
  -> ``RoutedExperts.forward_modular`` -> ``UnquantizedFusedMoEMethod.apply`` -> ``forward_cuda`` ->
     ``forward_native`` -> ``FusedMoEKernel.apply`` (modular_kernel.py) -> ``MoEPrepareAndFinalizeNoDPEPModular
     .prepare`` (no-op for bf16) -> ``TritonExperts.apply`` (experts/triton_moe.py; the only unquantized experts
     class that passes the oracle's batch-invariance filter) [patched here: ``ops.moe.moe_experts`` into
     ``output``] -> ``finalize`` with ``TopKWeightAndReduceNoOP`` (copies ``output`` out)
  -> ``shared_output + fused_output`` (bf16 add), as in the trainer's ``SparseMoE.forward``.

Weights stay in vLLM's layout, the one ``moe_experts`` reads: ``w13_weight [E, 2I, H]`` ([gate; up] per
expert), ``w2_weight [E, H, I]``. With the TRITON backend ``process_weights_after_loading`` only makes them
contiguous (no padding: that is ROCm's ``VLLM_ROCM_MOE_PADDING``; no shuffle: FlashInfer/AITER only); a
wrapper checks that after loading and refuses anything else (another backend, LoRA, EP, padding, bias).
"""

from __future__ import annotations

import functools

__all__ = ["fused_topk_compute_routing", "grouped_topk_compute_routing", "refuse_routing", "gate_linear_forward",
           "refuse_fused_gate", "triton_experts_apply", "check_moe_method", "wrap_process_weights"]


# --------------------------------------------------------------------------- router


def fused_topk_compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
    """``FusedTopKRouter._compute_routing`` -> ``ops.moe.softmax_topk`` (the trainer's router)."""
    from vllm_bi.ops.moe import softmax_topk

    if self.scoring_func != "softmax":
        raise NotImplementedError(f"vllm_bi: MoE scoring function {self.scoring_func!r} is not batch-invariant yet")
    return softmax_topk(router_logits, self.top_k, self.renormalize)


def grouped_topk_compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
    """``GroupedTopKRouter._compute_routing`` -> :func:`vllm_bi.patch.cpu_moe.grouped_topk` (the trainer's
    ``ops.moe.sigmoid_topk``: Kimi Linear's router, sigmoid scores in one expert group, the score correction bias,
    renormalised, scaled). Fused shared experts and any other grouping or scoring are refused by name; so is every
    grouped router while the ``kimi-linear`` CUDA feature is off (:meth:`vllm_bi.settings.Settings.cuda_feature`)."""
    from vllm_bi.patch.cpu_moe import grouped_topk
    from vllm_bi.settings import current

    if not current().cuda_feature("kimi-linear"):
        raise NotImplementedError(
            "vllm_bi: MoE router GroupedTopKRouter is served on CUDA for Kimi Linear only, as a preview not yet shown "
            "exact on a GPU: set VLLM_BI_CUDA_PREVIEW=kimi-linear to measure it, or serve without "
            "VLLM_BATCH_INVARIANT=1")
    if getattr(self, "num_fused_shared_experts", 0):
        raise NotImplementedError(
            f"vllm_bi: MoE routing with {self.num_fused_shared_experts} fused shared experts is not batch-invariant "
            "yet (shared experts as their own MLP are); serve without fusing them")
    bias = self.e_score_correction_bias
    return grouped_topk(router_logits, self.top_k, self.renormalize, self.num_expert_group, self.topk_group,
                        self.scoring_func, self.routed_scaling_factor, None if bias is None else bias.data)


def refuse_routing(self, *args, **kwargs):
    raise NotImplementedError(
        f"vllm_bi: MoE router {type(self).__name__} has no batch-invariant implementation in vllm_bi's op library "
        "(only plain softmax top-k routing, as in Qwen3-Next / Qwen3.5-MoE, is covered)")


def gate_linear_forward(self, x):
    """``GateLinear.forward`` without its cuBLAS / cuteDSL / fp32 tiers: ``ReplicatedLinear.forward`` (bi_linear),
    as vLLM's last tier runs it: with an fp32 ``out_dtype`` (Kimi Linear's gate) the product is bi_linear's in the
    weight's dtype, then cast to fp32 (the trainer's ``bi_linear(x, w).float()``), not an fp32 GEMM."""
    import torch
    from vllm.model_executor.layers.linear import ReplicatedLinear

    if not getattr(self, "is_unquantized", True):
        raise NotImplementedError("vllm_bi: a quantized MoE gate is not batch-invariant yet")
    if self.out_dtype is None or self.out_dtype == x.dtype:
        return ReplicatedLinear.forward(self, x)
    if self.out_dtype != torch.float32 or x.dtype != self.weight.dtype:
        # the trainer's router reads bi_linear's output in the activation dtype, or that output cast to fp32
        raise NotImplementedError(f"vllm_bi: MoE gate with out_dtype {self.out_dtype} over {x.dtype} activations "
                                  "is not batch-invariant yet")
    out = ReplicatedLinear.forward(self, x)
    if isinstance(out, tuple):
        return out[0].to(self.out_dtype), out[1]
    return out.to(self.out_dtype)


def refuse_fused_gate(self):
    raise NotImplementedError(
        "vllm_bi: the fused router + shared-expert gate GEMM (shared expert fused into the routed experts) is not "
        "batch-invariant yet")


# --------------------------------------------------------------------------- experts


def triton_experts_apply(
    self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
    expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
    apply_router_weight_on_input,
):
    """``TritonExperts.apply`` (same signature) -> ``ops.moe.moe_experts``; writes the weighted, reduced result
    ``[M, H]`` into ``output`` as the Triton kernel does (its finalize is ``TopKWeightAndReduceNoOP``)."""
    from vllm_bi.ops.moe import moe_experts

    if expert_map is not None:
        raise NotImplementedError("vllm_bi: expert parallelism is not batch-invariant yet")
    if str(getattr(activation, "name", activation)).upper() != "SILU":
        raise NotImplementedError(f"vllm_bi: MoE activation {activation} is not batch-invariant yet")
    if apply_router_weight_on_input:
        # vLLM's prepare step has already scaled the input by the weight; the trainer's SparseMoE never does
        raise NotImplementedError("vllm_bi: apply_router_weight_on_input is not batch-invariant yet")
    qc = self.quant_config
    if qc.is_quantized or qc.weight_quant_dtype is not None or a1q_scale is not None:
        raise NotImplementedError("vllm_bi: quantized MoE experts are not batch-invariant yet")
    if qc.w1_bias is not None or qc.w2_bias is not None:
        raise NotImplementedError("vllm_bi: MoE experts with bias are not batch-invariant yet")
    act = self.activation_config
    if act.clamp_limit is not None or (act.alpha, act.beta) != (1.0, 0.0):
        raise NotImplementedError("vllm_bi: clamped / scaled SwiGLU MoE activation is not batch-invariant yet")
    if getattr(self, "_lora_context", None) is not None:
        raise NotImplementedError("vllm_bi: MoE LoRA is not batch-invariant yet")
    if w1.shape[0] != w2.shape[0] or w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1]:
        raise NotImplementedError(
            f"vllm_bi: MoE expert weights w13 {tuple(w1.shape)} / w2 {tuple(w2.shape)} are not in the "
            "[E, 2I, H] / [E, H, I] layout the op library reads")
    output.copy_(moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, False))


triton_experts_apply._vllm_bi = True


def check_moe_method(method, layer) -> None:
    """After ``process_weights_after_loading``: the layer runs ``TritonExperts`` (patched) behind the no-DP/EP
    prepare/finalize, with unpadded, unshuffled ``[E, 2I, H]`` / ``[E, H, I]`` weights; else refuse."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    def refuse(why: str):
        name = getattr(layer, "layer_name", "?")
        raise NotImplementedError(
            f"vllm_bi: MoE layer {name}: {why} is not batch-invariant with VLLM_BI_CUDA_OPS=vllm_bi yet")

    cfg = layer.moe_config
    if method.unquantized_backend != UnquantizedMoeBackend.TRITON:
        refuse(f"unquantized MoE backend {method.unquantized_backend.value}")
    kernel = method.moe_kernel
    if kernel is None or kernel.is_monolithic:
        refuse("a monolithic MoE kernel")
    if not getattr(type(kernel.fused_experts).apply, "_vllm_bi", False):
        refuse(f"experts kernel {type(kernel.fused_experts).__name__}")
    if type(kernel.prepare_finalize) is not MoEPrepareAndFinalizeNoDPEPModular:
        refuse(f"prepare/finalize {type(kernel.prepare_finalize).__name__} (DP / EP)")
    if cfg.is_lora_enabled:
        refuse("MoE LoRA")
    if cfg.has_bias:
        refuse("expert bias")
    scale = float(getattr(layer, "routed_scaling_factor", 1.0))
    if scale != 1.0 and not getattr(layer, "use_grouped_topk", False):
        # a grouped layer's router scales the routing weights (grouped_topk_compute_routing, as the trainer's
        # sigmoid_topk does); any other router handed a scale is refused when it routes
        refuse(f"routed_scaling_factor {scale} without grouped top-k routing")
    E, H, inter = cfg.num_local_experts, cfg.hidden_dim, cfg.intermediate_size_per_partition
    if (cfg.hidden_dim_unpadded not in (None, H)
            or cfg.intermediate_size_per_partition_unpadded not in (None, inter)):
        refuse(f"padded expert weights (H {cfg.hidden_dim_unpadded}->{H}, "
               f"I {cfg.intermediate_size_per_partition_unpadded}->{inter})")
    w13, w2 = layer.w13_weight, layer.w2_weight
    if tuple(w13.shape) != (E, 2 * inter, H) or tuple(w2.shape) != (E, H, inter):
        refuse(f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} (want {(E, 2 * inter, H)} / "
               f"{(E, H, inter)})")
    if getattr(w13, "is_shuffled", False) or getattr(w2, "is_shuffled", False):
        refuse("shuffled expert weights")


def wrap_process_weights(orig):
    @functools.wraps(orig)
    def process_weights_after_loading(self, layer):
        orig(self, layer)
        check_moe_method(self, layer)

    return process_weights_after_loading
