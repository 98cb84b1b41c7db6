"""Benchmark: end-to-end generator throughput through a real ``vllm serve`` (OpenAI HTTP), batch-invariant vs
stock, on a random-weight GDN hybrid (default: Qwen3.5-9B layer dimensions, 4 layers, built locally).

    python benchmarks/generate_throughput.py [--modes stock,stock-eager,recurrent,chunk,chunk-triton]
        [--requests 64] [--prompt-len 256] [--max-tokens 128] [--layers N] [--out results.md]

For each mode one server is started, warmed up with both phases' shapes (unmeasured), then measured in two
phases, each with ``--requests`` concurrent requests of distinct random prompts (so no prefix is shared):

* prefill: ``max_tokens=1`` -> prompt tokens per second of wall time;
* generate: ``max_tokens=--max-tokens`` (EOS ignored) -> generated tokens per second of wall time
  (the prompts' prefill included, as a user sees it).

Modes: ``stock`` (VLLM_BATCH_INVARIANT=0, CUDA graphs as vLLM defaults), ``stock-eager`` (the same with
``--enforce-eager``: BI mode runs eagerly, so this separates the CUDA-graph share of the gap),
``recurrent`` / ``chunk`` (VLLM_BATCH_INVARIANT=1 with the plugin and that ``VLLM_BI_GDN_MODE``) and
``recurrent-triton`` / ``chunk-triton`` (the same with ``VLLM_BI_GEMM=triton``). Every other ``VLLM_BI_*`` setting
(``VLLM_BI_GEMM``, ``VLLM_BI_GEMM_CONFIGS``, ``VLLM_BI_ATTENTION``, ``VLLM_BI_MOE``, ``VLLM_BI_CUDA_GRAPHS``) passes
from the environment to the BI modes, and the table's header names each; a mode that would contradict the
environment (``VLLM_BI_GEMM=fp64`` set with ``--modes chunk-triton``) is refused before any server starts. Each
phase is measured ``--repeats`` times on the same server and the median is reported (stock's throughput varied
by up to 1.5x between servers on the H200, ``docs/results/2026-11-30-h200-gemm-tiles-and-fsdp2-9b.md``). The default model has
4 layers, where a step's host work weighs more than its kernels; ``--layers`` builds a deeper one (32 is
Qwen3.5-9B's depth: ~7 B parameters, 14 GB) to weigh the per-layer kernels as a real checkpoint would. Ratios are
stock / mode throughput (how many times slower than stock). Rows are written as they come (``--out``), so a cut
run keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time

MODES = {  # name -> (batch invariant, extra environment, extra server args)
    "stock": (False, {}, []),
    "stock-eager": (False, {}, ["--enforce-eager"]),
    "recurrent": (True, {"VLLM_BI_GDN_MODE": "recurrent"}, []),
    "chunk": (True, {"VLLM_BI_GDN_MODE": "chunk"}, []),
    "recurrent-triton": (True, {"VLLM_BI_GDN_MODE": "recurrent", "VLLM_BI_GEMM": "triton"}, []),
    "chunk-triton": (True, {"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_GEMM": "triton"}, []),
}
SETTINGS = ("VLLM_BI_GEMM", "VLLM_BI_GEMM_CONFIGS", "VLLM_BI_ATTENTION", "VLLM_BI_MOE", "VLLM_BI_CUDA_GRAPHS")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def model_runner(environ) -> str:
    """Which vLLM model runner a row's server used: ``VLLM_USE_V2_MODEL_RUNNER`` or vLLM's own choice (V2 on CUDA,
    V1 on CPU). Rows on different runners are not like for like
    (``docs/results/2026-11-30-h200-triton-gemm-e2e-and-hybrid.md``)."""
    value = (environ.get("VLLM_USE_V2_MODEL_RUNNER") or "").strip().lower()
    return {"1": "V2", "true": "V2", "0": "V1", "false": "V1"}.get(value, "vLLM's choice (V2 on CUDA)")


def conflicts(modes: list[str], environ) -> list[str]:
    """Settings a BI mode would set against the environment's own value (say ``VLLM_BI_GEMM=fp64`` in the
    environment and ``--modes chunk-triton``): the run would time something else than what was asked."""
    bad = []
    for mode in modes:
        bi, extra_env, _ = MODES[mode]
        for k, v in extra_env.items():
            if bi and environ.get(k, "").strip() not in ("", v):
                bad.append(f"mode {mode} sets {k}={v} but the environment has {k}={environ[k]}")
    return bad


def measure(srv, n: int, prompt_len: int, max_tokens: int, vocab: int, repeats: int = 1) -> dict:
    """Prefill and generate phases on a started server; token counts are the server's own. Each phase runs
    once unmeasured first (other prompts, same shapes), so that kernels compiled or tuned for the batch sizes
    it meets (Triton specialises on them) are ready before the clock starts; then ``repeats`` times, each
    with other prompts, and the median wall time counts."""
    out = {}
    plan = [("warm-up", 1, 10), ("warm-up", max_tokens, 11)]
    plan += [("prefill", 1, 100 + r) for r in range(repeats)] + [("generate", max_tokens, 200 + r) for r in range(repeats)]
    walls: dict[str, list[float]] = {}
    for phase, m, seed in plan:
        reqs = [dict(prompt_ids=p, max_tokens=m) for p in _prompts(n, prompt_len, vocab, seed)]
        t0 = time.perf_counter()
        done = srv.complete_many(reqs)
        wall = time.perf_counter() - t0
        gen = sum(len(c.token_ids) for c in done)
        if gen != n * m:
            raise RuntimeError(f"{phase}: the server returned {gen} tokens, expected {n * m}")
        if phase == "warm-up":
            continue
        walls.setdefault(phase, []).append(wall)
        wall = statistics.median(walls[phase])
        out[phase] = {"wall_s": wall, "tokens": n * prompt_len if phase == "prefill" else gen,
                      "walls": list(walls[phase])}
        out[phase]["tok_s"] = out[phase]["tokens"] / wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/vllm_bi_models/qwen3.5-9b",
                    help="model directory; built (random weights) when missing")
    ap.add_argument("--family", default="qwen3.5", help="model family when the model is built")
    ap.add_argument("--spec", default="9b-dims", help="tiny_models spec when the model is built")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the built model (every 4th is attention; default: the spec's, 4); the default "
                    "--model path gets a -<N>l suffix")
    ap.add_argument("--modes", default="stock,stock-eager,recurrent,chunk,chunk-triton",
                    help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests per phase")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="measured runs of each phase per server (median)")
    ap.add_argument("--server-args", default="--gpu-memory-utilization 0.3",
                    help="extra `vllm serve` arguments for every mode")
    ap.add_argument("--stock-args", default="", help="extra `vllm serve` arguments for the stock modes only "
                    "(on the offline H200 bundle: --gdn-prefill-backend triton)")
    ap.add_argument("--out", default=None, help="also write the table here (rewritten after each mode)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    clash = conflicts(modes, os.environ)
    if clash:
        ap.error("; ".join(clash) + ": unset the variable or choose the mode that matches it")

    import shlex

    import torch

    from vllm_bi.launcher import VllmServer, cpu_env
    from vllm_bi.settings import Settings
    from vllm_bi.tiny_models import SPECS, build_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"

    spec = SPECS[args.spec]
    if args.layers is not None:
        if args.layers < 1:
            ap.error("--layers must be at least 1")
        spec = dataclasses.replace(spec, num_hidden_layers=args.layers)
        if args.model == ap.get_default("model"):
            args.model = f"{args.model}-{args.layers}l"
    if not os.path.exists(os.path.join(args.model, "config.json")):
        print(f"[bench] building {args.family} ({args.spec}, {spec.num_hidden_layers} layers) at {args.model}",
              flush=True)
        build_tiny_model(args.family, args.model, seed=0, spec=spec)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    max_len = args.prompt_len + args.max_tokens + 16
    head = [f"# end-to-end generation through `vllm serve`: {args.requests} concurrent requests, "
            f"{args.prompt_len}-token prompts, {args.max_tokens} generated tokens, median of {args.repeats} "
            f"runs per phase; model {args.model}",
            "", "command: " + shlex.join([sys.executable, *sys.argv]),
            "", "BI modes' settings from the environment (the mode's own columns below override none of them): "
            + ", ".join(f"{k}={os.environ.get(k) or '(unset)'}" for k in SETTINGS), "",
            "| mode | GDN mode | GEMM | prefill tok/s | x slower than stock | generate tok/s | x slower than stock | "
            "prefill wall s (runs) | generate wall s (runs) | model runner |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    rows: list[str] = []
    ref = None

    def write():
        text = "\n".join(head + rows) + "\n"
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)

    for mode in modes:
        bi, extra_env, extra_args = MODES[mode]
        server_args = ["--max-model-len", str(max_len), "--max-num-seqs", str(max(args.requests, 1)),
                       *shlex.split(args.server_args), *extra_args]
        if not bi:
            server_args += shlex.split(args.stock_args)
        env = cpu_env(bi, extra_env)
        gdn = (env.get("VLLM_BI_GDN_MODE") or "recurrent") if bi else "stock"
        gemm = Settings.from_env(env).gemm_on(device) if bi else "cuBLAS"  # what the server resolves it to
        runner = model_runner(env)
        t0 = time.time()
        print(f"[bench] {mode}: starting vllm serve {' '.join(server_args)}", flush=True)
        try:
            with VllmServer(args.model, batch_invariant=bi, args=server_args,
                            env=env, startup_timeout=600) as srv:
                print(f"[bench] {mode}: up in {time.time() - t0:.0f} s", flush=True)
                r = measure(srv, args.requests, args.prompt_len, args.max_tokens, vocab, args.repeats)
        except Exception as e:  # noqa: BLE001 - recorded in the table, the next mode still runs
            rows.append(f"| {mode} | {gdn} | {gemm} | error: {str(e).splitlines()[0][:120]} | | | | | | {runner} |")
            print(f"[bench] {mode} failed: {e}", flush=True)
            write()
            continue
        if mode == "stock":
            ref = r
        pre, gen = r["prefill"], r["generate"]
        slow_p = f"{ref['prefill']['tok_s'] / pre['tok_s']:.2f}" if ref else "n/a"
        slow_g = f"{ref['generate']['tok_s'] / gen['tok_s']:.2f}" if ref else "n/a"
        runs = {k: " ".join(f"{w:.2f}" for w in r[k]["walls"]) for k in ("prefill", "generate")}
        rows.append(f"| {mode} | {gdn} | {gemm} | {pre['tok_s']:.0f} | {slow_p} | {gen['tok_s']:.0f} | {slow_g} | "
                    f"{pre['wall_s']:.2f} ({runs['prefill']}) | {gen['wall_s']:.2f} ({runs['generate']}) | {runner} |")
        print(rows[-1], flush=True)
        write()
    print("\n".join(head + rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
