#!/usr/bin/env python3
"""The GPU measurement suite: many `vllm-bi parity` / serving / trainer runs on one CUDA machine, in parallel.

Each job is a subprocess (its own `vllm serve` and trainer), pinned to GPUs with CUDA_VISIBLE_DEVICES;
several run at once (H200: 139 GiB, and a tiny model's server takes --gpu-memory-utilization 0.1). The
verdicts are the jobs' own: `vllm-bi parity --json` (trainer logprob == server logprob, bit for bit, for
every sampled token), `scripts/gpu_serve_parity.py` (P1-P3) and the RL trainer's metrics.jsonl
(bit_wise/logprob_diff/max == 0.0 at every step). Writes suite.json, suite.md and logs.tar.gz to --out.

    python3 scripts/gpu_suite.py --out $OUT --jobs parity-own,stock                 # one GPU
    python3 scripts/gpu_suite.py --out $OUT --jobs tp2,fsdp2 --parallel 2          # two GPUs

Job groups (names below; `--list` prints every job): see JOBS.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MEM = "--gpu-memory-utilization 0.1"
STOCK_ARGS = "--gdn-prefill-backend triton"
# the models the jobs use: directory name -> (family, spec of vllm_bi.testing.tiny_models.SPECS)
MODELS = {"qwen3.5": ("qwen3.5", "default"), "qwen3-next": ("qwen3-next", "default"),
          "qwen3.5-moe": ("qwen3.5-moe", "default"), "qwen3.5-9b": ("qwen3.5", "9b-dims"),
          "moe-router": ("qwen3.5-moe", "moe-router"),
          "qwen3.5-tp": ("qwen3.5", "tp")}
RUNS = "/tmp/vllm_bi_suite_runs"  # trainer run dirs (checkpoints stay here; metrics are copied to the logs)  # FlashInfer's GDN prefill is not in the offline bundle


@dataclass
class Job:
    name: str
    kind: str  # parity | serve | trainer | pytest
    argv: list[str]
    env: dict = field(default_factory=dict)
    gpus: int = 1
    timeout: int = 540
    expect_pass: bool = True  # a control (stock server, default CUDA ops) is expected to fail parity


def _parity(name, model, ops="vllm_bi", tp=1, stock=False, n=4, max_tokens=24, extra="", gdn="recurrent",
            prompts=None, gemm="fp64") -> Job:
    server_args = f"{MEM} --tensor-parallel-size {tp} {STOCK_ARGS if stock else ''} {extra}".strip()
    argv = [sys.executable, "-m", "vllm_bi.cli", "parity", "--model", model, "--json", "--n", str(n),
            "--max-tokens", str(max_tokens), "--server-args", server_args, "--trainer-device", "cuda"]
    if stock:
        argv.append("--stock-server")
    if prompts:
        argv += ["--prompts", prompts]
    env = {"VLLM_BI_CUDA_OPS": ops, "VLLM_BI_GDN_MODE": gdn, "VLLM_BI_GEMM": gemm}
    return Job(name, "parity", argv, env, gpus=tp, expect_pass=not stock and ops == "vllm_bi")


def build_jobs(models: str) -> dict[str, list[Job]]:
    m = {k: os.path.join(models, k) for k in MODELS}
    serve = [sys.executable, os.path.join(ROOT, "scripts", "gpu_serve_parity.py"), "--trials", "2",
             "--models", models]
    trainer = ["-m", "vllm_bi.trainer", "--steps", "4", "--prompts-per-step", "4", "--group-size", "4",
               "--max-tokens", "12", "--tensorboard", "false", "--progress", "false",
               "--server-args", f"--max-num-batched-tokens 256 --max-num-seqs 32 {MEM}"]
    return {
        "parity-own": [_parity(f"parity own-ops {k}", m[k]) for k in ("qwen3.5", "qwen3-next", "qwen3.5-moe")],
        "parity-own-big": [_parity("parity own-ops qwen3.5 9b-dims", m["qwen3.5-9b"], max_tokens=16),
                           _parity("parity own-ops qwen3.5-moe moe-router", m["moe-router"], max_tokens=16)],
        "control": [_parity("control: stock vLLM qwen3.5", m["qwen3.5"], stock=True),
                    _parity("control: stock vLLM qwen3.5 9b-dims", m["qwen3.5-9b"], stock=True, max_tokens=16),
                    _parity("control: stock vLLM qwen3.5-moe", m["qwen3.5-moe"], stock=True)],
        "serve-own": [Job("P1-P3 own-ops qwen3.5", "serve", serve + ["--family", "qwen3.5", "--modes", "bi"],
                          {"VLLM_BI_CUDA_OPS": "vllm_bi"})],
        "tp2": [_parity("parity own-ops qwen3.5 (2 GDN key heads) TP=2", m["qwen3.5-tp"], tp=2),
                _parity("parity own-ops qwen3.5 9b-dims TP=2", m["qwen3.5-9b"], tp=2, max_tokens=16)],
        "fsdp2": [Job("trainer FSDP2 x2 GPUs qwen3.5", "trainer",
                      [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *trainer,
                       "--model", m["qwen3.5-tp"]], {"VLLM_BI_CUDA_OPS": "vllm_bi"}, gpus=2),
        ],
        # no checkpoints: ~10 GB each at 9b-dims (session 6: gathered on rank 0, a step then took minutes); the
        # small FSDP2 job above still writes its sharded checkpoints every step
        "fsdp2-big": [Job("trainer FSDP2 x2 GPUs qwen3.5 9b-dims", "trainer",
                      [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *trainer,
                       "--save-every", "0", "--model", m["qwen3.5-9b"]], {"VLLM_BI_CUDA_OPS": "vllm_bi"}, gpus=2)],
        # chunk-aligned GDN mode: prompts of 150-300 tokens split by the 64-token batch budget at
        # unaligned offsets, and 80 decode steps that cross block boundaries
        "chunk": [_parity("parity own-ops chunk mode qwen3.5", m["qwen3.5"], gdn="chunk", max_tokens=80,
                          prompts=long_prompts(models)),
                  _parity("parity own-ops chunk mode qwen3.5 9b-dims", m["qwen3.5-9b"], gdn="chunk", max_tokens=80,
                          prompts=long_prompts(models)),
                  _parity("parity own-ops chunk mode qwen3.5-moe", m["qwen3.5-moe"], gdn="chunk", max_tokens=80,
                          prompts=long_prompts(models)),
                  Job("trainer 1 GPU chunk mode qwen3.5", "trainer", [sys.executable, *trainer, "--model", m["qwen3.5"]],
                      {"VLLM_BI_CUDA_OPS": "vllm_bi", "VLLM_BI_GDN_MODE": "chunk"})],
        # the experimental Triton-persistent GEMM mode (VLLM_BI_GEMM=triton), with and without the chunk mode
        "gemm-triton": [_parity("parity own-ops triton GEMM qwen3.5", m["qwen3.5"], gemm="triton"),
                        _parity("parity own-ops triton GEMM qwen3.5 9b-dims", m["qwen3.5-9b"], gemm="triton",
                                max_tokens=16),
                        _parity("parity own-ops triton GEMM chunk mode qwen3.5", m["qwen3.5"], gemm="triton",
                                gdn="chunk", max_tokens=80, prompts=long_prompts(models))],
        "quick": [_parity("parity own-ops qwen3.5", m["qwen3.5"]), _parity("parity own-ops qwen3.5-moe", m["qwen3.5-moe"])],
        "trainer1": [Job("trainer 1 GPU qwen3.5", "trainer", [sys.executable, *trainer, "--model", m["qwen3.5"]],
                         {"VLLM_BI_CUDA_OPS": "vllm_bi"})],
    }


def long_prompts(models: str) -> str:
    """A JSONL prompts file (written once) of 8 prompts of about 150-300 tokens."""
    path = os.path.join(models, "long_prompts.jsonl")
    if not os.path.exists(path):
        os.makedirs(models, exist_ok=True)
        words = ("the state of a gated delta rule layer keeps a running summary of keys and values and decays "
                 "it at every token while the attention layers read the whole context").split()
        with open(path, "w") as f:
            for i in range(8):
                n = 150 + 20 * i
                f.write(json.dumps({"prompt": " ".join(words[(i + j) % len(words)] for j in range(n))}) + "\n")
    return path


def build_models(models: str, names: set[str]) -> None:
    from vllm_bi.testing.tiny_models import SPECS, build_tiny_model

    for key in sorted(names):
        fam, spec = MODELS[key]
        t0 = time.time()
        build_tiny_model(fam, os.path.join(models, key), seed=0, spec=SPECS[spec])
        print(f"[suite] model {key} ({fam}, {spec}) ready in {time.time() - t0:.0f} s", flush=True)


class GpuPool:
    """Hands out GPU ids; a job waits until it can have `n` GPUs whose job count is lowest."""

    def __init__(self, n_gpus: int, per_gpu: int):
        self.load = [0] * n_gpus
        self.per_gpu = per_gpu
        self.cv = threading.Condition()

    def take(self, n: int) -> list[int]:
        with self.cv:
            while True:
                free = sorted((c, i) for i, c in enumerate(self.load) if c < self.per_gpu)
                if len(free) >= n:
                    ids = sorted(i for _, i in free[:n])
                    for i in ids:
                        self.load[i] += 1
                    return ids
                self.cv.wait()

    def give(self, ids: list[int]) -> None:
        with self.cv:
            for i in ids:
                self.load[i] -= 1
            self.cv.notify_all()


def run_job(job: Job, pool: GpuPool, logdir: str, partial: str | None = None) -> dict:
    ids = pool.take(job.gpus)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = [visible[i] if i < len(visible) else str(i) for i in ids]  # the suite's own GPU list, if given
    env = dict(os.environ, **job.env, CUDA_VISIBLE_DEVICES=",".join(devices), PYTHONUNBUFFERED="1")
    slug = "".join(c if c.isalnum() or c in "-." else "_" for c in job.name)
    run_dir = os.path.join(RUNS, slug)
    argv = list(job.argv)
    if job.kind == "trainer":
        argv += ["--run-dir", run_dir]
        if "torch.distributed.run" in argv:
            from vllm_bi.testing.server import free_port

            argv[argv.index("torch.distributed.run") + 1:1] = ["--master-port", str(free_port())]
    elif job.kind == "serve":
        argv += ["--out", run_dir]
    t0 = time.time()
    print(f"[suite] start {job.name} on GPU {ids}: {shlex.join(argv)}", flush=True)
    rec = {"job": job.name, "kind": job.kind, "gpus": ids, "env": job.env, "cmd": shlex.join(argv),
           "expect_pass": job.expect_pass}
    try:
        with open(os.path.join(logdir, slug + ".log"), "w") as log:
            for attempt in range(2):
                p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                   timeout=job.timeout)
                log.flush()
                with open(log.name, errors="replace") as f:
                    # vLLM's start-up memory check trips when another job's server frees memory meanwhile
                    if p.returncode == 0 or "Error in memory profiling" not in f.read():
                        break
                log.write(f"\n--- retry {attempt + 1}: memory profiling disturbed by a concurrent job ---\n")
                rec["retried"] = True
            log.write("\n--- stdout ---\n" + p.stdout)
        rec["rc"] = p.returncode
        rec.update(_verdict(job, p.stdout, run_dir))
    except subprocess.TimeoutExpired:
        rec.update(rc=None, passed=False, error=f"timed out after {job.timeout} s")
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        rec.update(rc=None, passed=False, error=f"{type(e).__name__}: {e}")
    finally:
        pool.give(ids)
    for name in ("metrics.jsonl", "results.json", "results.md"):
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy(os.path.join(run_dir, name), os.path.join(logdir, f"{slug}.{name}"))
    rec["seconds"] = round(time.time() - t0, 1)
    print(f"[suite] done  {job.name}: {_summary(rec)} ({rec['seconds']} s)", flush=True)
    if partial:  # each verdict as soon as it is known, in case the suite is cut short
        with open(partial, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def _verdict(job: Job, stdout: str, run_dir: str) -> dict:
    if job.kind == "parity":
        line = next((ln for ln in reversed(stdout.strip().splitlines()) if ln.startswith("{")), None)
        if line is None:
            return {"passed": False, "error": "no JSON report (see the log)"}
        r = json.loads(line)
        return {"passed": bool(r["pass"]), "tokens": r["tokens"], "bitwise_equal": r["bitwise_equal"],
                "max_abs_diff": r["max_abs_diff"], "mean_abs_diff": r["mean_abs_diff"]}
    if job.kind == "trainer":
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return {"passed": False, "error": "no metrics.jsonl (see the log)"}
        with open(path) as f:
            rows = [json.loads(ln) for ln in f if ln.strip()]
        diffs = [r["bit_wise/logprob_diff/max"] for r in rows]
        return {"passed": bool(rows) and all(d == 0.0 for d in diffs), "steps": len(rows),
                "logprob_diff_max_per_step": diffs, "reward": [r.get("reward/mean") for r in rows],
                "world_size": rows[-1].get("trainer/world_size") if rows else None}
    if job.kind == "serve":
        path = os.path.join(run_dir, "results.json")
        if not os.path.exists(path):
            return {"passed": False, "error": "no results.json (see the log)"}
        with open(path) as f:
            (res,) = json.load(f).values()
        if "error" in res:
            return {"passed": False, "error": res["error"][-300:]}
        counts = {k: f"{sum(r['equal'] for r in res[k])}/{len(res[k])}" for k in ("P1", "P2", "P3")}
        return {"passed": all(r["equal"] for k in ("P1", "P2", "P3") for r in res[k]), "counts": counts}
    return {"passed": False, "error": f"unknown job kind {job.kind}"}


def _summary(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"]
    if rec["kind"] == "parity":
        return f"{rec['bitwise_equal']}/{rec['tokens']} equal, max |diff| {rec['max_abs_diff']:.3g}"
    if rec["kind"] == "trainer":
        return f"{rec['steps']} steps, max logprob diff per step {rec['logprob_diff_max_per_step']}"
    return " ".join(f"{k} {v}" for k, v in rec.get("counts", {}).items()) or ("pass" if rec["passed"] else "fail")


def markdown(recs: list[dict]) -> str:
    rows = ["| job | GPUs | result | expected | as expected | seconds |", "|---|---|---|---|---|---|"]
    for r in recs:
        ok = r.get("passed") == r["expect_pass"] and "error" not in r
        rows.append(f"| {r['job']} | {len(r['gpus'])} | {_summary(r)} | {'PASS' if r['expect_pass'] else 'FAIL'} "
                    f"| {'yes' if ok else '**NO**'} | {r['seconds']} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="parity-own,control", help="comma-separated job groups")
    ap.add_argument("--models", default="/tmp/vllm_bi_models")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/vllm_bi_suite"))
    ap.add_argument("--parallel", type=int, default=4, help="jobs at once")
    ap.add_argument("--per-gpu", type=int, default=4, help="jobs sharing one GPU at most")
    ap.add_argument("--job-timeout", type=int, default=None, help="seconds per job (default: each job's own)")
    ap.add_argument("--match", default=None,
                    help="comma-separated substrings: run only the chosen groups' jobs whose name contains one")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    catalogue = build_jobs(args.models)
    if args.list:
        for g, jobs in catalogue.items():
            print(g + ": " + "; ".join(j.name for j in jobs))
        return 0
    groups = [g.strip() for g in args.jobs.split(",") if g.strip()]
    unknown = [g for g in groups if g not in catalogue]
    if unknown:
        ap.error(f"unknown job group(s) {unknown}; choose from {sorted(catalogue)}")
    jobs = [j for g in groups for j in catalogue[g]]
    if args.match:
        subs = [m.strip() for m in args.match.split(",") if m.strip()]
        jobs = [j for j in jobs if any(m in j.name for m in subs)]
        if not jobs:
            ap.error(f"--match {args.match!r} selects no job of {groups}")
    for j in jobs:
        j.timeout = args.job_timeout or j.timeout
    import torch

    n_gpus = torch.cuda.device_count()
    too_big = [j.name for j in jobs if j.gpus > n_gpus]
    if too_big:
        print(f"[suite] skipping (need more GPUs than the {n_gpus} here): {too_big}", flush=True)
        jobs = [j for j in jobs if j.gpus <= n_gpus]
    needed = {os.path.basename(a) for j in jobs for a in j.argv if a.startswith(args.models)}
    needed |= {"qwen3.5"} if any(j.kind == "serve" for j in jobs) else set()
    build_models(args.models, needed & MODELS.keys())
    os.makedirs(args.out, exist_ok=True)
    logdir = os.path.join("/tmp", "vllm_bi_suite_logs")
    os.makedirs(logdir, exist_ok=True)
    pool = GpuPool(n_gpus, args.per_gpu)
    tag = "_".join(groups)
    partial = os.path.join(args.out, f"suite_{tag}.jsonl")
    with ThreadPoolExecutor(args.parallel) as ex:
        recs = list(ex.map(lambda j: run_job(j, pool, logdir, partial), jobs))
    with open(os.path.join(args.out, f"suite_{tag}.json"), "w") as f:
        json.dump(recs, f, indent=1)
    md = markdown(recs)
    with open(os.path.join(args.out, f"suite_{tag}.md"), "w") as f:
        f.write(md)
    with tarfile.open(os.path.join(args.out, f"logs_{tag}.tar.gz"), "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    print(md)
    return 0 if all(r.get("passed") == r["expect_pass"] and "error" not in r for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
