"""The policy and one update of it. The model's parameters are bf16 (exactly what the server holds, so the
forward is the server's, bit for bit); the optimizer updates fp32 master copies (AdamW) and the bf16 weights are
re-rounded from them after each step. :func:`train_on_batch` takes one optimizer step on a batch (this rank's
share of it under torchrun) or, on a non-finite loss or gradient norm, raises :class:`NaNLoss` on every rank
without changing the weights.
"""

from __future__ import annotations

import math
import time

import torch

from vllm_bi.models import from_pretrained
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.distributed import Dist
from vllm_bi.trainer.errors import NaNLoss
from vllm_bi.trainer.loss import clipped_surrogate, group_advantages
from vllm_bi.trainer.rollout import RolloutBatch

__all__ = ["Policy", "completion_logprobs", "train_on_batch", "logprob_diff_at_version"]


class Policy:
    """bf16 model + fp32 master weights + AdamW (masters sharded like the model under FSDP2)."""

    def __init__(self, model, cfg: TrainerConfig, dist: Dist):
        self.model, self.dist = model, dist
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        replicated = {id(p) for p in dist.replicated}
        self.is_replicated = [id(p) in replicated for p in self.params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        # foreach=False on every device: under FSDP2 the masters mix DTensors (sharded) and plain tensors
        # (replicated fp32 params), which the foreach kernels (CUDA's default) refuse to take in one call
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
        self.grad_clip = cfg.grad_clip

    def accumulate(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                if m.grad is None:
                    m.grad = p.grad.float()
                else:  # in place, in fp32: no fp32 copy of the bf16 gradient and no third tensor for the sum
                    m.grad.add_(p.grad)
                p.grad = None

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = m.grad = None

    def step(self) -> float:
        for m in self.masters:  # every rank must take part in the collectives below
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        rep = [m.grad for m, r in zip(self.masters, self.is_replicated) if r]
        shd = [m.grad for m, r in zip(self.masters, self.is_replicated) if not r]
        self.dist.sum_replicated_grads(rep)
        if self.dist.world == 1:
            shd, rep = [], shd + rep
        norm = math.sqrt(self.dist.sq_norm(shd, rep))
        if not math.isfinite(norm):
            self.zero_grad()
            raise NaNLoss(f"gradient norm is {norm}")
        if self.grad_clip and norm > self.grad_clip:
            for m in self.masters:
                m.grad.mul_(self.grad_clip / norm)
        self.opt.step()
        self.zero_grad()
        self.masters_to_params()
        return norm

    def checkpoint_tensors(self, with_optim: bool) -> dict:
        """The tensors a checkpoint holds, as this process holds them (DTensor shards under FSDP2): fp32
        masters and, ``with_optim``, each one's AdamW state (created as zeros where the optimizer has not
        stepped yet, so that a checkpoint's state can be loaded into them in place)."""
        sd = {"masters": {n: m.detach() for n, m in zip(self.names, self.masters)}}
        if with_optim:
            for m in self.masters:
                st = self.opt.state[m]
                if not st:  # the layout AdamW itself creates at its first step (foreach=False, not fused)
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
            sd["optim"] = {n: self.opt.state[m] for n, m in zip(self.names, self.masters)}
        return sd

    def has_optim_state(self) -> bool:
        return any(self.opt.state[m] for m in self.masters)

    def masters_to_params(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(p.dtype))


def completion_logprobs(model, samples, entropy: bool = False):
    """Per-sample logprob tensors of the tokens the model sampled (fp32, with grad; a multi-turn trajectory's tool
    tokens are left out by its ``mask``) and the entropy summed over those positions. The whole trajectory runs in
    one forward either way."""
    masks = [s.mask for s in samples]
    lps, ent = model.completion_logprobs([(s.prompt_ids, s.completion_ids) for s in samples], entropy,
                                         masks=masks if any(m is not None for m in masks) else None)
    return [lp if m is None else lp[torch.tensor(m, device=lp.device)] for lp, m in zip(lps, masks)], ent


# --------------------------------------------------------------------------- one update


def train_on_batch(policy: Policy, batch: RolloutBatch, cfg: TrainerConfig) -> dict:
    """One optimizer step on ``batch`` (this rank's share of it under torchrun). Returns the step's metrics."""
    dist = policy.dist
    samples = batch.samples
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv, spread = group_advantages(rewards, cfg.group_size)
    use = spread if cfg.algo == "dapo" else torch.ones_like(spread)
    denom = sum(s.model_tokens for s, u in zip(samples, use.tolist()) if u)
    n_tok = sum(s.model_tokens for s in samples)
    share = len(samples) // dist.world  # validated: divides evenly, so every rank runs as many micro-batches
    mine = range(dist.rank * share, (dist.rank + 1) * share)
    diff_sum = diff_max = n_diff = ent_sum = loss_sum = 0.0
    clipped, ratio_max = 0, 1.0
    t0 = time.perf_counter()
    for lo in range(mine.start, mine.stop, cfg.micro_batch_seqs):
        idx = list(range(lo, min(lo + cfg.micro_batch_seqs, mine.stop)))
        mb = [samples[i] for i in idx]
        lps, ent = completion_logprobs(policy.model, mb, entropy=True)
        ent_sum += ent
        logp = torch.cat(lps)
        old = torch.tensor([x for s in mb for x in s.logprobs], dtype=torch.float32, device=logp.device)
        d = (logp.detach() - old).abs()
        diff_sum, diff_max, n_diff = diff_sum + float(d.sum()), max(diff_max, float(d.max())), n_diff + int((d != 0).sum())
        if denom == 0:  # every group had identical rewards (dapo): nothing to learn from this batch
            continue
        keep = torch.cat([torch.full((samples[i].model_tokens,), bool(use[i])) for i in idx]).to(logp.device)
        a = torch.cat([torch.full((samples[i].model_tokens,), float(adv[i])) for i in idx]).to(logp.device)
        loss, st = clipped_surrogate(logp[keep], old[keep], a[keep], cfg.clip_low, cfg.clip_high, denom)
        if not keep.any():
            loss = logp.sum() * 0.0  # still run backward: FSDP ranks must make the same collective calls
        if dist.reduce(float(not torch.isfinite(loss)), "max"):  # every rank stops, not only the one with the NaN
            policy.zero_grad()
            raise NaNLoss(f"loss is {float(loss.detach())} (micro-batch at sample {lo}; rewards "
                          f"{[round(x, 3) for x in rewards.tolist()[:8]]}...)")
        loss.backward()
        policy.accumulate()
        loss_sum += float(loss.detach())
        clipped += st["clipped"]
        ratio_max = max(ratio_max, st["ratio_max"])
    _sync(dist.device)  # the split below times the GPU's work, not its queueing
    t_opt = time.perf_counter()
    grad_norm = policy.step() if denom else 0.0
    _sync(dist.device)
    train_s = time.perf_counter() - t0
    r = rewards.float()
    seq_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    return {
        "loss": dist.reduce(loss_sum),
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std(unbiased=False)),
        "bit_wise/logprob_diff/abs_mean": dist.reduce(diff_sum) / n_tok,
        "bit_wise/logprob_diff/max": dist.reduce(diff_max, "max"),
        "bit_wise/frac_tokens_different": dist.reduce(n_diff) / n_tok,
        "clip_fraction": dist.reduce(clipped) / max(denom, 1),
        "ratio_max": dist.reduce(ratio_max, "max"),
        "entropy": dist.reduce(ent_sum) / n_tok,
        "grad_norm": grad_norm,
        "tokens/completion": n_tok,
        "turns/mean": sum(s.turns for s in samples) / len(samples),
        "groups/used": int(use.view(-1, cfg.group_size)[:, 0].sum()),
        "trainer/tokens_per_s": seq_tokens / dist.reduce(train_s, "max"),
        "time/train_s": train_s,
        "time/forward_backward_s": t_opt - t0,  # the trainer's logprobs, the loss and its backward
        "time/optimizer_s": train_s - (t_opt - t0),  # gradient reduction, clipping, AdamW, masters to bf16
    }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def logprob_diff_at_version(model_dir: str, batch: RolloutBatch, device: str = "cpu") -> float:
    """Recompute ``batch`` with the weights it was sampled under; max |trainer - server| (0.0 = staleness only)."""
    model = from_pretrained(model_dir).to(device)
    with torch.no_grad():
        lps, _ = completion_logprobs(model, batch.samples)
    old = torch.tensor([x for s in batch.samples for x in s.logprobs], dtype=torch.float32)
    return float((torch.cat(lps).cpu() - old).abs().max())
