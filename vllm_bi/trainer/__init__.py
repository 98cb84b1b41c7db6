"""A thin RL trainer for GDN hybrids against a live batch-invariant vLLM server.

``python -m vllm_bi.trainer --help``. The model it trains is
:class:`vllm_bi.models.qwen_gdn.QwenGDNForCausalLM` (the same
op library the server runs), so the logprob it computes for a sampled token
equals the one the server returned, bit for bit, whenever both hold the same
weights.
"""

from vllm_bi.trainer.config import TrainerConfig

__all__ = ["TrainerConfig"]
