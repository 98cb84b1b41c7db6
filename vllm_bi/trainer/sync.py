"""The trainer's weight push: :class:`vllm_bi.weight_push.WeightPush` for :class:`~vllm_bi.models.QwenGDNForCausalLM`.

Each version is the model's bf16 weights under the HF checkpoint names (:meth:`hf_state_dict`, gathered across FSDP2
ranks) with the base checkpoint's config and tokenizer files (:meth:`save_pretrained`); the order of the swap, its
atomicity, the cache policy and the digest check are :mod:`vllm_bi.weight_push`'s.
"""

from __future__ import annotations

from vllm_bi.weight_push import SWAP_STEPS, ModelMismatch, PushFailed, WeightMismatch, WeightPush

__all__ = ["WeightSync", "WeightMismatch", "PushFailed", "ModelMismatch", "SWAP_STEPS"]


class WeightSync(WeightPush):
    """``WeightSync(client, run_dir, base_model, keep, verify)``; ``push(model, version, state=None)``."""

    def state_dict(self, model) -> dict:
        return model.hf_state_dict()

    def write(self, model, path: str, state: dict) -> None:
        model.save_pretrained(path, like=self.base_model, state_dict=state)
