#!/usr/bin/env python3
"""The GPU gate: one bounded matrix of `vllm-bi parity` runs on a CUDA machine, in parallel, each with a timeout, and
a record of the CUDA sources it ran (``vllm_bi.gpu_gate``).

The matrix: the three families (qwen3.5, qwen3-next, qwen3.5-moe) and a model with unusual head shapes (hidden 1536,
GDN 4 key / 8 value heads, 48 experts top-6, 7 layers), each in every GDN mode CUDA serves (recurrent, chunk) with the
default arithmetic (``vllm_bi.settings.DEFAULT_PRESET``); the other of the two presets a CUDA user gets by name,
``auto`` (Triton GEMM with the shipped H200 tile table, decode CUDA graphs where the mode allows them) or ``portable``
(float64 GEMM, eager), whichever is not the default, in every mode on qwen3.5 and the unusual model;
Qwen3.5-9B layer dimensions in the chunk and recurrent modes; a tiny Kimi Linear (KDA, MLA over TRITON_MLA, the
grouped router) in the recurrent mode once ``kimi-linear`` is in ``vllm_bi.settings.CUDA_FEATURES``; and a
stock-vLLM control that must differ. Prompts of 5-700 words, 2
samples each, 48 tokens.

    python3 scripts/gpu_gate.py --out $OUT          # staged by scripts/gpu_run.sh install (docs/gpu.md): about 6 min

Writes ``gpu-gate.json`` (date, device, versions, the matrix's job names, each job's verdict, the sha256 of every
CUDA source) and ``gpu-gate.md`` to ``--out``; a record that lacks a job of the matrix (``--match``, one ``--part``)
does not verify the tree (``vllm_bi.gpu_gate.status``). Where one device call is too short for the matrix (an H100
finished 17 of 18 jobs in 600 s), run ``--part 1/2`` and ``--part 2/2`` in two calls and join them with
``--combine PART1/gpu-gate.json PART2/gate.jsonl``; copy the JSON to ``docs/results/gpu-gate.json`` and run
``python -m vllm_bi.gpu_gate --readme README.md``. Heavier GPU checks (cost tables, fuzz) are separate calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_suite as S  # noqa: E402

MODES = ("recurrent", "chunk")  # the GDN modes the gate runs
from vllm_bi.settings import CUDA_FEATURES, DEFAULT_PRESET  # noqa: E402

OTHER = "portable" if DEFAULT_PRESET == "auto" else "auto"  # the preset the default rows do not cover
NAMED = {"default": {}, OTHER: {"preset": OTHER}}  # each arithmetic's settings (default: none set)
# a fixed KV cache skips vLLM's start-up memory profiling, which fails when another job's server allocates or frees
# meanwhile (half the servers of the first gate runs died so)
MEM = "--gpu-memory-utilization 0.09 --kv-cache-memory-bytes 2147483648"


def jobs(models: str) -> list[tuple[S.Job, dict]]:
    """(job, what it covers) of the gate's matrix."""
    m = {k: os.path.join(models, k) for k in S.MODELS}
    prompts = S.mixed_prompts(models)
    out = []

    def add(model_key, mode, arithmetic, stock=False, max_tokens=48, trainer="vllm_bi", chunk_decode=None,
            attention=None):
        extra = dict(NAMED[arithmetic], **({"attention": attention} if attention else {}))
        preset = DEFAULT_PRESET if arithmetic == "default" else arithmetic
        name = (f"control: stock vLLM {model_key}" if stock
                else f"{model_key} {mode} {arithmetic}" + (" (auto: eager decode in chunk mode)"
                                                             if mode == "chunk" and preset == "auto" and not chunk_decode
                                                             else ""))
        if chunk_decode:
            name += f", VLLM_BI_CHUNK_DECODE={chunk_decode} (decode in CUDA graphs)"
        if trainer != "vllm_bi":
            name += f", trainer: {trainer}"
        job = S._parity(name, m[model_key], gdn=mode, n=2, max_tokens=max_tokens, prompts=prompts, stock=stock,
                        mem=MEM, trainer=trainer, chunk_decode=chunk_decode, **extra)
        out.append((job, {"model": model_key, "gdn_mode": mode, "arithmetic": "stock" if stock else arithmetic,
                          "trainer": trainer}))

    for key in ("qwen3.5", "qwen3-next", "qwen3.5-moe", "qwen3.5-moe-odd"):
        for mode in MODES:
            add(key, mode, "default")
    for key in ("qwen3.5", "qwen3.5-moe-odd"):
        for mode in MODES:
            add(key, mode, OTHER)
    for mode in ("chunk", "recurrent"):
        add("qwen3.5-9b", mode, "default", max_tokens=32)
    # transformers' own model class with vllm_bi's ops applied (what an outside trainer runs), at 9B layer dims
    add("qwen3.5-9b", "recurrent", "default", max_tokens=32, trainer="transformers")
    # the chunk mode's padded decode, captured in CUDA graphs (opt-in)
    for key in ("qwen3.5", "qwen3-next"):
        add(key, "chunk", "default", chunk_decode="padded")
    # Kimi Linear once it is a CUDA feature (the tree that lists it is the tree the gate runs; as a preview it is
    # checked by its own GPU test, tests/gpu/test_kimi_linear_cuda.py), with nothing set: the default attention op
    # takes the torch op for its MLA (head dims 128 + 64, no power of two, which the Triton kernel needs)
    if "kimi-linear" in CUDA_FEATURES:
        add("kimi-linear", "recurrent", "default")
    add("qwen3.5-moe-odd", "recurrent", "default", stock=True)
    return out


def versions() -> dict:
    import importlib.metadata as md

    import torch
    import triton

    def ver(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "?"

    return {"torch": torch.__version__, "triton": triton.__version__, "vllm": ver("vllm"), "fla": ver("fla-core"),
            "cuda": torch.version.cuda}


def part_of(todo: list, part: str) -> list:
    """The jobs of ``part`` (``K/N``: every N-th job of the matrix from the K-th, so each part mixes the models), for a
    gate run over N device calls whose records ``--combine`` joins."""
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise SystemExit(f"gpu_gate.py: --part wants K/N with 1 <= K <= N (e.g. 1/2), got {part!r}")
    return [jw for i, jw in enumerate(todo) if i % n == k - 1]


def job_row(rec: dict, what: dict | None = None) -> dict:
    """The record's row for one job's result (``gpu_suite.run_job``'s dict), with what the job covers."""
    passed = bool(rec.get("passed"))
    return {"job": rec["job"], **(what or {}), "env": rec["env"], "result": S._summary(rec), "passed": passed,
            "expect_pass": rec["expect_pass"], "as_expected": passed == rec["expect_pass"] and "error" not in rec,
            "tokens": rec.get("tokens"), "equal": rec.get("bitwise_equal"), "seconds": rec.get("seconds")}


def combine(base: str, jsonls: list[str], out: str) -> int:
    """A gate split over device calls: ``base`` is the ``gpu-gate.json`` of one call, ``jsonls`` the ``gate.jsonl``
    (one line per finished job) of others at the same CUDA sources (this checkout's). Writes ``gpu-gate.json`` with
    every job of the matrix: a job no call finished counts as not as expected."""
    from vllm_bi.gpu_gate import combined_hash, source_hashes

    with open(base) as f:
        record = json.load(f)
    hashes = source_hashes(ROOT)
    if record["sources_hash"] != combined_hash(hashes):
        print(f"[gate] {base} ran other CUDA sources than this checkout's: nothing to combine", file=sys.stderr)
        return 2
    rows = {r["job"]: r for r in record["jobs"]}
    for path in jsonls:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec["job"] in rows:
                    continue
                rows[rec["job"]] = job_row(rec)
    for name in record.get("matrix", []):  # a job of the matrix that no call finished
        rows.setdefault(name, {"job": name, "result": "not run", "passed": False, "expect_pass": True,
                               "as_expected": False})
    record["jobs"] = list(rows.values())
    record.pop("part", None)
    record["command"] = (f"{record['command']}; combined with the per-job results (gate.jsonl) of {len(jsonls)} "
                         "earlier call(s) at the same sources: python3 scripts/gpu_gate.py --combine ...")
    record["combined_from"] = len(jsonls) + 1
    with open(os.path.join(out, "gpu-gate.json"), "w") as f:
        json.dump(record, f, indent=1)
    n = sum(r["as_expected"] for r in record["jobs"])
    print(f"[gate] combined: {n}/{len(record['jobs'])} as expected; sources {record['sources_hash'][:12]}")
    return 0 if n == len(record["jobs"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="/tmp/vllm_bi_models")
    ap.add_argument("--parallel", type=int, default=7)
    ap.add_argument("--job-timeout", type=int, default=330)
    ap.add_argument("--stagger", type=float, default=12.0, help="seconds between the first wave's job starts")
    ap.add_argument("--match", default=None, help="comma-separated substrings: only the jobs whose name holds one")
    ap.add_argument("--part", default=None, help="K/N: run the K-th of N parts of the matrix (one device call each; "
                    "then --combine the parts' records)")
    ap.add_argument("--combine", nargs="+", metavar="FILE", help="BASE.json JOBS.jsonl ...: write the record of a gate "
                    "split over calls (the first call's gpu-gate.json, the other calls' gate.jsonl) to --out")
    args = ap.parse_args()
    if args.combine:
        return combine(args.combine[0], args.combine[1:], args.out)
    import torch

    from vllm_bi.gpu_gate import combined_hash, source_hashes

    t0 = time.time()
    todo = jobs(args.models)
    matrix = [j.name for j, _ in todo]
    if args.part:
        todo = part_of(todo, args.part)
    if args.match:
        todo = [(j, w) for j, w in todo if any(s in j.name for s in args.match.split(","))]
    for j, _ in todo:
        j.timeout = args.job_timeout
    S.build_models(args.models, {w["model"] for _, w in todo})
    os.makedirs(args.out, exist_ok=True)
    logdir = "/tmp/vllm_bi_gate_logs"
    os.makedirs(logdir, exist_ok=True)
    pool = S.GpuPool(torch.cuda.device_count(), args.parallel)
    def run(i_jw):
        i, (job, _) = i_jw
        if i < args.parallel:  # the first wave's servers start apart: vLLM's memory profiling at start-up trips
            time.sleep(i * args.stagger)  # when another server allocates meanwhile
        return S.run_job(job, pool, logdir, os.path.join(args.out, "gate.jsonl"))

    with ThreadPoolExecutor(args.parallel) as ex:
        recs = list(ex.map(run, enumerate(todo)))
    hashes = source_hashes(ROOT)
    rows = [job_row(rec, what) for (_, what), rec in zip(todo, recs)]
    record = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "versions": versions(), "command": "python3 scripts/gpu_gate.py --out $OUT"
              + (f" --part {args.part}" if args.part else "") + (f" --match {args.match}" if args.match else ""),
              "seconds": round(time.time() - t0), "sources": hashes, "sources_hash": combined_hash(hashes),
              "matrix": matrix, "jobs": rows}
    if args.part:
        record["part"] = args.part
    with open(os.path.join(args.out, "gpu-gate.json"), "w") as f:
        json.dump(record, f, indent=1)
    md = S.markdown(recs)
    with open(os.path.join(args.out, "gpu-gate.md"), "w") as f:
        f.write(md)
    with tarfile.open(os.path.join(args.out, "gate_logs.tar.gz"), "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    print(md)
    print(f"[gate] {sum(r['as_expected'] for r in rows)}/{len(rows)} as expected in {record['seconds']} s; "
          f"sources {record['sources_hash'][:12]}")
    return 0 if all(r["as_expected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
