"""Benchmark: what batch invariance costs an RL step, the trainer's loop on both arithmetics side by side in one run.

    python benchmarks/rl_step.py --model DIR [--steps 5] [--out rl_step.md] [--trainer-args "--prompts-per-step 8"]

Runs ``python -m vllm_bi.trainer`` twice on the same checkpoint and recipe: ``--arithmetic stock`` (transformers' own
model against a stock vLLM server the trainer starts: the non-batch-invariant baseline) and ``--arithmetic vllm_bi``
(the defaults: a ``VLLM_BATCH_INVARIANT=1`` server and the op library). Each run's first step is a warm-up
(compiles, autotuning) and left out; the table holds the median over the other steps of each part of the step,
from the runs' ``metrics.jsonl``: rollout (``time/generate_s``), trainer forward+backward, optimizer, weight push
(save + swap + verify) and the whole step, with the ratio vllm_bi / stock, each run's max logprob gap and, on CUDA,
the trainer's peak GPU memory. ``--out`` is rewritten after each side (a run cut short keeps the sides it finished),
names each side's trainer command (a side reused from an earlier call too) and has each side's ``metrics.jsonl``
copied beside it.
A full-size 9B with AdamW does not fit one H200 beside a server: give a full-width checkpoint with fewer layers
(``vllm-bi make-checkpoint qwen3.5-9b DIR --layers 8``) and say so with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys

PARTS = [("rollout (generate)", ("time/generate_s",)),
         ("trainer forward + backward", ("time/forward_backward_s",)),
         ("optimizer", ("time/optimizer_s",)),
         ("weight push (save + swap + verify)", ("time/sync_save_s", "time/sync_swap_s", "time/sync_verify_s")),
         ("whole step", ("time/step_s",))]
SIDES = ("stock", "vllm_bi")
PEAK = "memory/peak_allocated_gib"
COMMAND_FILE = "rl_step_command.txt"  # in each side's run dir: the trainer command that side ran
PEAK_LABEL = "trainer peak GPU memory, GiB (max over all steps)"


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def medians(rows: list[dict], warmup: int = 1) -> dict:
    """Per part of :data:`PARTS`, the median over the rows after the first ``warmup`` (all rows if no more); and the
    run's max |trainer - server| logprob and the steps counted."""
    used = rows[warmup:] or rows
    out = {label: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in used) for label, keys in PARTS}
    out["max logprob gap"] = max(r["bit_wise/logprob_diff/max"] for r in rows)
    peaks = [r[PEAK] for r in rows if PEAK in r]  # CUDA runs only; the warm-up step included
    out["trainer peak memory"] = max(peaks) if peaks else None
    out["steps timed"] = len(used)
    return out


def table(by_side: dict[str, dict]) -> list[str]:
    s, b = by_side["stock"], by_side["vllm_bi"]
    lines = ["| part (median s per step) | stock | vllm_bi | vllm_bi / stock |", "| --- | ---: | ---: | ---: |"]
    for label, _ in PARTS:
        ratio = f"{b[label] / s[label]:.2f}x" if s[label] > 0 else ""
        lines.append(f"| {label} | {s[label]:.3f} | {b[label]:.3f} | {ratio} |")
    lines.append(f"| max logprob gap | {s['max logprob gap']:.3g} | {b['max logprob gap']:.3g} | |")
    if s["trainer peak memory"] is not None or b["trainer peak memory"] is not None:
        lines.append(f"| {PEAK_LABEL} | {_gib(s)} | {_gib(b)} | |")
    lines.append(f"| steps timed | {s['steps timed']} | {b['steps timed']} | |")
    return lines


def one_side(by_side: dict[str, dict]) -> list[str]:
    (side, m), = by_side.items()
    lines = [f"| part (median s per step) | {side} |", "| --- | ---: |"]
    lines += [f"| {label} | {m[label]:.3f} |" for label, _ in PARTS]
    lines.append(f"| max logprob gap | {m['max logprob gap']:.3g} |")
    if m["trainer peak memory"] is not None:
        lines.append(f"| {PEAK_LABEL} | {_gib(m)} |")
    return lines + [f"| steps timed | {m['steps timed']} |"]


def _side_command(run_root: str, side: str) -> str:
    try:
        with open(os.path.join(run_root, side, COMMAND_FILE)) as f:
            return f.read().strip()
    except OSError:
        return "(not recorded)"


def _gib(m: dict) -> str:
    return "" if m["trainer peak memory"] is None else f"{m['trainer peak memory']:.1f}"


def run_side(side: str, model: str, steps: int, run_root: str, extra: list[str]) -> str:
    run_dir = os.path.join(run_root, side)
    cmd = [sys.executable, "-m", "vllm_bi.trainer", "--model", model, "--arithmetic", side, "--steps", str(steps),
           "--run-dir", run_dir, "--resume", "false", "--save-every", "0", "--progress", "false", *extra]
    print(f"[rl-step] {side}: {shlex.join(cmd)}", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, COMMAND_FILE), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    subprocess.run(cmd, check=True)
    return os.path.join(run_dir, "metrics.jsonl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (vllm-bi make-checkpoint ...)")
    ap.add_argument("--steps", type=int, default=5, help="steps per side; the first is a warm-up")
    ap.add_argument("--run-root", default="runs/rl_step", help="each side's --run-dir goes under it")
    ap.add_argument("--trainer-args", default="", help="more trainer options for both sides (one string)")
    ap.add_argument("--sides", default=",".join(SIDES), help="which of stock,vllm_bi to run (the table needs both; "
                    "one side prints that side's medians)")
    ap.add_argument("--reuse", default="", help="sides run earlier on this machine under the same --run-root, read "
                    "from their metrics.jsonl instead of run again (both sides of a step that does not fit one "
                    "call: --sides stock, then --sides vllm_bi --reuse stock)")
    ap.add_argument("--out", default="rl_step.md")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2: the first step of each side is a warm-up")
    extra = shlex.split(args.trainer_args)
    sides = [s for s in args.sides.split(",") if s]
    reused = [s for s in args.reuse.split(",") if s]
    for name, chosen in (("--sides", sides), ("--reuse", reused)):
        if any(s not in SIDES for s in chosen) or (name == "--sides" and not chosen):
            ap.error(f"{name}: a comma-separated subset of {','.join(SIDES)}, got {chosen!r}")
    if set(sides) & set(reused):
        ap.error(f"--reuse: {','.join(set(sides) & set(reused))} is also in --sides; give a side to one of them")
    for side in reused:
        if not os.path.exists(os.path.join(args.run_root, side, "metrics.jsonl")):
            ap.error(f"--reuse {side}: no {os.path.join(args.run_root, side, 'metrics.jsonl')}; run that side "
                     "first with the same --run-root")
    from common import emit

    by_side: dict[str, dict] = {}
    for side in [s for s in SIDES if s in sides or s in reused]:
        if side in reused:
            metrics = os.path.join(args.run_root, side, "metrics.jsonl")
            print(f"[rl-step] {side}: reusing {metrics}", flush=True)
        else:
            metrics = run_side(side, args.model, args.steps, args.run_root, extra)
        shutil.copyfile(metrics, os.path.splitext(args.out)[0] + f"-{side}-metrics.jsonl")
        by_side[side] = medians(read_rows(metrics))
        body = table(by_side) if len(by_side) == len(SIDES) else one_side(by_side)
        text = [f"# RL step, {' vs '.join(by_side)}, {args.model}", "",
                "command: " + shlex.join([sys.executable, *sys.argv]), "",
                *[f"{name}: {_side_command(args.run_root, name)}" for name in by_side], "", *body]
        emit("\n".join(text) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
