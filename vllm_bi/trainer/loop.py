"""The RL loop, the controller: each step takes a batch of rollouts from the live BI server, makes a GRPO/DAPO
update, pushes the new weights into the server, writes the metrics and, when due, a checkpoint. The pieces live
in policy.py (the update), rollout.py (sampling and the rollout thread), sync.py (weight pushes),
checkpoint.py and server.py; this module only orders them.

Threads: a rollout thread samples batch ``b`` as soon as the server's weight
version ``v`` satisfies ``b - v <= max_staleness`` (0: only after the previous
step's weights are pushed, i.e. on-policy), while the main thread trains on
batch ``b - 1``. Weight pushes and batch sampling never overlap (one lock), so
every token of a batch was sampled under one known version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time

import torch

from vllm_bi.client import ServerAuthError, ServerUnreachable
from vllm_bi.errors import DIFFER, ENVIRONMENT, USAGE, UsageError
from vllm_bi.models import from_pretrained
from vllm_bi.trainer.checkpoint import (check_resumed_settings, checkpoint_due, load_checkpoint, run_settings,
                                        save_checkpoint)
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.data import make_source
from vllm_bi.trainer.distributed import Dist
from vllm_bi.trainer.errors import NaNLoss, TrainerError
from vllm_bi.trainer.metrics import MetricsWriter
from vllm_bi.trainer.policy import Policy, logprob_diff_at_version, train_on_batch
from vllm_bi.trainer.rewards import get_reward
from vllm_bi.trainer.rollout import RolloutBatch, RolloutThread, VersionChanged, generate_batch
from vllm_bi.trainer.server import connect, share_server_tiles
from vllm_bi.trainer.sync import ModelMismatch, PushFailed, WeightMismatch, WeightSync

__all__ = ["train"]

logger = logging.getLogger("vllm_bi.trainer")


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
    if cfg.settings:  # the recipe's [settings]: this process's and its server's, unless the environment sets them
        from vllm_bi.settings import apply_section

        try:
            kept = apply_section(cfg.settings, "the recipe's [settings]")
        except ValueError as e:
            raise TrainerError(str(e), exit_code=USAGE) from None
        for name in kept:
            log(f"settings: {name} is set in the environment, which wins over the recipe's [settings]")
    if (cfg.prompts_per_step * cfg.group_size) % dist.world:
        raise TrainerError(f"--prompts-per-step x --group-size = {cfg.prompts_per_step * cfg.group_size} samples "
                           f"per step cannot be split evenly over {dist.world} ranks; make it a multiple of "
                           f"{dist.world}", exit_code=USAGE)
    os.makedirs(cfg.run_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_dir = cfg.model
    if not model_dir:
        model_dir = os.path.abspath(os.path.join(cfg.run_dir, "base_model"))

        def build():
            from vllm_bi.tiny_models import build_tiny_model

            build_tiny_model(cfg.model_family, model_dir, seed=cfg.seed)

        _on_main(dist, build)
    model_dir = os.path.abspath(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = make_source(cfg.task, cfg.seed)
    reward_fn = get_reward(cfg.reward or source.default_reward)
    env_spec = cfg.env or source.env
    env = None
    if env_spec:  # multi-turn rollouts
        from vllm_bi.trainer.multiturn import get_env

        env = get_env(env_spec)
    t0 = time.perf_counter()
    if cfg.weight_push == "ipc" and (not str(dist.device).startswith("cuda") or dist.world > 1):
        raise TrainerError("--weight-push ipc needs one trainer process on a CUDA device, beside its server (vLLM's "
                           "CUDA IPC weight transfer); use --weight-push files", exit_code=USAGE)
    if cfg.arithmetic == "stock":
        from vllm_bi.trainer.stock import StockModel

        if dist.world > 1:
            raise TrainerError("--arithmetic stock runs in one process (the baseline is not sharded); drop torchrun",
                               exit_code=USAGE)
        model = StockModel.from_pretrained(model_dir).to(dist.device)
    else:
        model = from_pretrained(model_dir).to(dist.device)
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
            json.dump({k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
                      | {"resolved_model": model_dir, "world_size": dist.world}, f, indent=1)
    if start >= cfg.steps:
        log(f"{cfg.run_dir}: checkpoint is at step {start} >= --steps {cfg.steps}; nothing to do")
        return []

    server = rollouts = metrics = None
    rows: list[dict] = []
    saved_at = start if resumed else -1

    def where() -> str:
        if not cfg.save_every:
            return "Checkpoints are off (--save-every 0): a rerun starts again from the base model."
        if saved_at < 0:
            return "No checkpoint was written: rerunning the same command starts the run from step 0."
        return (f"The run is resumable: rerun the same command to continue from step {saved_at} "
                f"({os.path.join(cfg.run_dir, 'checkpoint')}).")

    def server_hint() -> str:
        if cfg.server_url:
            return (f"start it (VLLM_BATCH_INVARIANT=1 VLLM_SERVER_DEV_MODE=1 vllm serve {model_dir}) or fix "
                    "--server-url, or leave --server-url empty to let the trainer start one")
        return f"the server this run started stopped; its log: {os.path.join(cfg.run_dir, 'server.log')}"

    try:
        client = None

        def join():
            nonlocal server, client
            server, client = connect(cfg, model_dir)

        _on_main(dist, join, share=False)
        share_server_tiles(dist, cfg.run_dir)  # VLLM_BI_GEMM_CONFIGS=tune: every rank installs the server's table
        if resumed:  # the tile table, known now, must be the run's
            check_resumed_settings(cfg.run_dir, dist.device)
        bi = cfg.arithmetic != "stock"
        sync = (WeightSync(client, cfg.run_dir, model_dir, cfg.weight_versions_kept, cfg.verify_weights and bi,
                           layout=bi, transfer=cfg.weight_push) if dist.main else None)
        _push_current(dist, sync, model, start)
        if not resumed and checkpoint_due(cfg.save_every, 0, cfg.steps):
            save_checkpoint(cfg.run_dir, policy, 0, cfg)
            saved_at = 0
        if dist.main:
            metrics = MetricsWriter(cfg.run_dir, start, cfg.tensorboard, run_settings(dist.device))
            turns = f" (multi-turn: up to {cfg.max_turns} model turns, environment {env_spec})" if env else ""
            log(f"{'resuming at' if resumed else 'starting'} step {start}/{cfg.steps}: {cfg.prompts_per_step} prompts "
                f"x {cfg.group_size} samples{turns}, {cfg.algo}, max_staleness {cfg.max_staleness}, "
                f"{dist.world} trainer process(es), server {client.url}")
            if str(dist.device).startswith("cuda"):
                log("the first step compiles and autotunes fla-core's GDN backward kernels in each process (about "
                    "1.5 minutes on an H200); later steps reuse them")

            def generate(b: int, v: int) -> RolloutBatch:
                return generate_batch(client, tokenizer, source, reward_fn, cfg, b, v, env)

            rollouts = RolloutThread(generate, start, cfg.steps, cfg.max_staleness, start)
            rollouts.start()
        from tqdm import tqdm

        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="RL steps",
                   disable=not (cfg.progress and dist.main))
        for step in bar:
            row, saved = _rl_step(step, cfg, dist, policy, rollouts, sync, metrics, bar)
            rows.append(row)
            if saved:
                saved_at = step + 1
        return rows
    except ServerUnreachable as e:
        raise TrainerError(f"{e}; {server_hint()}. {where()}", exit_code=ENVIRONMENT) from None
    except WeightMismatch as e:
        raise TrainerError(f"{e} {where()}", exit_code=DIFFER) from None
    except PushFailed as e:  # the digest check (the weights differ) or the server failed a step of the swap
        raise TrainerError(f"{e}. {where()}", exit_code=DIFFER if e.step == "verify" else ENVIRONMENT) from None
    except VersionChanged as e:
        raise TrainerError(f"{e} {where()}", exit_code=ENVIRONMENT) from None
    except ModelMismatch as e:
        raise TrainerError(str(e), exit_code=USAGE) from None
    except ServerAuthError as e:
        raise TrainerError(str(e), exit_code=ENVIRONMENT) from None
    except NaNLoss as e:
        raise TrainerError(f"{e}: the update was not applied. Lower --lr, check the reward function, "
                           f"or resume from the last good checkpoint. {where()}", exit_code=DIFFER) from None
    except UsageError as e:  # the reward function's value, raised while sampling
        raise TrainerError(f"{e}. {where()}", exit_code=e.exit_code) from None
    finally:
        if rollouts is not None:
            rollouts.stop()
        if metrics is not None:
            metrics.close()
        if server is not None:
            server.stop()


def _push_current(dist: Dist, sync: WeightSync | None, model, version: int) -> None:
    """Push the model's weights as ``version`` (the first rank; every rank gathers under FSDP2). The state dict is a
    copy of every weight on the op library's model (2 bytes a parameter), so it lives only for the push, not through
    the optimizer's updates."""
    state = model.hf_state_dict()
    _on_main(dist, lambda: sync.push(model, version, state), share=False)


def _rl_step(step: int, cfg: TrainerConfig, dist: Dist, policy: Policy, rollouts: RolloutThread | None,
             sync: WeightSync | None, metrics: MetricsWriter | None, bar) -> tuple[dict, bool]:
    """RL step ``step`` on every rank: take its batch from the rollout thread, train on it, push the new weights
    (version ``step + 1``) and let the rollout thread go on, write the metric row, checkpoint when due, log.
    ``rollouts``, ``sync`` and ``metrics`` exist on the first rank only. Returns the metric row and whether a
    checkpoint was written."""
    model = policy.model
    t0 = time.perf_counter()

    def next_batch():
        b = rollouts.out.get()
        if isinstance(b, BaseException):
            raise b
        if b.index != step:
            raise RuntimeError(f"internal error: got batch {b.index} for step {step}")
        return b

    cuda = str(dist.device).startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
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
        if cuda:  # this process's most CUDA memory held by tensors during the step (training and the push)
            row["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
        metrics.write(row)
        return row

    row = _on_main(dist, publish)
    del state  # a copy of every weight on the op library's model (2 bytes a parameter): not kept past the push
    saved = checkpoint_due(cfg.save_every, step + 1, cfg.steps)
    if saved:
        save_checkpoint(cfg.run_dir, policy, step + 1, cfg)
    bar.set_postfix(reward=f"{row['reward/mean']:.3f}", diff=f"{row['bit_wise/logprob_diff/max']:.3g}")
    if dist.main and not cfg.progress:  # logs without a progress bar still show each step's time
        sync_s = sum(v for k, v in row.items() if k.startswith("time/sync_"))
        logger.info("step %d/%d: %.1f s (train %.1f, waiting for rollouts %.1f, weight push %.1f); "
                    "max |trainer - server logprob| %.3g", step + 1, cfg.steps, row["time/step_s"],
                    row.get("time/train_s", float("nan")), row["time/wait_for_rollout_s"], sync_s,
                    row["bit_wise/logprob_diff/max"])
    return row, saved


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
