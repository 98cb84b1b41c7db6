"""MoE router and experts, batch-invariant.

Router (Qwen3-Next / Qwen3.5-MoE: softmax top-k, renormalised): the router
logits come from :func:`vllm_bi.ops.linear.bi_linear` — the same bits whether
the caller batches tokens as a bmm or an mm — then top-k per token (a stable
sort: ties go to the lower expert id) and a softmax over the k selected logits.

Experts: every (token, expert) pair is ``down(silu_mul(gate_up(x)))`` through
:func:`bi_linear`, whose result for a row does not depend on which other rows
share the GEMM; the k expert outputs of a token are summed in fp32 in the
order of its top-k list, then rounded once. ``VLLM_BI_MOE`` picks how:
``loop`` (the CPU default) over the routed experts on the host, products by ``bi_linear``
(:func:`moe_experts_loop`); ``exact``, grouped float64 kernels with no host read and
the loop's bits under the float64 GEMM; ``triton``, grouped tensor-core kernels with no
host read and other bits (the CUDA default; :mod:`vllm_bi.ops.moe_triton`).
"""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.moe_loop import combine_topk, moe_experts_loop
from vllm_bi.ops.moe_triton import moe_backend, moe_experts_triton
from vllm_bi.ops.softmax import logsumexp, softmax

__all__ = ["softmax_topk", "sigmoid_topk", "moe_experts", "moe_experts_loop", "combine_topk"]


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], ids int32 [T, k])`` from ``router_logits [T, E]``."""
    # A stable sort, not torch.topk: tied logits (plausible in bf16) then pick the lower expert id first on
    # every device and for every batch size (CUDA's topk changes algorithm with the problem size).
    vals, ids = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k], ids[:, :top_k]
    if renormalize:
        w = softmax(vals.float(), dim=-1)
    else:
        w = pointwise.exp(vals.float() - logsumexp(router_logits.float()))
    return w.to(torch.float32), ids.to(torch.int32)


def sigmoid_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, correction_bias: torch.Tensor | None,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style routing (Kimi Linear's router: one expert group): ``scores = sigmoid(logits)`` in fp32, the
    ``top_k`` experts chosen by ``scores + correction_bias`` (ties to the lower expert id, a stable sort as in
    :func:`softmax_topk`), weighted by their unbiased scores, divided by the chosen scores' sum when ``renormalize``,
    then times ``scale`` (the routed scaling factor). Returns ``(weights fp32 [T, k], ids int32 [T, k])``."""
    scores = pointwise.sigmoid(router_logits.float())
    choose = scores if correction_bias is None else scores + correction_bias.float()
    _, ids = torch.sort(choose, dim=-1, descending=True, stable=True)
    ids = ids[:, :top_k]
    w = scores.gather(1, ids)
    if renormalize:
        total = w[:, :1]
        for j in range(1, top_k):  # in a fixed order, whatever the batch
            total = total + w[:, j : j + 1]
        w = w / total
    return (w * scale).to(torch.float32), ids.to(torch.int32)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
    sum_partials=None,
) -> torch.Tensor:
    """Routed experts. ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` -> ``[T, H]`` in x.dtype, by the path
    ``VLLM_BI_MOE`` picks (module doc). ``sum_partials``: tensor parallelism, the loop path only."""
    mode = moe_backend(x.device)
    if mode != "loop":
        if sum_partials is not None:
            raise NotImplementedError(f"vllm_bi: VLLM_BI_MOE={mode} with tensor parallelism: use VLLM_BI_MOE=loop")
        return moe_experts_triton(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, mode == "exact")
    return moe_experts_loop(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, sum_partials)
