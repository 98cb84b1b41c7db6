"""The RL loop: rollouts from the live BI server, GRPO/DAPO updates, weight pushes, metrics, checkpoints.

Threads: a rollout thread samples batch ``b`` as soon as the server's weight
version ``v`` satisfies ``b - v <= max_staleness`` (0: only after the previous
step's weights are pushed, i.e. on-policy), while the main thread trains on
batch ``b - 1``. Weight pushes and batch sampling never overlap (one lock), so
every token of a batch was sampled under one known version.

Policy: the model's parameters are bf16 (exactly what the server holds, so the
forward is the server's, bit for bit); the optimizer updates fp32 master copies
(AdamW) and the bf16 weights are re-rounded from them after each step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import random
import shlex
import threading
import time

import torch

from vllm_bi.client import ServerUnreachable, VllmClient
from vllm_bi.model_executor.models.hybrid import GDNHybridForCausalLM
from vllm_bi.ops.softmax import log_softmax
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.data import make_source
from vllm_bi.trainer.loss import clipped_surrogate, group_advantages
from vllm_bi.trainer.metrics import MetricsWriter
from vllm_bi.trainer.rewards import get_reward
from vllm_bi.trainer.rollout import RolloutBatch, VersionChanged, generate_batch
from vllm_bi.trainer.sync import WeightMismatch, WeightSync

__all__ = ["train", "TrainerError", "NaNLoss", "Policy", "completion_logprobs"]

logger = logging.getLogger("vllm_bi.trainer")


class TrainerError(RuntimeError):
    """A run ended on an error the user can act on; the message says what and how to resume."""


class NaNLoss(FloatingPointError):
    pass


# --------------------------------------------------------------------------- policy


class Policy:
    """bf16 model + fp32 master weights + AdamW."""

    def __init__(self, model: GDNHybridForCausalLM, cfg: TrainerConfig):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.grad_clip = cfg.grad_clip

    def accumulate(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad + g
                p.grad = None

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = m.grad = None

    def step(self) -> float:
        grads = [m.grad for m in self.masters if m.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if not math.isfinite(norm):
            self.zero_grad()
            raise NaNLoss(f"gradient norm is {norm}")
        if self.grad_clip and norm > self.grad_clip:
            for g in grads:
                g.mul_(self.grad_clip / norm)
        self.opt.step()
        self.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(p.dtype))
        return norm

    def state_dict(self) -> dict:
        return {"masters": {n: m.detach() for n, m in zip(self.names, self.masters)}, "optim": self.opt.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for n, p, m in zip(self.names, self.params, self.masters):
                m.copy_(sd["masters"][n])
                p.copy_(m.to(p.dtype))
        self.opt.load_state_dict(sd["optim"])


def completion_logprobs(model, samples, entropy: bool = False):
    """Pack ``samples`` (prompt + completion ids), one forward -> per-sample logprob tensors of the
    completion tokens (fp32, with grad), and the summed entropy over those positions (no grad)."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    ids = torch.tensor([t for s in seqs for t in s])
    lp = log_softmax(model(ids, cu), dim=-1, dtype=torch.float32)
    rows = torch.cat([torch.arange(cu[i] + len(s.prompt_ids) - 1, cu[i + 1] - 1) for i, s in enumerate(samples)])
    targets = torch.tensor([t for s in samples for t in s.completion_ids])
    tok_lp = lp[rows].gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = 0.0
    if entropy:
        with torch.no_grad():
            sel = lp[rows]
            ent = float(-(sel.exp() * sel).sum())
    return list(tok_lp.split([len(s.completion_ids) for s in samples])), ent


# --------------------------------------------------------------------------- one update


def train_on_batch(policy: Policy, batch: RolloutBatch, cfg: TrainerConfig) -> dict:
    samples = batch.samples
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv, spread = group_advantages(rewards, cfg.group_size)
    use = spread if cfg.algo == "dapo" else torch.ones_like(spread)
    denom = sum(len(s.completion_ids) for s, u in zip(samples, use.tolist()) if u)
    n_tok = sum(len(s.completion_ids) for s in samples)
    diffs, ent_sum, loss_sum, clipped, ratio_max = [], 0.0, 0.0, 0, 1.0
    t0 = time.perf_counter()
    for i in range(0, len(samples), cfg.micro_batch_seqs):
        mb = samples[i : i + cfg.micro_batch_seqs]
        lps, ent = completion_logprobs(policy.model, mb, entropy=True)
        ent_sum += ent
        logp = torch.cat(lps)
        old = torch.tensor([x for s in mb for x in s.logprobs], dtype=torch.float32)
        diffs.append((logp.detach() - old).abs())
        keep = torch.cat([torch.full((len(s.completion_ids),), bool(use[i + j])) for j, s in enumerate(mb)])
        a = torch.cat([torch.full((len(s.completion_ids),), float(adv[i + j])) for j, s in enumerate(mb)])
        if denom == 0 or not keep.any():
            continue
        loss, st = clipped_surrogate(logp[keep], old[keep], a[keep], cfg.clip_low, cfg.clip_high, denom)
        if not torch.isfinite(loss):
            policy.zero_grad()
            raise NaNLoss(f"loss is {float(loss)} (micro-batch at sample {i}; rewards {rewards.tolist()[:8]}...)")
        loss.backward()
        policy.accumulate()
        loss_sum += float(loss.detach())
        clipped += st["clipped"]
        ratio_max = max(ratio_max, st["ratio_max"])
    grad_norm = policy.step() if denom else 0.0
    train_s = time.perf_counter() - t0
    d = torch.cat(diffs)
    r = rewards.float()
    return {
        "loss": loss_sum,
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std(unbiased=False)),
        "bit_wise/logprob_diff/abs_mean": float(d.mean()),
        "bit_wise/logprob_diff/max": float(d.max()),
        "bit_wise/frac_tokens_different": float((d != 0).float().mean()),
        "clip_fraction": clipped / max(denom, 1),
        "ratio_max": ratio_max,
        "entropy": ent_sum / max(n_tok, 1),
        "grad_norm": grad_norm,
        "tokens/completion": n_tok,
        "groups/used": int(use.view(-1, cfg.group_size)[:, 0].sum()),
        "trainer/tokens_per_s": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) / train_s,
        "time/train_s": train_s,
    }


def logprob_diff_at_version(model_dir: str, batch: RolloutBatch) -> float:
    """Recompute ``batch`` with the weights it was sampled under; max |trainer - server| (0.0 = staleness only)."""
    model = GDNHybridForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        lps, _ = completion_logprobs(model, batch.samples)
    old = torch.tensor([x for s in batch.samples for x in s.logprobs], dtype=torch.float32)
    return float((torch.cat(lps) - old).abs().max())


# --------------------------------------------------------------------------- checkpoints


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoint")


def save_checkpoint(run_dir: str, policy: Policy, step: int, cfg: TrainerConfig) -> None:
    d = _ckpt_dir(run_dir)
    os.makedirs(d, exist_ok=True)
    state = {
        "policy": policy.state_dict(),
        "step": step,
        "version": step,
        "data_position": step * cfg.prompts_per_step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "config": dataclasses.asdict(cfg),
    }
    torch.save(state, os.path.join(d, "state.pt.tmp"))
    os.replace(os.path.join(d, "state.pt.tmp"), os.path.join(d, "state.pt"))
    meta = {"step": step, "version": step, "data_position": step * cfg.prompts_per_step, "time": time.time()}
    with open(os.path.join(d, "meta.json.tmp"), "w") as f:
        json.dump(meta, f)
    os.replace(os.path.join(d, "meta.json.tmp"), os.path.join(d, "meta.json"))


def load_checkpoint(run_dir: str, policy: Policy, cfg: TrainerConfig) -> int | None:
    path = os.path.join(_ckpt_dir(run_dir), "state.pt")
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=False)
    old = state["config"]
    for key in ("prompts_per_step", "group_size", "task", "seed", "model_family"):
        if old.get(key) != getattr(cfg, key):
            raise TrainerError(f"{run_dir} holds a checkpoint made with {key}={old.get(key)!r}, but this run asks for "
                               f"{getattr(cfg, key)!r}: use another --run-dir, or --resume false to start over")
    if state["data_position"] != state["step"] * cfg.prompts_per_step:
        raise TrainerError(f"{path}: inconsistent checkpoint (data position {state['data_position']} at step {state['step']})")
    policy.load_state_dict(state["policy"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])


# --------------------------------------------------------------------------- rollout thread


class RolloutThread(threading.Thread):
    def __init__(self, generate, first: int, last: int, max_staleness: int, version: int):
        super().__init__(daemon=True, name="vllm_bi-rollouts")
        self.generate, self.first, self.last, self.max_staleness = generate, first, last, max_staleness
        self.version = version
        self.cond = threading.Condition()
        self.swap_lock = threading.Lock()  # held while sampling a batch and while pushing weights
        self.out: queue.Queue = queue.Queue()
        self.stopped = False

    def set_version(self, v: int) -> None:
        with self.cond:
            self.version = v
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def run(self) -> None:
        try:
            for b in range(self.first, self.last):
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or b - self.version <= self.max_staleness)
                    if self.stopped:
                        return
                with self.swap_lock:
                    self.out.put(self.generate(b, self.version))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.out.put(e)


# --------------------------------------------------------------------------- main entry


def _start_server(cfg: TrainerConfig, model_dir: str):
    from vllm_bi.testing.server import VllmServer, cpu_env

    log = os.path.join(cfg.run_dir, "server.log")
    logger.info("starting VLLM_BATCH_INVARIANT=1 vllm serve %s (log: %s)", model_dir, log)
    srv = VllmServer(model_dir, env=cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"}),
                     args=shlex.split(cfg.server_args), log_path=log)
    srv.start()
    with open(os.path.join(cfg.run_dir, "server.pid"), "w") as f:
        f.write(str(srv.proc.pid))
    return srv


def _check_server(client: VllmClient) -> None:
    try:
        client.weight_version()
    except RuntimeError as e:
        raise TrainerError(f"{e}\nStart the server with VLLM_SERVER_DEV_MODE=1 (the trainer swaps weights through "
                           "its admin routes).") from None
    try:
        client.weight_digest()
    except RuntimeError as e:
        raise TrainerError(f"the server at {client.url} does not answer vllm_bi's weight digest ({e}); start it with "
                           "VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).") from None


def train(cfg: TrainerConfig, log=print) -> list[dict]:
    """Run ``cfg`` to ``cfg.steps`` (resuming when a checkpoint exists). Returns the metric rows of this run."""
    from transformers import AutoTokenizer

    cfg.validate()
    os.makedirs(cfg.run_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_dir = cfg.model
    if not model_dir:
        from vllm_bi.testing.tiny_models import build_tiny_model

        model_dir = os.path.abspath(os.path.join(cfg.run_dir, "base_model"))
        build_tiny_model(cfg.model_family, model_dir, seed=cfg.seed)
    model_dir = os.path.abspath(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = make_source(cfg.task, cfg.seed)
    reward_fn = get_reward(cfg.reward or source.default_reward)
    policy = Policy(GDNHybridForCausalLM.from_pretrained(model_dir), cfg)
    start = (load_checkpoint(cfg.run_dir, policy, cfg) if cfg.resume else None)
    resumed = start is not None
    start = start or 0
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg) | {"resolved_model": model_dir}, f, indent=1)
    if start >= cfg.steps:
        log(f"{cfg.run_dir}: checkpoint is at step {start} >= --steps {cfg.steps}; nothing to do")
        return []

    server = None
    rows: list[dict] = []
    rollouts = None
    saved_at = start if resumed else -1
    where = lambda: (f"The run is resumable: rerun the same command to continue from step {saved_at} "  # noqa: E731
                     f"({os.path.join(cfg.run_dir, 'checkpoint')}).")
    try:
        server = _start_server(cfg, model_dir) if not cfg.server_url else None
        client = server or VllmClient(cfg.server_url, model_dir)
        _check_server(client)
        sync = WeightSync(client, cfg.run_dir, model_dir, cfg.weight_versions_kept, cfg.verify_weights)
        sync.push(policy.model, start)
        if not resumed:
            save_checkpoint(cfg.run_dir, policy, 0, cfg)
            saved_at = 0
        metrics = MetricsWriter(cfg.run_dir, start, cfg.tensorboard)
        log(f"{'resuming at' if resumed else 'starting'} step {start}/{cfg.steps}: {cfg.prompts_per_step} prompts x "
            f"{cfg.group_size} samples, {cfg.algo}, max_staleness {cfg.max_staleness}, server {client.url}")

        def generate(b: int, v: int) -> RolloutBatch:
            return generate_batch(client, tokenizer, source, reward_fn, cfg, b, v)

        rollouts = RolloutThread(generate, start, cfg.steps, cfg.max_staleness, start)
        rollouts.start()
        from tqdm import tqdm

        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="RL steps", disable=not cfg.progress)
        for step in bar:
            t0 = time.perf_counter()
            batch = rollouts.out.get()
            if isinstance(batch, BaseException):
                raise batch
            if batch.index != step:
                raise RuntimeError(f"internal error: got batch {batch.index} for step {step}")
            wait_s = time.perf_counter() - t0
            row = {"step": step, "version": step, "sample_version": batch.version, "staleness": step - batch.version}
            row |= train_on_batch(policy, batch, cfg)
            if cfg.recompute_at_sample_version:
                row["bit_wise/logprob_diff_at_sample_version/max"] = (
                    row["bit_wise/logprob_diff/max"] if batch.version == step
                    else logprob_diff_at_version(sync.path(batch.version), batch))
            with rollouts.swap_lock:
                row |= sync.push(policy.model, step + 1)
            rollouts.set_version(step + 1)
            row |= {
                "generator/tokens_per_s": batch.completion_tokens / max(batch.gen_seconds, 1e-9),
                "time/generate_s": batch.gen_seconds,
                "time/wait_for_rollout_s": wait_s,
                "time/step_s": time.perf_counter() - t0,
                "data_position": (step + 1) * cfg.prompts_per_step,
            }
            metrics.write(row)
            rows.append(row)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(cfg.run_dir, policy, step + 1, cfg)
                saved_at = step + 1
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}", diff=f"{row['bit_wise/logprob_diff/max']:.3g}")
        metrics.close()
        return rows
    except ServerUnreachable as e:
        raise TrainerError(f"{e}. {where()}") from None
    except (WeightMismatch, VersionChanged) as e:
        raise TrainerError(f"{e} {where()}") from None
    except NaNLoss as e:
        raise TrainerError(f"{e}: the update was not applied. Lower --lr, check the reward function, "
                           f"or resume from the last good checkpoint. {where()}") from None
    finally:
        if rollouts is not None:
            rollouts.stop()
        if server is not None:
            server.stop()
