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
from vllm_bi.parity import settings_mismatch
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.data import make_source
from vllm_bi.trainer.distributed import Dist
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
    """bf16 model + fp32 master weights + AdamW (masters sharded like the model under FSDP2)."""

    def __init__(self, model: GDNHybridForCausalLM, cfg: TrainerConfig, dist: Dist):
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
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad + g
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
    """Per-sample logprob tensors of the sampled tokens (fp32, with grad) and the summed entropy."""
    return model.completion_logprobs([(s.prompt_ids, s.completion_ids) for s in samples], entropy)


# --------------------------------------------------------------------------- one update


def train_on_batch(policy: Policy, batch: RolloutBatch, cfg: TrainerConfig) -> dict:
    """One optimizer step on ``batch`` (this rank's share of it under torchrun). Returns the step's metrics."""
    dist = policy.dist
    samples = batch.samples
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv, spread = group_advantages(rewards, cfg.group_size)
    use = spread if cfg.algo == "dapo" else torch.ones_like(spread)
    denom = sum(len(s.completion_ids) for s, u in zip(samples, use.tolist()) if u)
    n_tok = sum(len(s.completion_ids) for s in samples)
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
        keep = torch.cat([torch.full((len(samples[i].completion_ids),), bool(use[i])) for i in idx]).to(logp.device)
        a = torch.cat([torch.full((len(samples[i].completion_ids),), float(adv[i])) for i in idx]).to(logp.device)
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
    grad_norm = policy.step() if denom else 0.0
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
        "groups/used": int(use.view(-1, cfg.group_size)[:, 0].sum()),
        "trainer/tokens_per_s": seq_tokens / dist.reduce(train_s, "max"),
        "time/train_s": train_s,
    }


def logprob_diff_at_version(model_dir: str, batch: RolloutBatch, device: str = "cpu") -> float:
    """Recompute ``batch`` with the weights it was sampled under; max |trainer - server| (0.0 = staleness only)."""
    model = GDNHybridForCausalLM.from_pretrained(model_dir).to(device)
    with torch.no_grad():
        lps, _ = completion_logprobs(model, batch.samples)
    old = torch.tensor([x for s in batch.samples for x in s.logprobs], dtype=torch.float32)
    return float((torch.cat(lps).cpu() - old).abs().max())


# --------------------------------------------------------------------------- checkpoints


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoint")


def checkpoint_due(save_every: int, done: int, steps: int) -> bool:
    """Whether to checkpoint after ``done`` of ``steps`` steps: at 0, every ``save_every`` and at the end;
    never with ``save_every`` 0."""
    return bool(save_every) and (done == 0 or done % save_every == 0 or done == steps)


CHECKPOINT_FORMAT = 2  # torch.distributed.checkpoint folder per save + meta.json naming it


def save_checkpoint(run_dir: str, policy: Policy, step: int, cfg: TrainerConfig) -> None:
    """Every rank writes its own shards (``torch.distributed.checkpoint``; no rank gathers the model) into a
    new folder ``checkpoint/stepNNNNNN-T``; then the first rank writes the RNG states there and, atomically,
    ``meta.json`` naming it, and removes the older folders. A run killed while saving keeps the last
    complete checkpoint. Logs the size and the time taken."""
    import shutil

    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    d = _ckpt_dir(run_dir)
    name = policy.dist.broadcast(f"step{step:06d}-{time.time_ns()}")
    path = os.path.join(d, name)
    with_optim = policy.has_optim_state()
    dcp.save(policy.checkpoint_tensors(with_optim), checkpoint_id=path, no_dist=policy.dist.world == 1)
    if not policy.dist.main:
        return
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, os.path.join(path, "rng.pt"))
    meta = {"format": CHECKPOINT_FORMAT, "dir": name, "optim": with_optim, "step": step, "version": step,
            "data_position": step * cfg.prompts_per_step, "world_size": policy.dist.world,
            "config": dataclasses.asdict(cfg), "time": time.time()}
    with open(os.path.join(d, "meta.json.tmp"), "w") as f:
        json.dump(meta, f)
    os.replace(os.path.join(d, "meta.json.tmp"), os.path.join(d, "meta.json"))
    for old in os.listdir(d):
        if old.startswith("step") and old != name:
            shutil.rmtree(os.path.join(d, old), ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    logger.info("checkpoint of step %d: %.2f GB written by %d process(es) in %.1f s; --save-every sets how often",
                step, size / 1e9, policy.dist.world, time.perf_counter() - t0)


def _read_meta(run_dir: str) -> dict | None:
    d = _ckpt_dir(run_dir)
    path = os.path.join(d, "meta.json")
    if not os.path.exists(path):
        if os.path.exists(os.path.join(d, "state.pt")):
            raise TrainerError(f"{d} holds a checkpoint of an older vllm_bi (state.pt); use another --run-dir, or "
                               "--resume false to start over")
        return None
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise TrainerError(f"{path}: checkpoint format {meta.get('format')}, this vllm_bi reads {CHECKPOINT_FORMAT}; "
                           "use another --run-dir, or --resume false to start over")
    return meta


def load_checkpoint(run_dir: str, policy: Policy, cfg: TrainerConfig) -> int | None:
    """Resume from ``run_dir``'s checkpoint (None when there is none). The shards are read into this run's
    layout, so a run may resume on another number of processes."""
    import torch.distributed.checkpoint as dcp

    meta = _read_meta(run_dir)
    if meta is None:
        return None
    old = meta["config"]
    for key in ("prompts_per_step", "group_size", "task", "seed", "model_family"):
        if old.get(key) != getattr(cfg, key):
            raise TrainerError(f"{run_dir} holds a checkpoint made with {key}={old.get(key)!r}, but this run asks for "
                               f"{getattr(cfg, key)!r}: use another --run-dir, or --resume false to start over")
    if meta["data_position"] != meta["step"] * cfg.prompts_per_step:
        raise TrainerError(f"{run_dir}: inconsistent checkpoint (data position {meta['data_position']} at step "
                           f"{meta['step']})")
    path = os.path.join(_ckpt_dir(run_dir), meta["dir"])
    dcp.load(policy.checkpoint_tensors(meta["optim"]), checkpoint_id=path, no_dist=policy.dist.world == 1)
    policy.masters_to_params()
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return int(meta["step"])


def read_checkpoint(run_dir: str) -> dict:
    """A checkpoint's tensors, whole, in this process (for inspection and tests): ``{"meta": ..., "masters":
    {name: tensor}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}``."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = _read_meta(run_dir)
    if meta is None:
        raise FileNotFoundError(f"no checkpoint in {run_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(os.path.join(_ckpt_dir(run_dir), meta["dir"]), out)
        state = torch.load(out, weights_only=False)
    return {"meta": meta, **state}


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


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _start_server(cfg: TrainerConfig, model_dir: str):
    from vllm_bi.testing.server import VllmServer, cpu_env

    log = os.path.join(cfg.run_dir, "server.log")
    logger.info("starting VLLM_BATCH_INVARIANT=1 vllm serve %s (log: %s)", model_dir, log)
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    for k in [k for k in env if k in _TORCHRUN_ENV or k.startswith("TORCHELASTIC_")]:
        del env[k]  # the server is not part of the trainer's process group
    srv = VllmServer(model_dir, env=env, args=shlex.split(cfg.server_args), log_path=log)
    t0 = time.perf_counter()
    srv.start()
    logger.info("server ready in %.0f s", time.perf_counter() - t0)
    with open(os.path.join(cfg.run_dir, "server.pid"), "w") as f:
        f.write(str(srv.proc.pid))
    return srv


def _check_server(client: VllmClient, verify_weights: bool = True) -> None:
    try:
        client.weight_version()
    except RuntimeError as e:
        raise TrainerError(f"{e}\nStart the server with VLLM_SERVER_DEV_MODE=1 (the trainer swaps weights through "
                           "its admin routes).") from None
    infos = client.collective_rpc("vllm_bi_info")  # one entry per worker
    workers = len(infos)
    if workers == 0 or not isinstance(infos[0], dict):
        raise TrainerError(f"the server at {client.url} does not answer vllm_bi's RPCs; start it with "
                           "VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).")
    why = settings_mismatch(infos[0])
    if why:
        raise TrainerError(f"{why}: their logprobs cannot match.")
    if verify_weights and workers > 1:
        raise TrainerError(f"the server at {client.url} runs {workers} workers (tensor parallel): the weight digest "
                           "check compares one worker's full weights, so it needs a TP = 1 server. Pass "
                           "--verify-weights false (the on-policy logprob diff of 0.0 still shows the push landed).")
    if verify_weights:
        try:
            client.weight_digest()
        except RuntimeError as e:
            raise TrainerError(f"the server at {client.url} does not answer vllm_bi's weight digest ({e}); start it "
                               "with VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).") from None


class _RankFailed(RuntimeError):
    pass


def _on_main(dist: Dist, fn, share: bool = True):
    """Run ``fn`` on rank 0; every rank gets its result (when ``share``) or raises its exception."""
    result = err = None
    if dist.main:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001
            err = e
    if dist.world > 1:
        sent = err if err is None or isinstance(err, Exception) else _RankFailed(repr(err))
        got, got_err = dist.broadcast((result if share else None, sent))
        if not dist.main:
            result, err = got, got_err
    if err is not None:
        raise err
    return result


def train(cfg: TrainerConfig, log=print) -> list[dict]:
    """Run ``cfg`` to ``cfg.steps`` (resuming when a checkpoint exists). Returns the metric rows of this run.

    Under ``torchrun --nproc-per-node N`` the model is sharded with FSDP2 over N processes."""
    dist = Dist()
    try:
        return _train(cfg, dist, log if dist.main else (lambda *a, **k: None))
    finally:
        dist.close()


def _train(cfg: TrainerConfig, dist: Dist, log) -> list[dict]:
    from transformers import AutoTokenizer

    cfg.validate()
    if (cfg.prompts_per_step * cfg.group_size) % dist.world:
        raise TrainerError(f"--prompts-per-step x --group-size = {cfg.prompts_per_step * cfg.group_size} samples "
                           f"per step cannot be split evenly over {dist.world} ranks; make it a multiple of {dist.world}")
    os.makedirs(cfg.run_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_dir = cfg.model
    if not model_dir:
        model_dir = os.path.abspath(os.path.join(cfg.run_dir, "base_model"))

        def build():
            from vllm_bi.testing.tiny_models import build_tiny_model

            build_tiny_model(cfg.model_family, model_dir, seed=cfg.seed)

        _on_main(dist, build)
    model_dir = os.path.abspath(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = make_source(cfg.task, cfg.seed)
    reward_fn = get_reward(cfg.reward or source.default_reward)
    t0 = time.perf_counter()
    model = GDNHybridForCausalLM.from_pretrained(model_dir).to(dist.device)
    dist.shard(model)
    policy = Policy(model, cfg, dist)
    if dist.main:
        logger.info("trainer model ready on %s (%d process(es)) in %.1f s", dist.device, dist.world,
                    time.perf_counter() - t0)
    start = (load_checkpoint(cfg.run_dir, policy, cfg) if cfg.resume else None)
    resumed = start is not None
    start = start or 0
    if dist.main:
        with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg) | {"resolved_model": model_dir, "world_size": dist.world}, f, indent=1)
    if start >= cfg.steps:
        log(f"{cfg.run_dir}: checkpoint is at step {start} >= --steps {cfg.steps}; nothing to do")
        return []

    server = rollouts = metrics = None
    rows: list[dict] = []
    saved_at = start if resumed else -1

    def where() -> str:
        if not cfg.save_every:
            return "Checkpoints are off (--save-every 0): a rerun starts again from the base model."
        return (f"The run is resumable: rerun the same command to continue from step {saved_at} "
                f"({os.path.join(cfg.run_dir, 'checkpoint')}).")

    try:
        client = None

        def connect():
            nonlocal server, client
            server = _start_server(cfg, model_dir) if not cfg.server_url else None
            client = server or VllmClient(cfg.server_url, model_dir)
            _check_server(client, cfg.verify_weights)

        _on_main(dist, connect, share=False)
        sync = WeightSync(client, cfg.run_dir, model_dir, cfg.weight_versions_kept, cfg.verify_weights) if dist.main else None
        state = model.hf_state_dict()
        _on_main(dist, lambda: sync.push(model, start, state), share=False)
        if not resumed and checkpoint_due(cfg.save_every, 0, cfg.steps):
            save_checkpoint(cfg.run_dir, policy, 0, cfg)
            saved_at = 0
        if dist.main:
            metrics = MetricsWriter(cfg.run_dir, start, cfg.tensorboard)
            log(f"{'resuming at' if resumed else 'starting'} step {start}/{cfg.steps}: {cfg.prompts_per_step} prompts "
                f"x {cfg.group_size} samples, {cfg.algo}, max_staleness {cfg.max_staleness}, "
                f"{dist.world} trainer process(es), server {client.url}")
            if str(dist.device).startswith("cuda"):
                log("the first step compiles and autotunes fla-core's GDN backward kernels in each process (about "
                    "1.5 minutes on an H200); later steps reuse them")

            def generate(b: int, v: int) -> RolloutBatch:
                return generate_batch(client, tokenizer, source, reward_fn, cfg, b, v)

            rollouts = RolloutThread(generate, start, cfg.steps, cfg.max_staleness, start)
            rollouts.start()
        from tqdm import tqdm

        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="RL steps",
                   disable=not (cfg.progress and dist.main))
        for step in bar:
            t0 = time.perf_counter()

            def next_batch():
                b = rollouts.out.get()
                if isinstance(b, BaseException):
                    raise b
                if b.index != step:
                    raise RuntimeError(f"internal error: got batch {b.index} for step {step}")
                return b

            batch = _on_main(dist, next_batch)
            wait_s = time.perf_counter() - t0
            row = {"step": step, "version": step, "sample_version": batch.version, "staleness": step - batch.version}
            row |= train_on_batch(policy, batch, cfg)
            state = model.hf_state_dict()

            def publish():
                if cfg.recompute_at_sample_version:
                    row["bit_wise/logprob_diff_at_sample_version/max"] = (
                        row["bit_wise/logprob_diff/max"] if batch.version == step
                        else logprob_diff_at_version(sync.path(batch.version), batch, dist.device))
                with rollouts.swap_lock:
                    row.update(sync.push(model, step + 1, state))
                rollouts.set_version(step + 1)
                row.update({
                    "generator/tokens_per_s": batch.completion_tokens / max(batch.gen_seconds, 1e-9),
                    "time/generate_s": batch.gen_seconds,
                    "time/wait_for_rollout_s": wait_s,
                    "time/step_s": time.perf_counter() - t0,
                    "data_position": (step + 1) * cfg.prompts_per_step,
                    "trainer/world_size": dist.world,
                })
                metrics.write(row)
                return row

            row = _on_main(dist, publish)
            rows.append(row)
            if checkpoint_due(cfg.save_every, step + 1, cfg.steps):
                save_checkpoint(cfg.run_dir, policy, step + 1, cfg)
                saved_at = step + 1
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}", diff=f"{row['bit_wise/logprob_diff/max']:.3g}")
            if dist.main and not cfg.progress:  # logs without a progress bar still show each step's time
                sync_s = sum(v for k, v in row.items() if k.startswith("time/sync_"))
                logger.info("step %d/%d: %.1f s (train %.1f, waiting for rollouts %.1f, weight push %.1f); "
                            "max |trainer - server logprob| %.3g", step + 1, cfg.steps, row["time/step_s"],
                            row.get("time/train_s", float("nan")), row["time/wait_for_rollout_s"], sync_s,
                            row["bit_wise/logprob_diff/max"])
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
        if metrics is not None:
            metrics.close()
        if server is not None:
            server.stop()
