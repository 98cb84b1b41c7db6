"""The trainer's models: the same network as the server's, built from the same checkpoint, every op from
:mod:`vllm_bi.ops` and :mod:`vllm_bi.gdn` with autograd backwards (no vLLM code runs here)."""

from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

__all__ = ["QwenGDNForCausalLM"]
