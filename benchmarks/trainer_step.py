"""Benchmark: the trainer's forward + backward on one micro-batch, stock against vllm_bi, side by side in one run, with
the GPU time split by part.

    python benchmarks/trainer_step.py --model DIR [--sides stock,vllm_bi] [--seqs 8] [--prompt 16] [--completion 128]
        [--reps 3] [--accumulate] [--out trainer_step.md] [--json-out trainer_step.json]

What an RL step's "trainer forward + backward" does per micro-batch, without a server: the completions' logprobs
(``completion_logprobs``, entropy included) and the backward of their sum, on ``--seqs`` sequences of ``--prompt``
prompt tokens and ``--completion`` completion tokens (random token ids, one seed for every side). Sides: ``stock``
(transformers' model: cuBLAS, SDPA, fla-core's chunked GDN kernels, as ``--arithmetic stock``), ``vllm_bi`` (the op
library with the defaults) and ``vllm_bi:VLLM_BI_X=VALUE[:...]`` (the defaults but those settings, e.g.
``VLLM_BI_TRAINER_LOGITS=completions``). Each side runs in a process of its own (as a trainer does): one warm-up step
(compiles, autotuning), then ``--reps`` timed steps (wall time, synchronised; the forward's share timed apart, with a
synchronisation before the backward; with ``--accumulate`` the gradients' addition to fp32 master weights too, as
the trainer does per micro-batch) and their peak memory. On CUDA one more step runs under torch.profiler and its
kernel time is summed by part (GEMM, attention, GDN, logprobs, norms + pointwise, other) with ``full_scale.py``'s
kernel patterns, and its kernels with the most GPU time are listed. Ratios are against the first side. The settings
that tune on a server's start (``VLLM_BI_GEMM_CONFIGS=tune``) have no server here: name a table instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP_KERNELS = 15  # kernels listed per side, by GPU time
PART_ORDER = ("GEMM", "attention", "GDN", "sampling + logprobs", "norms + pointwise", "other")


def _pairs(vocab: int, seqs: int, prompt: int, completion: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    hi = min(vocab, 32000) - 1  # ordinary token ids, the same for every side
    return [([rng.randint(10, hi) for _ in range(prompt)], [rng.randint(10, hi) for _ in range(completion)])
            for _ in range(seqs)]


def run_worker(args) -> dict:
    """One side in this process: the settings are set before vllm_bi reads them."""
    from full_scale import parse_side

    bi, settings = parse_side(args.worker)
    os.environ.update(settings)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if bi:
        from vllm_bi.models import from_pretrained

        model = from_pretrained(args.model).to(device)
    else:
        from vllm_bi.trainer.stock import StockModel

        model = StockModel.from_pretrained(args.model).to(device)
    from vllm_bi.model_dir import read_model_config

    cfg = read_model_config(args.model)
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    pairs = _pairs(vocab, args.seqs, args.prompt, args.completion, args.seed)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    policy = None
    if args.accumulate:  # the trainer's fp32 masters, into which each micro-batch's gradients are added
        import tempfile

        from vllm_bi.trainer.config import TrainerConfig
        from vllm_bi.trainer.distributed import Dist
        from vllm_bi.trainer.policy import Policy

        policy = Policy(model, TrainerConfig(model=args.model, run_dir=tempfile.mkdtemp()), Dist())

    def step(split=None, masters=True):
        model.zero_grad(set_to_none=True)
        lps, _ = model.completion_logprobs(pairs, entropy=True)
        loss = torch.cat(lps).sum()
        if split is not None:  # the forward's share of the step (synchronised)
            sync()
            split.append(time.perf_counter())
        loss.backward()
        if policy is not None and masters:
            if split is not None:
                sync()
                split.append(time.perf_counter())
            policy.accumulate()

    step()  # warm-up: compiles and autotuning
    sync()
    times, fwd, acc, peak = [], [], [], None
    for _ in range(args.reps):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mid = []
        step(mid)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        fwd.append((mid[0] - t0) * 1e3)
        if policy is not None:
            acc.append((time.perf_counter() - mid[1]) * 1e3)
        if device == "cuda":
            peak = max(peak or 0.0, torch.cuda.max_memory_allocated() / 2**30)
    parts, top = None, None
    if device == "cuda":
        from full_scale import part_of
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(masters=False)  # the model's kernels: the masters' addition is timed above
            sync()
        parts, kernels = {}, []
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                part = part_of(e.key)
                ms = e.self_device_time_total / 1000.0
                parts[part] = parts.get(part, 0.0) + ms
                kernels.append((ms, e.count, part, e.key))
        top = [{"ms": ms, "calls": n, "part": part, "kernel": key[:120]}
               for ms, n, part, key in sorted(kernels, reverse=True)[:TOP_KERNELS]]
    arithmetic = ""
    if bi:
        from vllm_bi.parity import trainer_settings
        from vllm_bi.settings import current

        arithmetic = f"{trainer_settings(device)}, lm_head over {current().trainer_logits_rows(device)} rows"
    return {"side": args.worker, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "wall_ms": statistics.median(times), "wall_ms_all": times, "forward_ms": statistics.median(fwd),
            "accumulate_ms": statistics.median(acc) if acc else None, "peak_gib": peak, "parts": parts,
            "top_kernels": top, "arithmetic": arithmetic}


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: wall time and peak memory per side, then the GPU time by part; ratios against the first side."""
    ref = rows[0]
    head = "| | " + " | ".join(r["side"] for r in rows) + " | " + " | ".join(
        f"{r['side']} / {ref['side']}" for r in rows[1:]) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(rows) - 1)]

    def row(label, values, fmt):
        cells = [fmt(v) if v is not None else "" for v in values]
        ratios = [f"{v / values[0]:.2f}x" if v is not None and values[0] else "" for v in values[1:]]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")

    row("wall ms per micro-batch (median)", [r["wall_ms"] for r in rows], lambda v: f"{v:.1f}")
    if all("forward_ms" in r for r in rows):  # timed apart (synchronised after the forward): their own medians
        row("  of it the forward (logprobs, entropy)", [r["forward_ms"] for r in rows], lambda v: f"{v:.1f}")
    if all(r.get("accumulate_ms") is not None for r in rows):
        row("  of it the gradients added to the fp32 masters", [r["accumulate_ms"] for r in rows],
            lambda v: f"{v:.1f}")
    if any(r["peak_gib"] is not None for r in rows):
        row("peak GiB allocated", [r["peak_gib"] for r in rows], lambda v: f"{v:.2f}")
    if all(r["parts"] for r in rows):
        for part in PART_ORDER:
            if any(part in r["parts"] for r in rows):
                row(f"GPU ms: {part}", [r["parts"].get(part, 0.0) for r in rows], lambda v: f"{v:.1f}")
        row("GPU ms: all kernels", [sum(r["parts"].values()) for r in rows], lambda v: f"{v:.1f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (vllm-bi make-checkpoint ...)")
    ap.add_argument("--sides", default="stock,vllm_bi",
                    help="comma-separated: stock, vllm_bi, vllm_bi:VLLM_BI_X=VALUE[:...]; ratios against the first")
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the micro-batch")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=128, help="completion tokens per sequence")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per side, after one warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accumulate", action="store_true",
                    help="also add each step's gradients to fp32 master weights, as the trainer does per micro-batch "
                         "(timed apart; the masters cost 4 bytes a parameter)")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--json-out", default=None, help="also write every side's numbers here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one side, in its own process
    args = ap.parse_args()
    if min(args.seqs, args.prompt, args.completion, args.reps) < 1:
        ap.error("--seqs, --prompt, --completion and --reps must be >= 1")
    sys.path.insert(0, HERE)
    from full_scale import parse_side

    from vllm_bi.errors import UsageError
    from vllm_bi.model_dir import read_model_config

    sides = [s for s in args.sides.split(",") if s]
    try:
        for s in sides:
            parse_side(s)
        read_model_config(args.model)  # a bad --model: one line here, not a traceback per side
    except (ValueError, UsageError) as e:
        ap.error(str(e))
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args)), flush=True)
        return 0
    from common import emit

    rows = []
    for side in sides:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model", args.model, "--seqs",
               str(args.seqs), "--prompt", str(args.prompt), "--completion", str(args.completion), "--reps",
               str(args.reps), "--seed", str(args.seed)] + (["--accumulate"] if args.accumulate else [])
        print(f"[trainer-step] {side}", flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not results:
            print(proc.stdout[-4000:], file=sys.stderr)
            print(f"[trainer-step] side {side} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        rows.append(json.loads(results[-1]))
    text = [f"# Trainer forward + backward, one micro-batch: {args.seqs} x ({args.prompt} prompt + {args.completion} "
            f"completion tokens), {args.model}, {rows[0]['device']}", "",
            "command: " + " ".join([os.path.basename(sys.executable), *sys.argv]), "", *table(rows), ""]
    text += [f"{r['side']}: {r['arithmetic']}" for r in rows if r["arithmetic"]]
    for r in rows:
        if r.get("top_kernels"):
            text += ["", f"{r['side']}: the {len(r['top_kernels'])} kernels with the most GPU time", "",
                     "| ms | calls | part | kernel |", "| ---: | ---: | --- | --- |"]
            text += [f"| {k['ms']:.2f} | {k['calls']} | {k['part']} | `{k['kernel']}` |" for k in r["top_kernels"]]
    emit("\n".join(text) + "\n", args.out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
