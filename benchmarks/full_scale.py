"""Benchmark: stock vLLM against vllm_bi's defaults on one full-size checkpoint, side by side in one run.

    python benchmarks/full_scale.py --model /tmp/ckpt/9b [--part serve|parity|all] [--window 15] [--out table.md]

The checkpoint is a real-size one (``vllm-bi make-checkpoint qwen3.5-9b DIR``: the published config, random
weights). Parts:

* ``serve``: for each side (``stock``: ``VLLM_BATCH_INVARIANT=0``; ``vllm_bi``: ``VLLM_BATCH_INVARIANT=1`` and no other
  setting, so the defaults; ``vllm_bi:VLLM_BI_X=VALUE``: the defaults but that setting, to weigh a candidate default
  in the same run) one ``vllm serve`` with the same arguments, then, over fixed windows of wall time
  (``--window`` seconds; a request still running at the end is waited for and counted):

  - prefill: 64 clients each sending 1K-token prompts with ``max_tokens=1`` back to back -> prompt tokens/s;
  - decode at 64 and at 256 clients: 1K-token prompts, 128 generated tokens each (EOS ignored), back to back ->
    generated tokens/s of wall time, and the mean time per output token from the server's own histogram
    (``vllm:inter_token_latency_seconds``);
  - an RL-shaped load: one wave of 64 prompts x 8 samples (512-token prompts, 256 tokens at temperature 1, a seed
    per sample) -> generated tokens/s over the wave, and the share of its prompt tokens the prefix cache served
    (vLLM's ``vllm:prefix_cache_*`` counters over the wave: the samples of a prompt can share its cached blocks);
  - memory: the KV-cache size and the maximum concurrency the server's start-up log reports for its
    ``--max-model-len``, the attention block it chose (a hybrid model's block holds one GDN state's page, so it is
    the prefix cache's grain), and the device's peak used memory (``nvidia-smi``) over the side's run.

  Every phase is preceded by an unmeasured warm-up with the same shapes (Triton compiles per batch shape).
* ``parity``: ``vllm-bi parity`` on the checkpoint for each ``vllm_bi`` side (its settings on server and trainer
  alike; ``vllm_bi`` alone: the defaults): 16 prompts x 4 samples x 128 tokens, every token bitwise.
* ``profile``: where each side's GPU time goes, by part. Each side's server runs vLLM's torch profiler
  (``--profiler-config``) over two identical-shape loads on fresh prompts: 64 x 1K-token prompts with
  ``max_tokens=1`` (prefill) and with ``max_tokens=65`` (prefill + 64 decode steps at batch 64); the decode bill is
  the difference. Kernel time is summed from the trace by kernel name, then by part (GEMM, attention, GDN, norm,
  sampling and logprobs, other) with the patterns of ``PARTS``; the JSON keeps every kernel's total. The profiler
  records Python stacks, so each kernel is also charged to where vllm_bi launched it (the two innermost vllm_bi
  frames; ``sites`` in the JSON), and the table lists where the small kernels (norms + pointwise, other) come from.
  Stacks add host time to each launch, so a profiled load's wall time is not a served one's.

Ratios are vllm_bi / stock (time per token, or stock / vllm_bi for throughputs: how many times slower), within one
run: the machine is shared, and ratios hold only within a run. Rows are written as they come (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# every deviation from vLLM 0.32's own defaults, applied to both sides: the offline GPU bundle has no FlashInfer
# (its GDN prefill backend and its sampler: VLLM_USE_FLASHINFER_SAMPLER=0 comes from scripts/gpu_run.sh)
DEVIATIONS = "--gdn-prefill-backend triton"
SERVER_ARGS = "--gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 256"
_KV = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_KV_MEM = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
# vLLM sizes a hybrid model's attention block so that one page holds a GDN layer's state: the prefix cache's grain
_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


class PeakMemory:
    """The device's peak used memory (MiB, ``nvidia-smi``) while the block runs; None without ``nvidia-smi``."""

    def __init__(self, period: float = 0.5):
        self.period, self.peak, self._stop = period, None, threading.Event()

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                used = max(int(x) for x in out)
                self.peak = used if self.peak is None else max(self.peak, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self._stop.wait(self.period)

    def __enter__(self):
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=15)


def _itl(srv) -> tuple[float, float]:
    return (srv.metric_sum("vllm:inter_token_latency_seconds_sum"),
            srv.metric_sum("vllm:inter_token_latency_seconds_count"))


def closed_loop(srv, clients: int, window: float, prompt_len: int, max_tokens: int, vocab: int, seed: int,
                temperature: float = 0.0) -> dict:
    """``clients`` threads each sending one request after another for ``window`` seconds (greedy, or at
    ``temperature`` with a seed per request) -> tokens per second of wall time (prompt tokens when ``max_tokens`` is
    1, else generated tokens) and the mean inter-token latency."""
    rng = random.Random(seed)
    pool = _prompts(clients * 4, prompt_len, vocab, rng)
    lock = threading.Lock()
    done = {"prompt": 0, "gen": 0, "requests": 0}
    s0, c0 = _itl(srv)
    t0 = time.perf_counter()
    deadline = t0 + window

    def client(i):
        k = 0
        while time.perf_counter() < deadline:
            p = pool[(i + k * clients) % len(pool)]
            p = [p[0] + 1 + (k % 7)] + p[1:] if k else p  # another first token: no prefix hit between repeats
            c = srv.complete(p, max_tokens=max_tokens, temperature=temperature,
                             seed=seed * 10**9 + i * 10**6 + k if temperature else None)
            k += 1
            with lock:
                done["prompt"] += len(p)
                done["gen"] += len(c.token_ids)
                done["requests"] += 1

    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    wall = time.perf_counter() - t0
    s1, c1 = _itl(srv)
    tokens = done["prompt"] if max_tokens == 1 else done["gen"]
    return {"tok_s": tokens / wall, "wall_s": wall, "requests": done["requests"], "tokens": tokens,
            "tpot_ms": 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None}


def _prefix_counters(srv) -> tuple[float, float]:
    """vLLM's prefix-cache counters (hit and queried prompt tokens), ``_total`` as Prometheus names counters."""
    return (srv.metric_sum("vllm:prefix_cache_hits_total"), srv.metric_sum("vllm:prefix_cache_queries_total"))


def rl_wave(srv, prompts: int, samples: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> dict:
    """One RL step's rollout: ``prompts`` x ``samples`` requests at once (temperature 1, a seed per sample); with
    the share of its prompt tokens the prefix cache served (the samples of a prompt share it)."""
    rng = random.Random(seed)
    ps = _prompts(prompts, prompt_len, vocab, rng)
    reqs = [dict(prompt_ids=p, max_tokens=max_tokens, temperature=1.0, seed=seed * 100003 + i * samples + j)
            for i, p in enumerate(ps) for j in range(samples)]
    h0, q0 = _prefix_counters(srv)
    t0 = time.perf_counter()
    out = srv.complete_many(reqs)
    wall = time.perf_counter() - t0
    h1, q1 = _prefix_counters(srv)
    gen = sum(len(c.token_ids) for c in out)
    return {"tok_s": gen / wall, "wall_s": wall, "tokens": gen,
            "prefix_hit_pct": 100.0 * (h1 - h0) / (q1 - q0) if q1 > q0 else None}


def parse_side(side: str) -> tuple[bool, dict]:
    """``stock``, ``vllm_bi`` (the defaults) or ``vllm_bi:VAR=VALUE[:VAR=VALUE...]`` (the defaults but those
    ``VLLM_BI_*`` settings): ``(batch invariant, the settings)``. Raises ``ValueError`` naming a bad side."""
    name, *sets = side.split(":")
    if name not in ("stock", "vllm_bi") or (name == "stock" and sets):
        raise ValueError(f"side {side!r}: use stock, vllm_bi or vllm_bi:VLLM_BI_X=VALUE[:VLLM_BI_Y=VALUE]")
    env = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("VLLM_BI_"):
            raise ValueError(f"side {side!r}: {item!r} is not VLLM_BI_X=VALUE")
        env[key] = value
    return name == "vllm_bi", env


def side_env(side: str) -> dict:
    """The server environment of ``side``: batch invariance on for ``vllm_bi`` with its defaults (no ``VLLM_BI_*``
    setting reaches the server but those the side names), off for ``stock``."""
    from vllm_bi.launcher import cpu_env

    bi, settings = parse_side(side)
    env = cpu_env(bi)
    if bi:
        for k in [k for k in env if k.startswith("VLLM_BI_")]:
            del env[k]
        env.update(settings)
    return env


def _file_label(side: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", side)


def serve_side(side: str, model: str, server_args: str, window: float, vocab: int, log_dir: str) -> dict:
    from vllm_bi.launcher import VllmServer

    bi = parse_side(side)[0]
    env = side_env(side)
    args = shlex.split(server_args) + shlex.split(DEVIATIONS)
    log_path = os.path.join(log_dir, f"server-{_file_label(side)}.log")
    r: dict = {"side": side}
    t0 = time.time()
    with PeakMemory() as mem:
        with VllmServer(model, batch_invariant=bi, args=args, env=env, startup_timeout=480, log_path=log_path) as srv:
            r["startup_s"] = time.time() - t0
            print(f"[full-scale] {side}: up in {r['startup_s']:.0f} s", flush=True)
            srv.complete_many([dict(prompt_ids=p, max_tokens=4) for p in _prompts(128, 1024, vocab,
                                                                                  random.Random(1))])
            rl_wave(srv, 8, 8, 512, 8, vocab, seed=2)  # warm-up: every phase's shapes, unmeasured
            r["prefill"] = closed_loop(srv, 64, window, 1024, 1, vocab, seed=10)
            print(f"[full-scale] {side}: prefill {r['prefill']['tok_s']:.0f} tok/s", flush=True)
            for c in (64, 256):
                r[f"decode{c}"] = closed_loop(srv, c, window, 1024, 128, vocab, seed=20 + c)
                print(f"[full-scale] {side}: decode at {c}: {r[f'decode{c}']['tok_s']:.0f} tok/s, TPOT "
                      f"{r[f'decode{c}']['tpot_ms']} ms", flush=True)
            r["rl"] = rl_wave(srv, 64, 8, 512, 256, vocab, seed=30)
            print(f"[full-scale] {side}: RL wave {r['rl']['tok_s']:.0f} tok/s in {r['rl']['wall_s']:.1f} s",
                  flush=True)
    r["peak_mem_mib"] = mem.peak
    with open(log_path, errors="replace") as f:
        text = f.read()
    kv = _KV.search(text)
    if kv:
        r["kv_tokens"], r["kv_max_len"], r["max_concurrency"] = (int(kv[1].replace(",", "")),
                                                                 int(kv[2].replace(",", "")), float(kv[3]))
    km = _KV_MEM.search(text)
    r["kv_mem_gib"] = float(km[1]) if km else None
    bl = _BLOCK.search(text)
    r["block_tokens"] = int(bl[1]) if bl else None
    arith = [ln.split("vllm_bi: ", 1)[1].strip() for ln in text.splitlines() if "vllm_bi: arithmetic on CUDA" in ln]
    r["arithmetic"] = arith[0] if arith else ("stock vLLM" if not bi else "?")
    return r


def cell(v: float | None) -> str:
    """A number for a table cell: thousands separated from 100 on, two decimals below (``n/a`` when missing)."""
    return "n/a" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}")


def serve_table(rows: list[dict]) -> list[str]:
    def get(r, *path):
        for p in path:
            r = r.get(p) if isinstance(r, dict) else None
        return r

    metrics = [("prefill tok/s (64 clients, 1K prompts)", ("prefill", "tok_s"), "thr"),
               ("generation tok/s at 64 (1K prompts, 128 tokens)", ("decode64", "tok_s"), "thr"),
               ("TPOT ms at 64", ("decode64", "tpot_ms"), "time"),
               ("generation tok/s at 256", ("decode256", "tok_s"), "thr"),
               ("TPOT ms at 256", ("decode256", "tpot_ms"), "time"),
               ("RL wave tok/s (64 prompts x 8, 512 + 256 tokens)", ("rl", "tok_s"), "thr"),
               ("RL wave wall s", ("rl", "wall_s"), "time"),
               ("RL wave prompt tokens from the prefix cache %", ("rl", "prefix_hit_pct"), "none"),
               ("attention block tokens (the prefix cache's grain)", ("block_tokens",), "none"),
               ("KV cache tokens", ("kv_tokens",), "thr"),
               ("max concurrency at max-model-len", ("max_concurrency",), "thr"),
               ("KV cache memory GiB", ("kv_mem_gib",), "none"),
               ("peak device memory MiB", ("peak_mem_mib",), "none"),
               ("server start s", ("startup_s",), "none")]
    by = {r["side"]: r for r in rows}
    others = [r["side"] for r in rows if r["side"] != "stock"] or ["vllm_bi"]
    head = ["metric", "stock"]
    for side in others:
        head += [side, f"{side} cost" if len(others) > 1 else "vllm_bi cost"]
    out = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for label, path, kind in metrics:
        a = get(by.get("stock", {}), *path)
        cells = [label, cell(a)]
        for side in others:
            b = get(by.get(side, {}), *path)
            ratio = ""
            if a and b and kind == "thr":
                ratio = f"{a / b:.2f}x slower" if "tok/s" in label else f"{b / a:.2f}x of stock"
            elif a and b and kind == "time":
                ratio = f"{b / a:.2f}x"
            cells += [cell(b), ratio]
        out.append("| " + " | ".join(cells) + " |")
    for r in rows:
        out.append(f"\n{r['side']}: {r.get('arithmetic', '')}")
    return out


# part -> kernel-name pattern (first match wins; checked in order, the rest is "other")
PARTS = [
    ("attention", r"flash|fmha|attn|attention|paged|reshape_and_cache|unified"),
    ("GDN", r"chunk|recurrent|gated_delta|gdn|conv1d|causal_conv|kkt|solve_tril|wy_|fwd_h|fwd_o|l2norm|cumsum|"
            r"delta|_conv_|step_in_slots|merge_16x16|recompute_w_u"),
    ("GEMM", r"gemm|cutlass|nvjet|xmma|matmul|cublas|sm90_|_mm_"),
    ("sampling + logprobs", r"softmax|argmax|gumbel|sort|topk|top_k|sampl|logprob|vectorized_gather|exponential|"
                            r"penalt"),
    ("norms + pointwise", r"norm|elementwise|copy|row_sum|triton_poi|triton_red|triton_per|silu|act_and_mul|rotary|"
                          r"CatArray"),
]


def part_of(kernel: str) -> str:
    for name, pat in PARTS:
        if re.search(pat, kernel, re.IGNORECASE):
            return name
    return "other"


def _trace_summary(trace_dir: str, since: float) -> tuple[dict[str, float], dict[str, float]]:
    """``(kernels, sites)`` over the worker traces written in ``trace_dir`` after ``since``: kernel name -> total
    milliseconds, and ``"part | site"`` -> total milliseconds, a kernel's site being where Python launched it
    (:func:`_kernel_sites`; empty without the profiler's Python stacks)."""
    import glob
    import gzip

    totals: dict[str, float] = {}
    sites: dict[str, float] = {}
    for path in glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True):
        if os.path.getmtime(path) < since or "async_llm" in os.path.basename(path):
            continue
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        events = doc.get("traceEvents", [])
        for ev in events:
            if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
                totals[ev["name"]] = totals.get(ev["name"], 0.0) + ev["dur"] / 1000.0
        for key, ms in _kernel_sites(events).items():
            sites[key] = sites.get(key, 0.0) + ms
    return totals, sites


def _frame(name: str) -> str | None:
    """A profiler Python frame (``/path/vllm_bi/ops/layout.py(39): canonical_rows``) as ``ops/layout.py:canonical_rows``
    when it is vllm_bi's, else None."""
    if "vllm_bi/" not in name or "): " not in name:
        return None
    path, func = name.rsplit("): ", 1)
    return f"{path.rsplit('vllm_bi/', 1)[1].split('(')[0]}:{func}"


def _kernel_sites(events: list[dict]) -> dict[str, float]:
    """``"part | site"`` -> milliseconds of the kernels (and device copies) in one trace, a kernel's site being the two
    innermost vllm_bi frames around the host call that launched it (``innermost < its caller``), or ``vLLM`` when no
    vllm_bi frame encloses it. Kernels reach their launch through the trace's correlation ids; the Python frames are
    the profiler's ``python_function`` events (``torch_profiler_with_stack``), nested per thread. A kernel replayed
    from a CUDA graph carries the replay's launch, so decode steps in graphs are vLLM's."""
    launch: dict = {}
    frames: dict = {}
    kernels: list = []
    for ev in events:
        cat = ev.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in ev.get("args", {}):
            launch[ev["args"]["correlation"]] = (ev.get("tid"), ev["ts"])
        elif cat == "python_function" and "dur" in ev:
            frames.setdefault(ev.get("tid"), []).append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            kernels.append(ev)
    if not frames:
        return {}
    # each launch's enclosing frames: per thread, frames by start (outer first) against launches by time
    wanted: dict = {}
    for ev in kernels:
        at = launch.get(ev.get("args", {}).get("correlation"))
        if at is not None:
            wanted.setdefault(at[0], []).append((at[1], ev))
    out: dict[str, float] = {}
    for tid, items in wanted.items():
        fs = sorted(frames.get(tid, []), key=lambda f: (f[0], -f[1]))
        stack: list = []
        i = 0
        for ts, ev in sorted(items, key=lambda x: x[0]):
            while i < len(fs) and fs[i][0] <= ts:
                while stack and stack[-1][1] < fs[i][0]:
                    stack.pop()
                stack.append(fs[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            ours = [f for f in (_frame(s[2]) for s in reversed(stack)) if f][:2]
            key = f"{part_of(ev['name'])} | {' < '.join(ours) if ours else 'vLLM'}"
            out[key] = out.get(key, 0.0) + ev["dur"] / 1000.0
    return out


def profile_side(side: str, model: str, server_args: str, vocab: int, log_dir: str) -> dict:
    from vllm_bi.launcher import VllmServer

    bi = parse_side(side)[0]
    env = side_env(side)
    trace_dir = os.path.join(log_dir, f"trace-{_file_label(side)}")
    os.makedirs(trace_dir, exist_ok=True)
    cfg = json.dumps({"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_with_stack": True,
                      "ignore_frontend": True,
                      "torch_profiler_dump_cuda_time_total": False})
    args = shlex.split(server_args) + shlex.split(DEVIATIONS) + ["--profiler-config", cfg]
    r: dict = {"side": side}
    with VllmServer(model, batch_invariant=bi, args=args, env=env, startup_timeout=480,
                    log_path=os.path.join(log_dir, f"server-profile-{_file_label(side)}.log")) as srv:
        rng = random.Random(40)
        for mt in (1, 65):  # warm-up: the same shapes, unprofiled
            srv.complete_many([dict(prompt_ids=p, max_tokens=mt, ignore_eos=True) for p in _prompts(64, 1024, vocab, rng)],
                              )
        for label, mt in (("prefill", 1), ("prefill+decode", 65)):
            reqs = [dict(prompt_ids=p, max_tokens=mt, ignore_eos=True) for p in _prompts(64, 1024, vocab, rng)]
            since = time.time()
            srv._post("/start_profile", {})
            t0 = time.perf_counter()
            srv.complete_many(reqs)
            wall = time.perf_counter() - t0
            srv._post("/stop_profile", {}, timeout=900)
            time.sleep(2)
            kernels, sites = _trace_summary(trace_dir, since)
            r[label] = {"wall_s": wall, "kernels": kernels, "sites": sites}
            print(f"[full-scale] {side}: profiled {label}: {sum(kernels.values()):.1f} ms of kernels in {wall:.2f} s",
                  flush=True)
    return r


def profile_table(rows: list[dict]) -> list[str]:
    """Per part: kernel ms of the prefill load, of the 64 decode steps (difference of the two loads), both sides."""
    def parts(r, label):
        out: dict[str, float] = {}
        for k, ms in r[label]["kernels"].items():
            out[part_of(k)] = out.get(part_of(k), 0.0) + ms
        return out

    ok = [r for r in rows if "prefill" in r and "prefill+decode" in r]
    if not ok:
        return ["no profile"]
    names = [n for n, _ in PARTS] + ["other"]
    out = ["| part | " + " | ".join(f"{r['side']} prefill ms" for r in ok) + " | ratio | "
           + " | ".join(f"{r['side']} decode ms" for r in ok) + " | ratio |",
           "| --- |" + " ---: |" * (2 * len(ok) + 2)]
    pre = [parts(r, "prefill") for r in ok]
    dec = []
    for r, p in zip(ok, pre):
        both = parts(r, "prefill+decode")
        dec.append({n: both.get(n, 0.0) - p.get(n, 0.0) for n in names})

    def ratio(vals):
        return f"{vals[-1] / vals[0]:.2f}x" if len(vals) == 2 and vals[0] > 0 else ""

    for n in names + ["total"]:
        pv = [sum(p.values()) if n == "total" else p.get(n, 0.0) for p in pre]
        dv = [sum(d.values()) if n == "total" else d.get(n, 0.0) for d in dec]
        out.append(f"| {n} | " + " | ".join(f"{v:.1f}" for v in pv) + f" | {ratio(pv)} | "
                   + " | ".join(f"{v:.1f}" for v in dv) + f" | {ratio(dv)} |")
    for r in ok:
        top = sorted(r["prefill+decode"]["kernels"].items(), key=lambda kv: -kv[1])[:25]
        out += ["", f"{r['side']}: top kernels of the prefill+decode load (ms, part)", ""]
        out += [f"- {ms:.1f} {part_of(k)}: `{k[:120]}`" for k, ms in top]
        sites = r["prefill+decode"].get("sites") or {}
        small = sorted(((k, ms) for k, ms in sites.items() if k.startswith(("norms + pointwise", "other"))),
                       key=lambda kv: -kv[1])[:20]
        if small:
            out += ["", f"{r['side']}: where its norms + pointwise and other kernels were launched, prefill+decode load "
                        "(ms; the two innermost vllm_bi frames, or vLLM)", ""]
            out += [f"- {ms:.1f} {k}" for k, ms in small]
    return out


def parity_part(model: str, out_dir: str, extra_server_args: str = "", settings: dict | None = None,
                log_name: str = "parity.log") -> dict:
    """``vllm-bi parity`` under the defaults: 16 prompts x 4 samples x 128 tokens (``extra_server_args``: more
    ``vllm serve`` arguments, e.g. a speculative config; ``settings``: ``VLLM_BI_*`` variables for the server and
    the trainer, none by default; its output goes to ``out_dir/log_name``)."""
    rng = random.Random(7)
    words = ("the of and a to in is you that it he was for on are as with his they at be this have from or one had "
             "by word but not what all were we when your can said there use an each which she do how their if will "
             "up other about out many then them these so some her would make like him into time has look two more").split()
    path = os.path.join(out_dir, "parity-prompts.jsonl")
    with open(path, "w") as f:
        for i in range(16):
            n = [5, 40, 200, 600][i % 4] + rng.randrange(20)
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BI_")}
    env.update(settings or {})
    argv = [sys.executable, "-m", "vllm_bi.cli", "parity", "--model", model, "--prompts", path, "--n", "4",
            "--max-tokens", "128", "--json", "--trainer-device", "cuda", "--server-args",
            f"--gpu-memory-utilization 0.45 --max-model-len 2048 {DEVIATIONS} {extra_server_args}".strip()]
    t0 = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=540)
    with open(os.path.join(out_dir, log_name), "w") as f:
        f.write(p.stdout + "\n---- stderr\n" + p.stderr)
    try:
        rep = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rep = {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    rep["exit"], rep["seconds"] = p.returncode, round(time.time() - t0)
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a full-size checkpoint (vllm-bi make-checkpoint)")
    ap.add_argument("--part", default="serve", choices=["serve", "parity", "profile", "all"])
    ap.add_argument("--sides", default="stock,vllm_bi",
                    help="comma-separated: stock, vllm_bi (the defaults), vllm_bi:VLLM_BI_X=VALUE[:...] (the defaults "
                         "but those settings)")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of wall time per measured phase")
    ap.add_argument("--server-args", default=SERVER_ARGS, help="`vllm serve` arguments for both sides")
    ap.add_argument("--out", default="full_scale.md", help="the table (rewritten as rows come)")
    ap.add_argument("--from-json", default=None, help="print the tables of an earlier run's JSON (its measured "
                    "numbers, grouped by the current PARTS) and exit")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        print("\n".join((serve_table(doc["serve"]) if doc.get("serve") else [])
                        + (profile_table(doc["profile"]) if doc.get("profile") else [])))
        return 0
    if not args.model:
        ap.error("--model DIR is needed (a full-size checkpoint: vllm-bi make-checkpoint qwen3.5-9b DIR)")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        ap.error(f"{args.model}: no config.json; write one with `vllm-bi make-checkpoint qwen3.5-9b {args.model}`")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for side in sides:
        try:
            parse_side(side)
        except ValueError as e:
            ap.error(f"--sides: {e}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model).get_text_config()
    head = [f"# stock vLLM vs vllm_bi defaults, {args.model} ({cfg.num_hidden_layers} layers, hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size:,})", "", "command: " + shlex.join([sys.executable, *sys.argv]),
            "", f"both sides: `vllm serve {args.server_args} {DEVIATIONS}`; VLLM_USE_FLASHINFER_SAMPLER="
            f"{os.environ.get('VLLM_USE_FLASHINFER_SAMPLER', '(unset)')}; window {args.window:.0f} s per phase", ""]
    rows: list[dict] = []
    profiles: list[dict] = []
    parity: dict[str, dict] = {}  # per vllm_bi side

    def write():
        text = head + (serve_table(rows) if rows else [])
        if profiles:
            text += ["", "## GPU time by part (kernel ms from vLLM's torch profiler; decode = 64 steps at batch 64)",
                     ""] + profile_table(profiles)
        for side, rep in parity.items():
            text += ["", f"## trainer parity at full size (`vllm-bi parity`, side {side}, 16 prompts x 4 x 128 tokens)",
                     "", "```", json.dumps(rep, indent=1), "```"]
        with open(args.out, "w") as f:
            f.write("\n".join(text) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"serve": rows, "profile": profiles, "parity": parity or None}, f, indent=1)

    if args.part in ("serve", "all"):
        for side in sides:
            try:
                rows.append(serve_side(side, args.model, args.server_args, args.window, cfg.vocab_size, out_dir))
            except Exception as e:  # noqa: BLE001 - recorded, the next side still runs
                rows.append({"side": side, "error": str(e).splitlines()[0][:300]})
                print(f"[full-scale] {side} failed: {e}", flush=True)
            write()
    if args.part == "profile":
        for side in sides:
            try:
                profiles.append(profile_side(side, args.model, args.server_args, cfg.vocab_size, out_dir))
            except Exception as e:  # noqa: BLE001 - recorded, the next side still runs
                profiles.append({"side": side, "error": str(e).splitlines()[0][:300]})
                print(f"[full-scale] {side} profile failed: {e}", flush=True)
            write()
    if args.part in ("parity", "all"):
        for side in [s for s in sides if parse_side(s)[0]] or ["vllm_bi"]:
            rep = parity_part(args.model, out_dir, settings=parse_side(side)[1],
                              log_name=f"parity-{_file_label(side)}.log")
            parity[side] = rep
            print(f"[full-scale] parity {side}: {rep.get('bitwise_equal')}/{rep.get('tokens')} equal, exit "
                  f"{rep['exit']}", flush=True)
            write()
    print("\n".join(open(args.out).read().splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
