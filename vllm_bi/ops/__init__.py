"""The op library: one batch-invariant forward per op, shared by the vLLM engine and the trainer."""

from vllm_bi.ops.activation import silu_mul
from vllm_bi.ops.linear import bi_bmm, bi_linear, bi_mm
from vllm_bi.ops.moe import moe_experts, softmax_topk
from vllm_bi.ops.norm import fused_add_rms_norm, gated_rms_norm, rms_norm
from vllm_bi.ops.reduce import row_mean, row_sum
from vllm_bi.ops.rotary import apply_rotary
from vllm_bi.ops.softmax import log_softmax, logsumexp, softmax

__all__ = [
    "apply_rotary", "bi_bmm", "bi_linear", "bi_mm", "fused_add_rms_norm", "gated_rms_norm",
    "log_softmax", "logsumexp", "moe_experts", "rms_norm", "row_mean", "row_sum", "silu_mul",
    "softmax", "softmax_topk",
]
