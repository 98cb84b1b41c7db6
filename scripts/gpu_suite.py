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
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MEM = "--gpu-memory-utilization 0.1"
STOCK_ARGS = "--gdn-prefill-backend triton"
# the models the jobs use: directory name -> (family, spec of vllm_bi.tiny_models.SPECS)
MODELS = {"qwen3.5": ("qwen3.5", "default"), "qwen3-next": ("qwen3-next", "default"),
          "qwen3.5-moe": ("qwen3.5-moe", "default"), "qwen3.5-9b": ("qwen3.5", "9b-dims"),
          "moe-router": ("qwen3.5-moe", "moe-router"),
          "qwen3.5-tp": ("qwen3.5", "tp"), "qwen3.5-moe-odd": ("qwen3.5-moe", "odd-heads"),
          "kimi-linear": ("kimi-linear", "default")}
RUNS = "/tmp/vllm_bi_suite_runs"  # trainer run dirs (checkpoints stay here; metrics are copied to the logs)


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
            prompts=None, gemm=None, attention=None, graphs=None, moe=None, tiles=None, preset=None, mem=MEM,
            chunk_decode=None, trainer="vllm_bi", preview=None) -> Job:
    """A ``vllm-bi parity`` job (``trainer``: its ``--trainer``; ``preview``: its ``VLLM_BI_CUDA_PREVIEW``); a setting
    left None is not set (the defaults, or the suite's environment)."""
    server_args = f"{mem} --tensor-parallel-size {tp} {STOCK_ARGS if stock else ''} {extra}".strip()
    argv = [sys.executable, "-m", "vllm_bi.cli", "parity", "--model", model, "--json", "--n", str(n),
            "--max-tokens", str(max_tokens), "--server-args", server_args, "--trainer-device", "cuda"]
    if stock:
        argv.append("--stock-server")
    if prompts:
        argv += ["--prompts", prompts]
    if trainer != "vllm_bi":
        argv += ["--trainer", trainer]
    given = {"VLLM_BI_CUDA_OPS": ops, "VLLM_BI_GDN_MODE": gdn, "VLLM_BI_GEMM": gemm, "VLLM_BI_ATTENTION": attention,
             "VLLM_BI_CUDA_GRAPHS": graphs, "VLLM_BI_MOE": moe, "VLLM_BI_GEMM_CONFIGS": tiles, "VLLM_BI_PRESET": preset,
             "VLLM_BI_CHUNK_DECODE": chunk_decode, "VLLM_BI_CUDA_PREVIEW": preview}
    env = {k: v for k, v in given.items() if v is not None}
    return Job(name, "parity", argv, env, gpus=tp, expect_pass=not stock and ops == "vllm_bi")


def build_jobs(models: str) -> dict[str, list[Job]]:
    m = {k: os.path.join(models, k) for k in MODELS}
    serve = [sys.executable, os.path.join(ROOT, "scripts", "gpu_serve_parity.py"), "--trials", "2",
             "--models", models]
    trainer = ["-m", "vllm_bi.trainer", "--steps", "4", "--prompts-per-step", "4", "--group-size", "4",
               "--max-tokens", "12", "--tensorboard", "false", "--progress", "false",
               "--server-args", f"--max-num-batched-tokens 256 --max-num-seqs 32 {MEM}"]
    # the fast settings (tuned Triton GEMM with the shipped H200 table + decode graphs): _parity's arguments, and
    # the same as a trainer job's environment
    fast = {"gemm": "triton", "graphs": "decode", "tiles": "h200-qwen3.5-9b"}
    fast_name = "triton GEMM h200 tiles + graphs"
    fast_env = {"VLLM_BI_GEMM": fast["gemm"], "VLLM_BI_GEMM_CONFIGS": fast["tiles"], "VLLM_BI_CUDA_GRAPHS": fast["graphs"]}
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
        # no checkpoints: ~10 GB each at 9b-dims (gathered on rank 0, a step then took minutes:
        # docs/results/2026-11-30-h200-fsdp2-and-gdn-train-cost.md); the small FSDP2 job above still writes its sharded checkpoints
        # every step
        "fsdp2-big": [Job("trainer FSDP2 x2 GPUs qwen3.5 9b-dims", "trainer",
                      [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *trainer,
                       "--save-every", "0", "--model", m["qwen3.5-9b"]],
                      # steps of 3-6 minutes, cause unknown (docs/results/2026-11-30-h200-attention-op-cost.md);
                      # Triton prints each autotuning it does
                      {"VLLM_BI_CUDA_OPS": "vllm_bi", "TRITON_PRINT_AUTOTUNING": "1"}, gpus=2)],
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
        # the Triton attention kernel (VLLM_BI_ATTENTION=triton; the default once these pass), both GDN modes,
        # and the trainer's backward through it
        "attention-triton": [
            _parity("parity triton attention qwen3.5", m["qwen3.5"], attention="triton"),
            _parity("parity triton attention qwen3.5-moe", m["qwen3.5-moe"], attention="triton"),
            _parity("parity triton attention qwen3.5 9b-dims", m["qwen3.5-9b"], attention="triton", max_tokens=16),
            _parity("parity triton attention chunk mode qwen3.5", m["qwen3.5"], attention="triton", gdn="chunk",
                    max_tokens=80, prompts=long_prompts(models)),
            Job("trainer 1 GPU triton attention qwen3.5", "trainer", [sys.executable, *trainer, "--model", m["qwen3.5"]],
                {"VLLM_BI_CUDA_OPS": "vllm_bi", "VLLM_BI_ATTENTION": "triton"})],
        # experimental CUDA graphs for decode steps (needs the Triton attention; dense models only)
        "graphs": [
            _parity("parity CUDA graphs (decode) qwen3.5", m["qwen3.5"], attention="triton", graphs="decode"),
            _parity("parity CUDA graphs (decode) qwen3.5 9b-dims", m["qwen3.5-9b"], attention="triton",
                    graphs="decode", max_tokens=16)],
        # the grouped MoE kernels (VLLM_BI_MOE=triton, bf16; exact, float64): parity, with decode CUDA graphs (MoE is
        # capturable then), and the trainer's backward through them
        "moe-triton": [
            _parity("parity MoE triton qwen3.5-moe", m["qwen3.5-moe"], moe="triton"),
            _parity("parity MoE loop (float64 host loop) qwen3.5-moe", m["qwen3.5-moe"], moe="loop"),
            _parity("parity MoE triton moe-router (256 experts, top-8)", m["moe-router"], moe="triton", max_tokens=16),
            _parity("parity MoE triton + CUDA graphs (decode) qwen3.5-moe", m["qwen3.5-moe"], moe="triton",
                    graphs="decode"),
            _parity("parity MoE exact (float64 kernels) + CUDA graphs (decode) qwen3.5-moe", m["qwen3.5-moe"],
                    moe="exact", graphs="decode"),
            Job("trainer 1 GPU MoE triton qwen3.5-moe", "trainer", [sys.executable, *trainer, "--model",
                                                                    m["qwen3.5-moe"]],
                {"VLLM_BI_CUDA_OPS": "vllm_bi", "VLLM_BI_MOE": "triton"})],
        # the fast settings together: tuned Triton GEMM (the H200 table shipped with vllm_bi) + decode CUDA graphs,
        # and an RL trainer (backward) against a server run so
        "fast": [
            _parity(f"parity fast ({fast_name}) qwen3.5", m["qwen3.5"], **fast),
            _parity(f"parity fast ({fast_name}) qwen3.5 9b-dims", m["qwen3.5-9b"], max_tokens=16, **fast),
            Job(f"trainer 1 GPU fast ({fast_name}) qwen3.5", "trainer", [sys.executable, *trainer, "--model", m["qwen3.5"]],
                {"VLLM_BI_CUDA_OPS": "vllm_bi", **fast_env})],
        # unusual head shapes (hidden 1536, GDN 4 / 8 heads, 48 experts top-6, 7 layers), prompts of 5-700 tokens, in
        # every GDN mode, and the stock control
        "heads": [_parity(f"parity {mode} mode qwen3.5-moe odd-heads", m["qwen3.5-moe-odd"], gdn=mode, max_tokens=64,
                          prompts=mixed_prompts(models)) for mode in ("chunk", "recurrent")]
                 + [_parity("control: stock vLLM qwen3.5-moe odd-heads", m["qwen3.5-moe-odd"], stock=True,
                            max_tokens=64, prompts=mixed_prompts(models))],
        "quick": [_parity("parity own-ops qwen3.5", m["qwen3.5"]), _parity("parity own-ops qwen3.5-moe", m["qwen3.5-moe"])],
        "trainer1": [Job("trainer 1 GPU qwen3.5", "trainer", [sys.executable, *trainer, "--model", m["qwen3.5"]],
                         {"VLLM_BI_CUDA_OPS": "vllm_bi"})],
    }


def _prompts_file(path: str, text: str, lengths, answer: str) -> str:
    """A JSONL prompts file (written once): prompt ``i`` is ``lengths[i]`` words of ``text`` from its ``i``-th word
    on, with an ``answer`` that lets the trainer's jobs use the file as a task (reward: contains)."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        words = text.split()
        with open(path, "w") as f:
            for i, n in enumerate(lengths):
                f.write(json.dumps({"prompt": " ".join(words[(i + j) % len(words)] for j in range(n)),
                                    "answer": answer}) + "\n")
    return path


def long_prompts(models: str) -> str:
    """8 prompts of about 150-300 tokens."""
    return _prompts_file(os.path.join(models, "long_prompts.jsonl"),
                         "the state of a gated delta rule layer keeps a running summary of keys and values and decays "
                         "it at every token while the attention layers read the whole context",
                         [150 + 20 * i for i in range(8)], "state")


def mixed_prompts(models: str) -> str:
    """12 prompts from 5 to 700 words: shorter than a block, within one, and over ten blocks."""
    return _prompts_file(os.path.join(models, "mixed_prompts.jsonl"),
                         "a tool call returned its output and the agent read it then wrote the next step of the plan "
                         "checking each value against the state it kept",
                         (5, 9, 17, 40, 63, 64, 65, 130, 200, 333, 512, 700), "step")


def build_models(models: str, names: set[str]) -> None:
    from vllm_bi.tiny_models import SPECS, build_tiny_model

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


# --------------------------------------------------------------------------- job processes
# A job runs in its own session (start_new_session), so one killpg reaches torchrun and its ranks; the vLLM server
# a trainer or parity run starts calls setsid itself (vllm_bi.launcher.VllmServer), so the job's processes are
# also found through /proc: descendants by ppid (tracked while the job runs, so an orphaned server stays known) and
# every process whose environment carries the job's token (MARK), which all of them inherit.

STOP = threading.Event()  # set when the suite is interrupted: running jobs are killed, waiting ones are not started
MARK = "VLLM_BI_SUITE_JOB"
KILL_GRACE = 15.0  # seconds between SIGTERM and SIGKILL
SERVER_LOG_TAIL = 300_000  # bytes of a run dir's server.log copied to the logs


class Interrupted(Exception):
    """The suite was interrupted (Ctrl-C, SIGTERM) while this job ran."""


def _ps() -> dict[int, tuple[int, int, int, str, int]]:
    """pid -> (ppid, pgrp, session, state, starttime) of every process, from /proc/PID/stat."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                s = f.read()
            rest = s[s.rindex(b")") + 2:].split()  # fields 3.. (the command name may hold spaces and parens)
            out[int(d)] = (int(rest[1]), int(rest[2]), int(rest[3]), rest[0].decode(), int(rest[19]))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def _marked(token: str, ps: dict) -> set[int]:
    """The processes whose environment holds MARK=token (readable for our own processes only)."""
    needle = f"{MARK}={token}".encode()
    hits = set()
    for pid in ps:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    hits.add(pid)
        except OSError:
            continue
    return hits


def job_processes(root: int, root_alive: bool, ps: dict, known: dict[int, int] | None = None,
                  token: str | None = None) -> set[int]:
    """The live-or-zombie processes of the job whose main process is `root` (pid == its session id): its session,
    the processes in `known` (pid -> starttime, still the same process), those marked with `token`, the sessions
    these lead (a setsid vLLM server) and everything below all of them."""
    seeds = {q for q, st in ps.items() if st[2] == root}
    if root_alive and root in ps:
        seeds.add(root)
    seeds |= {q for q, start in (known or {}).items() if q in ps and ps[q][4] == start}
    if token:
        seeds |= _marked(token, ps)
    seeds |= {q for q, st in ps.items() if st[2] in seeds}
    children: dict[int, list[int]] = {}
    for q, st in ps.items():
        children.setdefault(st[0], []).append(q)
    out, todo = set(), list(seeds)
    while todo:
        q = todo.pop()
        if q not in out:
            out.add(q)
            todo += children.get(q, [])
    return out - {0, 1, os.getpid()}


def kill_job(p: subprocess.Popen, token: str | None = None, known: dict[int, int] | None = None,
             grace: float | None = None) -> list[int]:
    """Stop everything job `p` (started with start_new_session=True) left running: SIGTERM to its processes and
    their process groups, `grace` s to exit, then SIGKILL. The processes are collected before any signal and again
    while waiting. Reaps `p`. Returns the pids that were signalled (empty: nothing was left)."""
    grace = KILL_GRACE if grace is None else grace
    known = dict(known or {})
    own_group = os.getpgrp()

    def live() -> tuple[set[int], dict]:
        ps = _ps()
        procs = job_processes(p.pid, p.poll() is None, ps, known, token)
        for q in procs:
            known.setdefault(q, ps[q][4])  # an orphan re-parented to init stays a target
        return {q for q in procs if ps[q][3] not in ("Z", "X")}, ps

    def send(procs: set[int], ps: dict, sig: int) -> None:
        for q in procs:
            try:
                os.kill(q, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for g in {ps[q][1] for q in procs} - {own_group, 0}:  # catches a child forked meanwhile
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass

    procs, ps = live()
    signalled: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not procs:
            break
        send(procs, ps, sig)
        signalled |= procs
        end = time.monotonic() + wait
        while procs and time.monotonic() < end:
            time.sleep(0.2)
            procs, ps = live()
            if sig == signal.SIGTERM and procs - signalled:  # started during the shutdown
                send(procs - signalled, ps, sig)
                signalled |= procs
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return sorted(signalled)


def run_process(argv: list[str], log, timeout: float, env: dict | None = None, cwd: str | None = None,
                grace: float | None = None) -> int:
    """Run `argv` in its own session, its stdout and stderr going to the open file `log` as they come; kill the
    job's processes (kill_job) when it ends, whichever way: leftovers after a normal exit, everything on a
    timeout (subprocess.TimeoutExpired) or when the suite stops (Interrupted). Returns the exit code."""
    grace = KILL_GRACE if grace is None else grace
    token = uuid.uuid4().hex
    env = dict(os.environ if env is None else env, **{MARK: token})
    log.flush()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True)
    known: dict[int, int] = {}
    why = "left over after the job exited"
    try:
        deadline = time.monotonic() + timeout
        last_track = 0.0
        while True:
            try:
                return p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if STOP.is_set():
                why = "suite interrupted"
                raise Interrupted("suite interrupted")
            if time.monotonic() > deadline:
                why = f"timed out after {timeout} s"
                raise subprocess.TimeoutExpired(argv, timeout)
            if time.monotonic() - last_track > 2.0:  # remember the descendants (a server outlives a crashed parent)
                last_track = time.monotonic()
                ps = _ps()
                for q in job_processes(p.pid, True, ps, known):
                    known.setdefault(q, ps[q][4])
    finally:
        killed = kill_job(p, token, known, grace)
        if killed:
            log.write(f"\n--- [suite] {why}: SIGTERM (SIGKILL after {grace:.0f} s) to {len(killed)} "
                      f"processes: {killed} ---\n")
            log.flush()


def _named_server_log(output: str) -> str | None:
    """The server log a failed `vllm-bi parity` names ("server log: PATH" or "whole log: PATH"), if it exists."""
    import re

    found = re.findall(r"(?:server log|whole log): (\S+?)\)", output)
    return found[-1] if found and os.path.exists(found[-1]) else None


def _memory_profiling_failed(output: str) -> bool:
    """Whether a job's server died in vLLM's start-up memory profiling (disturbed by another job's server)."""
    if "Error in memory profiling" in output:
        return True
    path = _named_server_log(output)
    if path is None:
        return False
    with open(path, errors="replace") as f:
        text = f.read()
    return "Error in memory profiling" in text or "determine_available_memory" in text


def _copy_server_log(job_log: str, logdir: str, slug: str) -> None:
    """The tail of the server log a failed `vllm-bi parity` names ("server log: PATH" or "whole log: PATH"), beside
    the job's log."""
    try:
        with open(job_log, errors="replace") as f:
            path = _named_server_log(f.read())
        if path:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - SERVER_LOG_TAIL))
                tail = f.read()
            with open(os.path.join(logdir, slug + ".server.log"), "wb") as out:
                out.write(tail)
    except OSError:
        pass


def _read_from(path: str, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def collect_run_dir(run_dir: str, logdir: str, slug: str, since: float) -> list[str]:
    """Copy the run dir's metrics.jsonl, results.json/.md and the tail of server.log into `logdir` as
    `slug.NAME`; files not written since `since` (a previous suite run's) are left out."""
    copied = []
    for name in ("metrics.jsonl", "results.json", "results.md", "server.log"):
        src = os.path.join(run_dir, name)
        try:
            if os.path.getmtime(src) < since:
                continue
            dst = os.path.join(logdir, f"{slug}.{name}")
            if name == "server.log":
                with open(src, "rb") as f, open(dst, "wb") as g:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(0, size - SERVER_LOG_TAIL))
                    if size > SERVER_LOG_TAIL:
                        g.write(f"[suite] last {SERVER_LOG_TAIL} of {size} bytes\n".encode())
                    shutil.copyfileobj(f, g)
            else:
                shutil.copy(src, dst)
            copied.append(dst)
        except OSError:
            continue
    return copied


def _steps_so_far(run_dir: str) -> int | None:
    """Steps in a trainer job's metrics.jsonl (its run dir is fresh: run_job empties it first)."""
    from vllm_bi.trainer.metrics import read_metrics

    try:
        return len(read_metrics(run_dir)) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else None
    except (OSError, ValueError):  # a line cut mid-write by the kill
        return None


def run_job(job: Job, pool: GpuPool, logdir: str, partial: str | None = None) -> dict:
    ids = pool.take(job.gpus)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = [visible[i] if i < len(visible) else str(i) for i in ids]  # the suite's own GPU list, if given
    env = dict(os.environ, **job.env, CUDA_VISIBLE_DEVICES=",".join(devices), PYTHONUNBUFFERED="1")
    slug = "".join(c if c.isalnum() or c in "-." else "_" for c in job.name)
    run_dir = os.path.join(RUNS, slug)
    argv = list(job.argv)
    if job.kind == "trainer":
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the trainer would resume a previous suite's run
        argv += ["--run-dir", run_dir]
        if "torch.distributed.run" in argv:
            from vllm_bi.launcher import free_port

            argv[argv.index("torch.distributed.run") + 1:1] = ["--master-port", str(free_port())]
    elif job.kind == "serve":
        argv += ["--out", run_dir]
    t0 = time.time()
    rec = {"job": job.name, "kind": job.kind, "gpus": ids, "env": job.env, "cmd": shlex.join(argv),
           "expect_pass": job.expect_pass}
    log_path = os.path.join(logdir, slug + ".log")
    try:
        if STOP.is_set():
            raise Interrupted("suite interrupted")
        print(f"[suite] start {job.name} on GPU {ids}: {shlex.join(argv)}", flush=True)
        open(log_path, "w").close()
        with open(log_path, "a") as log:  # stdout and stderr of the job, interleaved, as they come
            for attempt in range(2):
                log.flush()
                start = os.path.getsize(log_path)
                rc = run_process(argv, log, job.timeout, env=env, cwd=ROOT)
                out = _read_from(log_path, start)
                # vLLM's start-up memory check trips when another job's server frees memory meanwhile (the job's
                # output names the server log that holds it)
                if rc == 0 or not _memory_profiling_failed(out) or STOP.is_set():
                    break
                log.write(f"\n--- retry {attempt + 1}: memory profiling disturbed by a concurrent job ---\n")
                rec["retried"] = True
        rec["rc"] = rc
        rec.update(_verdict(job, out, run_dir))
    except subprocess.TimeoutExpired:
        steps = _steps_so_far(run_dir) if job.kind == "trainer" else None
        rec.update(rc=None, passed=False, error=f"timed out after {job.timeout} s"
                   + (f" ({steps} trainer steps in metrics.jsonl)" if steps is not None else ""))
    except Interrupted:
        rec.update(rc=None, passed=False, error="suite interrupted")
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        rec.update(rc=None, passed=False, error=f"{type(e).__name__}: {e}")
    finally:
        pool.give(ids)
    collect_run_dir(run_dir, logdir, slug, t0 - 1.0)
    _copy_server_log(log_path, logdir, slug)
    rec["seconds"] = round(time.time() - t0, 1)
    print(f"[suite] done  {job.name}: {_summary(rec)} ({rec['seconds']} s)", flush=True)
    if partial:  # each verdict as soon as it is known, in case the suite is cut short
        with open(partial, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def _json_report(output: str) -> dict | None:
    """The last line of `output` that is a JSON object with a "pass" key (`vllm-bi parity --json`'s report); the
    output is the job's stdout and stderr together."""
    for ln in reversed(output.splitlines()):
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                r = json.loads(ln)
            except ValueError:
                continue
            if isinstance(r, dict) and "pass" in r:
                return r
    return None


def _verdict(job: Job, output: str, run_dir: str) -> dict:
    """The job's verdict from its output (stdout and stderr) or its run dir's files."""
    if job.kind == "parity":
        r = _json_report(output)
        if r is None:
            why = [x for x in output.splitlines() if x.startswith("vllm-bi parity:")]
            return {"passed": False, "error": why[-1][:400] if why else "no JSON report (see the log)"}
        out = {"passed": bool(r["pass"]), "tokens": r["tokens"], "bitwise_equal": r["bitwise_equal"],
               "max_abs_diff": r["max_abs_diff"], "mean_abs_diff": r["mean_abs_diff"], "server": r.get("server", "")}
        if job.env.get("VLLM_BI_CUDA_GRAPHS") == "decode" and "FULL_DECODE_ONLY" not in out["server"]:
            out.update(passed=False, error=f"the server did not report decode CUDA graphs ({out['server']!r})")
        return out
    if job.kind == "trainer":
        from vllm_bi.trainer.metrics import read_metrics

        if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            return {"passed": False, "error": "no metrics.jsonl (see the log)"}
        rows = read_metrics(run_dir)
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


def _interrupt(signum, frame) -> None:
    if not STOP.is_set():  # once: a second signal does not cut the jobs' shutdown short
        STOP.set()
        raise KeyboardInterrupt(f"signal {signum}")


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
    tarball = os.path.join(args.out, f"logs_{tag}.tar.gz")
    # the jobs run in their own sessions, so a Ctrl-C (or the SIGTERM of an outer timeout) reaches only the suite:
    # it stops them (STOP: each worker kills its job's processes) and still writes the logs
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup stays nohup
            signal.signal(sig, _interrupt)
    ex = ThreadPoolExecutor(args.parallel)
    try:
        recs = list(ex.map(lambda j: run_job(j, pool, logdir, partial), jobs))
    except BaseException as e:
        STOP.set()
        print(f"[suite] interrupted: stopping the running jobs (SIGTERM, SIGKILL after {KILL_GRACE:.0f} s); "
              f"the verdicts so far are in {partial}", flush=True)
        ex.shutdown(wait=True, cancel_futures=True)
        with tarfile.open(tarball, "w:gz") as tar:
            tar.add(logdir, arcname="logs")
        if isinstance(e, KeyboardInterrupt):
            return 130
        raise
    ex.shutdown()
    with open(os.path.join(args.out, f"suite_{tag}.json"), "w") as f:
        json.dump(recs, f, indent=1)
    md = markdown(recs)
    with open(os.path.join(args.out, f"suite_{tag}.md"), "w") as f:
        f.write(md)
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    print(md)
    return 0 if all(r.get("passed") == r["expect_pass"] and "error" not in r for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
