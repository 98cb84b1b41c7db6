"""The trainer's non-batch-invariant baseline (``--arithmetic stock``): the same loop on transformers' own model.

What batch invariance costs an RL step is the step time against this baseline, measured on the same machine with
the same recipe: the trainer runs the checkpoint's transformers model class (cuBLAS GEMMs, SDPA attention, and
fla-core's chunked GDN kernels where transformers finds them, its torch fallback elsewhere) against a stock vLLM
server (``VLLM_BATCH_INVARIANT=0``). Its logprobs differ from the server's (the metric ``bit_wise/logprob_diff``
says by how much); nothing here claims parity. :class:`StockModel` gives that model the interface the loop uses
(:class:`~vllm_bi.models.qwen_gdn.QwenGDNForCausalLM`'s ``completion_logprobs``, ``hf_state_dict`` and
``save_pretrained``), its parameters under transformers' own names.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["StockModel"]


class StockModel(nn.Module):
    """A transformers causal LM (bf16) with the trainer model's interface."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    @classmethod
    def from_pretrained(cls, path: str) -> "StockModel":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))

    def completion_logprobs(self, pairs, entropy: bool = False, masks=None) -> tuple[list[torch.Tensor], float]:
        """As the trainer model's: each completion's per-token logprobs (fp32, differentiable) and, with
        ``entropy``, the entropy summed over those positions (``masks``: the ones marked True, where given). The
        sequences are right-padded into one batch and the log-softmax is taken in fp32 of the bf16 logits, as RL
        trainers on transformers models commonly do."""
        dev = next(self.parameters()).device
        seqs = [list(p) + list(c) for p, c in pairs]
        L = max(map(len, seqs))
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        logits = self.hf(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
        outs, ent = [], 0.0
        for i, (p, c) in enumerate(pairs):
            lp = torch.log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(c)].float(), dim=-1)
            outs.append(lp.gather(1, torch.tensor(c, device=dev).unsqueeze(1)).squeeze(1))
            if entropy:
                with torch.no_grad():
                    m = masks[i] if masks is not None else None
                    sel = lp if m is None else lp[torch.tensor(m, device=dev)]
                    ent += float(-(sel.exp() * sel).sum())
        return outs, ent

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (views, not copies: the loop only hands them back to
        :meth:`save_pretrained`, before the next update)."""
        return dict(self.hf.state_dict())

    def save_pretrained(self, path: str, like: str, state_dict: dict | None = None) -> str:
        """transformers' own save (it writes the checkpoint's tensor names back, e.g. one tensor per MoE expert),
        then every non-weight file of ``like`` over it, so the server reads the config it was started with."""
        from vllm_bi.model_dir import copy_checkpoint_files

        self.hf.save_pretrained(path)
        copy_checkpoint_files(like, path)
        return path
