"""MoE on CPU: vLLM's CPU experts and router -> :mod:`vllm_bi.ops.moe` (the trainer's experts and router).

Stock CPU experts are not batch-invariant (vLLM's oracle refuses them under BI) and pack the weights per ISA; here
the weights stay unpacked and every (token, expert) product is :func:`vllm_bi.ops.linear.bi_linear`. Under
tensor parallelism the experts' down projections are summed exactly over the ranks, so the MoE runner's
all-reduces are skipped.
"""

from __future__ import annotations

import functools

__all__ = ["experts_apply", "grouped_topk", "SUPPORTS_BATCH_INVARIANCE", "wrap_reduce_final_output",
           "wrap_reduce_shared_expert_output"]


def experts_apply(
    self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
    expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
    apply_router_weight_on_input,
):
    from vllm_bi.ops.moe import moe_experts
    from vllm_bi.patch.cpu_layers import exact_tp_sum

    if expert_map is not None:
        raise NotImplementedError("vllm_bi: expert parallelism is not batch-invariant yet")
    if str(getattr(activation, "name", activation)).upper() not in ("SILU",):
        raise NotImplementedError(f"vllm_bi: MoE activation {activation} is not batch-invariant yet")
    from vllm.distributed import get_tensor_model_parallel_world_size

    # TP: w1/w2 hold this rank's slice of each expert's intermediate dim; the down projections' exact
    # partials are summed over the ranks before rounding, so every rank holds the TP = 1 result (and the
    # MoE runner's all-reduce is skipped, see wrap_reduce_final_output).
    exact = exact_tp_sum if get_tensor_model_parallel_world_size() > 1 else None
    output.copy_(moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
                             sum_partials=exact))


def grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func, routed_scaling_factor,
                 e_score_correction_bias):
    """vLLM's CPU grouped top-k router -> :func:`vllm_bi.ops.moe.sigmoid_topk` (Kimi Linear's router: sigmoid
    scores, one expert group, a score correction bias, renormalised, scaled). Any other grouping or scoring is
    refused by name: the trainer has no router for it."""
    from vllm_bi.ops.moe import sigmoid_topk

    if scoring_func != "sigmoid" or num_expert_group not in (None, 1) or topk_group not in (None, 1):
        raise NotImplementedError(f"vllm_bi: MoE routing with {scoring_func} scores over {num_expert_group} expert "
                                  "groups is not batch-invariant yet (sigmoid scores in one group are)")
    return sigmoid_topk(gating_output, topk, renormalize, e_score_correction_bias, routed_scaling_factor)


def _true() -> bool:
    return True


SUPPORTS_BATCH_INVARIANCE = staticmethod(_true)


def wrap_reduce_final_output(final):
    """Under TP the routed experts already hold exact full sums on every rank (:func:`experts_apply`): the
    runner's all-reduce would add them twice."""

    @functools.wraps(final)
    def _maybe_reduce_final_output(self, states, trunc_size, output_is_reduced=None):
        if self.moe_config.tp_size > 1:
            return final(self, states, trunc_size, True)
        return final(self, states, trunc_size, output_is_reduced)

    return _maybe_reduce_final_output


def wrap_reduce_shared_expert_output(shared):
    """Under TP the shared expert's down projection is already summed exactly
    (``cpu_layers.wrap_row_parallel_forward``): no all-reduce."""

    @functools.wraps(shared)
    def _maybe_reduce_shared_expert_output(self, shared_output, fused_output_is_reduced=None):
        if self.moe_config.tp_size > 1:
            return shared_output
        return shared(self, shared_output, fused_output_is_reduced)

    return _maybe_reduce_shared_expert_output
