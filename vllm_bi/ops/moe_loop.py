"""The MoE experts by a host loop over the routed experts (``VLLM_BI_MOE=loop``), and the top-k combine every
MoE path shares (:mod:`vllm_bi.ops.moe` dispatches)."""

from __future__ import annotations

import torch

from vllm_bi.ops.activation import silu_mul
from vllm_bi.ops.linear import bi_linear

__all__ = ["moe_experts_loop", "combine_topk"]


def moe_experts_loop(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input: bool = False,
                     sum_partials=None) -> torch.Tensor:
    """:func:`moe_experts` by a host loop over the routed experts.

    Each expert's down projection is an exact float64 sum rounded once to ``x.dtype`` (as ``bi_linear``).
    ``sum_partials`` (tensor parallelism: ``w13``/``w2`` hold this rank's slice of the intermediate dim) maps
    the float64 partial sums ``[T * k, H]`` to the full sums before that rounding, so every rank gets the
    unsharded bits."""
    T, k = topk_ids.shape
    H = w2.shape[1]
    if T == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    y64 = torch.zeros((T, k, H), dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        if apply_router_weight_on_input:
            xe = (xe.float() * topk_weights[tok, slot].unsqueeze(-1)).to(x.dtype)
        h = silu_mul(bi_linear(xe, w13[e]))
        y64[tok, slot] = bi_linear(h, w2[e], out_dtype=torch.float64)
    if sum_partials is not None:
        y64 = sum_partials(y64.reshape(T * k, H)).reshape(T, k, H)
    return combine_topk(y64.to(x.dtype), topk_weights, apply_router_weight_on_input)


def combine_topk(y: torch.Tensor, topk_weights: torch.Tensor, weighted_on_input: bool) -> torch.Tensor:
    """A token's output from its k expert outputs ``y [T, k, H]`` (each already rounded to the activation dtype):
    scaled by the routing weights in fp32 (unless they scaled the inputs), summed in the order of the token's
    top-k list, rounded once."""
    yf = y.float()
    if not weighted_on_input:
        yf = yf * topk_weights.float().unsqueeze(-1)
    out32 = torch.zeros(yf.shape[0], yf.shape[2], dtype=torch.float32, device=y.device)
    for j in range(yf.shape[1]):
        out32 = out32 + yf[:, j]
    return out32.to(y.dtype)
