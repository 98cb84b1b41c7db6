"""CUDA own-ops glue that can be checked on CPU (``patch/cuda_ops.py``, applied from the ledger)."""

import torch

from vllm_bi.patch.ledger import LEDGER, apply_row

INIT = next(p for p in LEDGER if p.target.endswith("Qwen3NextAttention.__init__"))


def test_fused_qk_norm_rope_kernel_is_turned_off(monkeypatch):
    """Qwen3-Next/3.5 attention picks a fused q/k-norm + RoPE Triton kernel on CUDA (``use_fused_qk_norm_rope_gate``),
    which bypasses the op library; on the H200 it made every attention row but the first differ from the
    trainer. Own-ops mode must switch it off for every instance built after the patch."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    def stock_init(self, *args, **kwargs):  # what vLLM's __init__ decides on CUDA
        torch.nn.Module.__init__(self)
        self.use_fused_qk_norm_rope_gate = True
        self.args = args

    monkeypatch.setattr(Qwen3NextAttention, "__init__", stock_init)
    attn = Qwen3NextAttention(1, 2)
    assert attn.use_fused_qk_norm_rope_gate  # the control: unpatched, the fused kernel would run

    apply_row(INIT, monkeypatch.setattr)
    attn = Qwen3NextAttention(1, 2)
    assert attn.use_fused_qk_norm_rope_gate is False
    assert attn.args == (1, 2)  # the original __init__ still ran
