#!/usr/bin/env python3
"""Serving parity on a CUDA machine with the real `vllm serve` (vLLM 0.32 GPU build), exact equality only.

For each model family (tiny random-weight models built here by ``build_tiny_model``) and each mode
(``bi``: VLLM_BATCH_INVARIANT=1 with the vllm_bi plugin; ``stock``: VLLM_BATCH_INVARIANT=0, the
negative control), two servers are started, both ``--enforce-eager --no-enable-prefix-caching``:
``big`` (--max-num-batched-tokens 2048) and ``small`` (--max-num-batched-tokens 32, so a long
prompt is prefilled in many chunks). Greedy requests, ``logprobs=0``, ``ignore_eos``:

* P1  a request alone vs. the same request sent concurrently with 1-15 random other requests
      (random lengths and max_tokens, random position), on ``big``; short and long prompts.
* P2  a long prompt on ``small`` (chunked prefill), alone and in a busy batch, vs. alone on ``big``.
* P3  each generated token's decode logprob vs. its ``prompt_logprobs`` entry when prompt+generation
      is sent back as a prompt (``big``).

Equality is ``==`` on token ids and on the float logprobs the server returns (JSON floats are
exact). Writes ``results.json`` and ``results.md`` to --out.

    python3 scripts/gpu_serve_parity.py --family qwen3.5 --modes bi,stock --out /tmp/parity
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tarfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_bi.launcher import VllmServer  # noqa: E402
from vllm_bi.tiny_models import SPECS, build_tiny_model, corpus  # noqa: E402


def gpu_env(mode: str) -> dict:
    env = dict(os.environ)
    env["VLLM_BATCH_INVARIANT"] = "1" if mode == "bi" else "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def compare(a, b) -> dict:
    """Exact comparison of two completions (tokens and logprobs)."""
    n = min(len(a.token_ids), len(b.token_ids))
    first_tok = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), None)
    upto = n if first_tok is None else first_tok + 1  # logprob of the first differing position still compares
    lp_eq = sum(a.logprobs[i] == b.logprobs[i] for i in range(upto))
    diffs = [abs(a.logprobs[i] - b.logprobs[i]) for i in range(upto)]
    return {
        "equal": a.token_ids == b.token_ids and a.logprobs == b.logprobs,
        "tokens_equal": a.token_ids == b.token_ids,
        "first_token_divergence": first_tok,
        "logprobs_equal": lp_eq,
        "logprobs_compared": upto,
        "max_abs_diff": max(diffs) if diffs else 0.0,
        "differing_positions": [i for i in range(upto) if a.logprobs[i] != b.logprobs[i]][:8],
    }


def p3_compare(srv: VllmServer, c) -> dict:
    full = list(c.prompt_ids) + list(c.token_ids)
    r = srv.complete(full, max_tokens=1, prompt_logprobs=True)
    plp = r.prompt_logprobs
    P = len(c.prompt_ids)
    pairs = [(c.logprobs[i], plp[P + i]) for i in range(len(c.token_ids))]
    eq = sum(x == y for x, y in pairs)
    return {"equal": eq == len(pairs), "logprobs_equal": eq, "logprobs_compared": len(pairs),
            "differing_positions": [i for i, (x, y) in enumerate(pairs) if x != y][:8],
            "max_abs_diff": max(abs(x - y) for x, y in pairs)}


def text_of(rng: random.Random, lines: list[str], n_lines: int) -> str:
    return " ".join(rng.choice(lines) for _ in range(n_lines))


def busy(srv: VllmServer, target: dict, rng: random.Random, lines: list[str]):
    n_other = rng.randint(1, 15)
    others = [dict(prompt_ids=text_of(rng, lines, rng.randint(1, 60)), max_tokens=rng.randint(4, 64))
              for _ in range(n_other)]
    pos = rng.randint(0, n_other)
    reqs = others[:pos] + [target] + others[pos:]
    return srv.complete_many(reqs)[pos], n_other


def run_mode(model: str, mode: str, args, lines, out: dict, logdir: str) -> None:
    rng = random.Random(args.seed)
    short = dict(prompt_ids=text_of(rng, lines, 3), max_tokens=args.max_tokens)
    long = dict(prompt_ids=text_of(rng, lines, args.long_lines), max_tokens=args.max_tokens)
    common = ["--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "16",
              "--gdn-prefill-backend", "triton", "--gpu-memory-utilization", str(args.gpu_mem)]
    res = {}
    name = f"{os.path.basename(model)}-{mode}"
    t0 = time.time()
    with VllmServer(model, args=common + ["--max-num-batched-tokens", "2048"], env=gpu_env(mode),
                    startup_timeout=900, log_path=os.path.join(logdir, f"{name}-big.log")) as srv:
        res["startup_big_s"] = round(time.time() - t0, 1)
        a_short = srv.complete(**short)
        a_long = srv.complete(**long)
        res["long_prompt_tokens"] = len(a_long.prompt_ids)
        p1 = []
        for t in range(args.trials):
            for label, req, ref in (("short", short, a_short), ("long", long, a_long)):
                got, n_other = busy(srv, req, rng, lines)
                p1.append({"trial": t, "prompt": label, "others": n_other, **compare(ref, got)})
        res["P1"] = p1
        res["P3"] = [{"prompt": "short", **p3_compare(srv, a_short)}, {"prompt": "long", **p3_compare(srv, a_long)}]
    t0 = time.time()
    with VllmServer(model, args=common + ["--max-num-batched-tokens", "32"], env=gpu_env(mode),
                    startup_timeout=900, log_path=os.path.join(logdir, f"{name}-small.log")) as srv:
        res["startup_small_s"] = round(time.time() - t0, 1)
        p2 = [{"case": "alone", **compare(a_long, srv.complete(**long))}]
        for t in range(args.trials):
            got, n_other = busy(srv, long, rng, lines)
            p2.append({"case": f"busy (+{n_other})", **compare(a_long, got)})
        res["P2"] = p2
    for size in ("big", "small"):
        with open(os.path.join(logdir, f"{name}-{size}.log"), errors="replace") as f:
            res[f"plugin_log_{size}"] = [ln.strip()[-220:] for ln in f if "vllm_bi:" in ln or "attention backend" in ln
                                         or "GDN" in ln][:12]
    out[name] = res


def verdict(rows) -> str:
    ok = sum(r["equal"] for r in rows)
    return f"{ok}/{len(rows)}"


def markdown(results: dict) -> str:
    lines = ["| model-mode | P1 equal | P2 equal | P3 equal | worst max abs diff |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} | | | |")
            continue
        worst = max(x["max_abs_diff"] for k in ("P1", "P2", "P3") for x in r[k])
        lines.append(f"| {name} | {verdict(r['P1'])} | {verdict(r['P2'])} | {verdict(r['P3'])} | {worst:.3g} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", action="append", default=None)
    ap.add_argument("--modes", default="bi,stock")
    ap.add_argument("--spec", default="default", choices=sorted(SPECS))
    ap.add_argument("--out", default="/tmp/vllm_bi_parity")
    ap.add_argument("--models", default="/tmp/vllm_bi_models")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--long-lines", type=int, default=40)
    ap.add_argument("--gpu-mem", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logdir = os.path.join("/tmp", "vllm_bi_parity_logs")
    os.makedirs(logdir, exist_ok=True)
    lines = corpus(2000, seed=1)
    results: dict = {}
    for family in args.family or ["qwen3.5"]:
        path = build_tiny_model(family, os.path.join(args.models, f"{family}-{args.spec}"), seed=0, spec=SPECS[args.spec])
        for mode in args.modes.split(","):
            try:
                run_mode(path, mode, args, lines, results, logdir)
            except Exception as e:  # record and go on to the next configuration
                results[f"{os.path.basename(path)}-{mode}"] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            print(json.dumps({k: v for k, v in results.items()}, indent=1)[-4000:], flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    md = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with tarfile.open(os.path.join(args.out, "server_logs.tar.gz"), "w:gz") as tf:
        tf.add(logdir, arcname="server_logs")
    print(md)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
