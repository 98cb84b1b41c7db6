"""Push a Hugging Face ``transformers`` model's weights into a running batch-invariant server, keeping parity.

For a trainer of its own (``docs/own-trainer.md``): after each optimizer step, between rollout batches,

.. code-block:: python

    from vllm_bi.client import VllmClient
    from vllm_bi.integrations.weight_sync import HFWeightSync

    server = VllmClient("http://127.0.0.1:8000", model=ckpt)    # VLLM_SERVER_DEV_MODE=1, its API key
    sync = HFWeightSync(server, run_dir="runs/x", base_model=ckpt)
    sync.push(model, version=0)                                   # before the first rollout: checks the layout
    for step in range(1, steps + 1):
        ...                                                       # rollouts (none in flight at a push), train
        sync.push(model, version=step)                            # raises PushFailed on any failure

Each version is written as an HF checkpoint (``run_dir/weights/v<version>``, atomically): ``model.safetensors`` of
the model's parameters under the checkpoint's tensor names (transformers' own inverse of its load-time renames and
fusions, what ``save_pretrained`` writes; a tied LM head once) and every other file of ``base_model`` (config,
tokenizer) copied as it is. The swap, its order and its atomicity, the version labels and the digest check are
:class:`vllm_bi.weight_push.WeightPush`'s, the same as vllm_bi's own trainer: a failed push raises
:class:`~vllm_bi.weight_push.PushFailed` in one line naming the step, with the server back on the last good version
(or paused, when there is none).
"""

from __future__ import annotations

from vllm_bi.model_dir import write_checkpoint
from vllm_bi.weight_push import SWAP_STEPS, ModelMismatch, PushFailed, WeightMismatch, WeightPush

__all__ = ["HFWeightSync", "checkpoint_state_dict", "PushFailed", "WeightMismatch", "ModelMismatch", "SWAP_STEPS"]


def checkpoint_state_dict(model) -> dict:
    """``model``'s parameters (detached, a tied weight once) under the names of the checkpoint it was loaded from:
    transformers' inverse of the renames and fusions it applies at load (a MoE block's stacked experts become the
    checkpoint's per-expert tensors), as its ``save_pretrained`` writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    params = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if type(t).__name__ == "DTensor":
            raise ValueError(f"{name} is sharded (a DTensor): push from an unsharded model")
        params[name] = t
    return revert_weight_conversion(model, params)


class HFWeightSync(WeightPush):
    """``HFWeightSync(client, run_dir, base_model, keep=2, verify=True)``; ``push(model, version)`` (see the module
    doc). ``model``: the transformers model being trained (unwrapped: not DDP / accelerate-wrapped)."""

    def __init__(self, client, run_dir: str, base_model: str, keep: int = 2, verify: bool = True):
        super().__init__(client, run_dir, base_model, keep, verify)

    def state_dict(self, model) -> dict:
        return checkpoint_state_dict(model)

    def write(self, model, path: str, state: dict) -> None:
        write_checkpoint(path, state, like=self.base_model)
