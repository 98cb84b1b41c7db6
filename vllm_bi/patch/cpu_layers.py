"""The op library in vLLM's layers: linear, norms, activation, rotary, logprobs (CPU, and CUDA with the op library).

vLLM's CPU kernels (oneDNN / sgl GEMMs, the fused norms, the vectorised activation) pick their reduction order by
batch size, and on CUDA the trainer cannot reproduce vLLM's own batch-invariant kernels. Each replacement here calls
the op library (:mod:`vllm_bi.ops`), the trainer's functions, so the server computes what the trainer computes.
Tensor parallelism (CPU): row-parallel partial products are exact float64 sums, gathered and added exactly, then
rounded once: the same bits as one rank.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["bi_linear_apply", "keep_weight", "exact_tp_sum", "wrap_row_parallel_forward", "gemma_rms_forward",
           "rms_forward", "gated_rms_forward", "silu_mul_forward", "rotary_forward", "COMPUTE_LOGPROBS",
           "QWEN3_5_TEXT"]


def bi_linear_apply(self, layer, x, bias=None):
    from vllm_bi.ops.linear import bi_linear

    return bi_linear(x, layer.weight, bias)


def keep_weight(self, layer) -> None:
    return None


def exact_tp_sum(y64: torch.Tensor) -> torch.Tensor:
    """Sum a float64 tensor over the TP ranks. vLLM's CPU all-reduce has no float64, so the partials are
    all-gathered bit for bit (as float32 pairs) and added locally; exact partials sum exactly in any order."""
    from vllm.distributed import get_tp_group

    rows, cols = y64.shape
    parts = get_tp_group().all_gather(y64.contiguous().view(torch.float32), dim=0)  # [tp*rows, 2*cols]
    return parts.view(torch.float64).reshape(-1, rows, cols).sum(dim=0)


def _is_shared_expert(layer) -> bool:
    return getattr(layer, "prefix", "").endswith("shared_expert.down_proj")


def wrap_row_parallel_forward(orig):
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
        y = exact_tp_sum(y)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias.to(torch.float64)
        out = y.to(input_.dtype).reshape(*lead, y.shape[-1])
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)

    return forward


def gemma_rms_forward(self, x, residual=None):
    from vllm_bi.ops.norm import rms_norm_maybe_residual

    return rms_norm_maybe_residual(x, residual, self.weight.float() + 1.0, self.variance_epsilon)


def rms_forward(self, x, residual=None):
    from vllm_bi.ops.norm import rms_norm_maybe_residual

    if getattr(self, "variance_size_override", None) is not None:
        raise NotImplementedError("vllm_bi: RMSNorm with variance_size_override is not batch-invariant yet")
    weight = self.weight.data if getattr(self, "has_weight", True) else None
    return rms_norm_maybe_residual(x, residual, weight, self.variance_epsilon)


def gated_rms_forward(self, x, z=None):
    from vllm_bi.ops.norm import gated_rms_norm

    if getattr(self, "bias", None) is not None:
        raise NotImplementedError("vllm_bi: RMSNormGated with bias is not batch-invariant yet")
    return gated_rms_norm(x, z, self.weight, self.eps, self.norm_before_gate, self.activation, self.group_size)


def silu_mul_forward(self, x):
    from vllm_bi.ops.activation import silu_mul

    return silu_mul(x)


def rotary_forward(self, positions, query, key=None, *args, **kwargs):
    from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache

    if args or kwargs.get("offsets") is not None:
        raise NotImplementedError("vllm_bi: rotary embedding with offsets is not batch-invariant yet")
    if type(self).__name__ != "RotaryEmbedding":
        raise NotImplementedError(f"vllm_bi: {type(self).__name__} is not batch-invariant yet")
    cache = rope_cos_sin_cache(self.rotary_dim, self.max_position_embeddings, self.base, positions.device)
    return apply_rotary(positions, query, key, cache, self.head_size, self.rotary_dim, self.is_neox_style)


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    from vllm_bi.ops.softmax import log_softmax

    return log_softmax(logits, dim=-1, dtype=torch.float32)


COMPUTE_LOGPROBS = staticmethod(_compute_logprobs)


QWEN3_5_TEXT = {
    "Qwen3_5ForCausalLM": "vllm_bi.model_executor.models.qwen3_5_text:Qwen3_5TextForCausalLM",
    "Qwen3_5MoeForCausalLM": "vllm_bi.model_executor.models.qwen3_5_text:Qwen3_5MoeTextForCausalLM",
}
