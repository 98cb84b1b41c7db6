"""vllm_bi inside other training stacks: adapters that give their models the server's bits.

:mod:`vllm_bi.integrations.transformers`: ``apply(model)`` routes a Hugging Face ``transformers`` GDN hybrid through
the trainer model's functions (:mod:`vllm_bi.models.qwen_gdn`), in place (``docs/own-trainer.md``).
"""

__all__: list[str] = []
