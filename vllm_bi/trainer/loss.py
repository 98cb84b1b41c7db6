"""GRPO / DAPO policy loss.

Advantages are group-normalised: ``A_i = (r_i - mean_g) / (std_g + eps)`` over the
``group_size`` samples of one prompt, shared by all tokens of sample ``i``. The
surrogate is the clipped importance-weighted advantage with an asymmetric clip
(DAPO's clip-higher: ``1 - clip_low <= ratio <= 1 + clip_high``), averaged over
all completion tokens of the batch (token-level mean). The ratio is
``exp(logp_trainer - logp_rollout)`` with the *rollout* logprobs the server
returned: with vllm_bi these equal the trainer's bit for bit when the batch is
on-policy, so the ratio is exactly 1 there and any deviation is staleness.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "clipped_surrogate"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``rewards [G*group_size]`` (group-major) -> (advantages, per-sample mask of groups with reward spread)."""
    r = rewards.view(-1, group_size).double()
    mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, unbiased=False, keepdim=True)
    adv = ((r - mean) / (std + eps)).float().reshape(-1)
    spread = (std > 0).expand_as(r).reshape(-1)
    return adv, spread


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      clip_low: float, clip_high: float, denom: int) -> tuple[torch.Tensor, dict]:
    """Per-token tensors ``[N]`` -> (loss summed over these tokens / ``denom``, stats).

    ``denom`` is the batch's total token count, so summing the returned losses of
    micro-batches gives the token-level mean over the batch.
    """
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surr = torch.minimum(ratio * adv, clipped * adv)
    loss = -surr.sum() / denom
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return loss, {"clipped": int(was_clipped.sum()), "ratio_max": float(ratio.detach().max()) if ratio.numel() else 1.0}
