"""Trainer checkpoints in ``RUN_DIR/checkpoint``: the fp32 masters, AdamW state (once it exists), the RNG states,
the step and the data position. Every process writes its own shards (``torch.distributed.checkpoint``; no rank
gathers the model), and ``meta.json``, which names the checkpoint's folder, is replaced atomically only once the
folder is complete, so a run killed while saving keeps its last complete checkpoint. A checkpoint resumes on any
number of processes; one made with another batch shape, task, seed or model family, or in another format, is
refused with a :class:`TrainerError` that says how to start over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time

import torch

from vllm_bi.errors import MISMATCH, USAGE
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.errors import TrainerError
from vllm_bi.trainer.policy import Policy

__all__ = ["checkpoint_due", "save_checkpoint", "load_checkpoint", "read_checkpoint", "check_resumed_settings",
           "CHECKPOINT_FORMAT"]

logger = logging.getLogger("vllm_bi.trainer")


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoint")


def run_settings(device) -> dict:
    """The arithmetic settings this process runs on ``device`` (:meth:`vllm_bi.settings.Settings.arithmetic`): what a
    checkpoint and ``metrics.jsonl`` record."""
    from vllm_bi.settings import current

    return current().arithmetic(str(device).split(":")[0])


def check_resume_settings(run_dir: str, saved: dict | None, now: dict) -> None:
    """Refuse to resume a run under arithmetic settings other than its checkpoint's (its logprobs would change bits
    mid-run). A checkpoint without settings (an older vllm_bi) is not checked. Under ``VLLM_BI_GEMM_CONFIGS=tune``
    the tile table is compared once the server's is taken (:func:`check_resumed_settings`), not before."""
    from vllm_bi.settings import ABSENT_MEANT, ARITHMETIC_ENV, TUNE_PENDING, diff

    if now.get("gemm_configs") == TUNE_PENDING:
        now = {k: v for k, v in now.items() if k != "gemm_configs"}
    if saved:  # a key the checkpoint predates: what it ran then (settings.ABSENT_MEANT)
        saved = {**{k: v for k, v in ABSENT_MEANT.items() if now.get(k, "none") != "none"}, **saved}
    rows = diff(saved or {}, now)
    if rows:
        key, a, b = rows[0]
        if key == "gemm_configs":
            from vllm_bi.settings import current, shipped_table_with_digest

            own = os.path.join(run_dir, "gemm_tiles", f"{a}.json")  # the run's copy of its server's tuned table
            shipped = shipped_table_with_digest(a)  # a table shipped with vllm_bi: its name
            if os.path.exists(own):
                fix = f"set VLLM_BI_GEMM_CONFIGS={own} (the run's table) for the run and its server"
            elif shipped:
                fix = f"set VLLM_BI_GEMM_CONFIGS={shipped} (the shipped table the run had) for the run and its server"
            else:
                fix = "set VLLM_BI_GEMM_CONFIGS as the run had it"
            why = (" (its server's tuned table: one is tuned anew for another device or another torch, Triton, vLLM "
                   "or vllm_bi version)" if current().tunes_table() else "")
            raise TrainerError(f"{run_dir} holds a checkpoint made with the Triton GEMM tile table {a}, this process "
                               f"runs {b}{why}: {fix}, or use --resume false (or another --run-dir) to start over",
                               exit_code=MISMATCH)
        if key == "gemm" and a == "fp64":  # a run from before the fast arithmetic became CUDA's default
            raise TrainerError(f"{run_dir} holds a checkpoint made with the float64 GEMM, this process runs the "
                               f"{b!r} one (the CUDA default since the fast arithmetic became it): set "
                               "VLLM_BI_PRESET=portable for this run and its server, or use --resume false (or "
                               "another --run-dir) to start over", exit_code=MISMATCH)
        if key == "gdn_mode" and a == "hybrid":  # a mode this vllm_bi no longer has
            raise TrainerError(f"{run_dir} holds a checkpoint made in the hybrid GDN mode, which is retired (this "
                               "vllm_bi no longer runs it): resume it with the vllm_bi version that made it, or use "
                               "--resume false (or another --run-dir) to start over in the recurrent (default) or "
                               "chunk mode", exit_code=MISMATCH)
        if key == "logprobs" and a == "torch" and b == "triton":
            raise TrainerError(f"{run_dir} holds a checkpoint made with the torch log-softmax, this process runs the "
                               "Triton kernels (other bits on some rows): set "
                               "VLLM_BI_LOGPROBS=torch (or VLLM_BI_PRESET=portable) for this run and its server, or "
                               "use --resume false (or another --run-dir) to start over", exit_code=MISMATCH)
        raise TrainerError(f"{run_dir} holds a checkpoint made with {key}={a!r}, this process runs {b!r}: set "
                           f"{ARITHMETIC_ENV[key]} as the run had it, or use --resume false (or another --run-dir) to "
                           "start over", exit_code=MISMATCH)


def check_resumed_settings(run_dir: str, device) -> None:
    """:func:`check_resume_settings` of ``run_dir``'s checkpoint against this process's settings now (after the
    server's tuned tile table was taken); nothing without a checkpoint."""
    meta = _read_meta(run_dir)
    if meta is not None:
        check_resume_settings(run_dir, meta.get("settings"), run_settings(device))


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
            "config": dataclasses.asdict(cfg), "settings": run_settings(policy.dist.device), "time": time.time()}
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
                               "--resume false to start over", exit_code=USAGE)
        return None
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise TrainerError(f"{path}: checkpoint format {meta.get('format')}, this vllm_bi reads {CHECKPOINT_FORMAT}; "
                           "use another --run-dir, or --resume false to start over", exit_code=USAGE)
    return meta


def load_checkpoint(run_dir: str, policy: Policy, cfg: TrainerConfig) -> int | None:
    """Resume from ``run_dir``'s checkpoint (None when there is none). The shards are read into this run's
    layout, so a run may resume on another number of processes."""
    import torch.distributed.checkpoint as dcp

    meta = _read_meta(run_dir)
    if meta is None:
        return None
    check_resume_settings(run_dir, meta.get("settings"), run_settings(policy.dist.device))
    old = meta["config"]
    for key in ("prompts_per_step", "group_size", "task", "seed", "model_family"):
        if old.get(key) != getattr(cfg, key):
            raise TrainerError(f"{run_dir} holds a checkpoint made with {key}={old.get(key)!r}, but this run asks for "
                               f"{getattr(cfg, key)!r}: use another --run-dir, or --resume false to start over",
                               exit_code=USAGE)
    if meta["data_position"] != meta["step"] * cfg.prompts_per_step:
        raise TrainerError(f"{run_dir}: inconsistent checkpoint (data position {meta['data_position']} at step "
                           f"{meta['step']}); use another --run-dir, or --resume false to start over",
                           exit_code=USAGE)
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
