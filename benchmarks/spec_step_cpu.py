"""Benchmark: a CPU server's time per engine step with and without the MTP drafter (tiny Qwen3.5 with one MTP layer).

    python benchmarks/spec_step_cpu.py [--clients 1,4] [--tokens 48] [--k 3] [--out DIR]

Builds (or reuses under ``--out``) the tiny Qwen3.5 and its MTP copy (``tiny_models.add_mtp_layer``: LM head narrowed
to two tokens so that drafts are kept), then serves it with ``VLLM_BATCH_INVARIANT=1`` without drafts and with
``--speculative-config {"method": "mtp", "num_speculative_tokens": K}``. For each client count: greedy requests of
``--tokens`` tokens sent at once; reports wall ms per generated token per request (TPOT-like), and for the drafter
side the tokens a verify step emitted (1 + accepted / verify steps, the server's counters) and so ms per step.
CPU only: the V1 model runner and the float64 GEMM; the per-step numbers cover vllm_bi's GDN glue and op library,
not Model Runner V2.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default="/tmp/vllm_bi_spec_step")
    ap.add_argument("--sides", default="plain,mtp")
    args = ap.parse_args()

    from vllm_bi.launcher import VllmServer, cpu_env
    from vllm_bi.tiny_models import add_mtp_layer, build_tiny_model

    base = build_tiny_model("qwen3.5", os.path.join(args.out, "qwen3.5-s0"), seed=0)
    mtp = os.path.join(args.out, "qwen3.5-mtp")
    if not os.path.exists(os.path.join(mtp, "model.safetensors")):
        add_mtp_layer(base, mtp)
    clients = [int(c) for c in args.clients.split(",")]
    common = ["--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--no-enable-prefix-caching"]
    spec = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": args.k})]
    prompts = [list(range(10 + i, 10 + i + 32)) for i in range(max(clients))]
    print(f"tiny qwen3.5 + MTP, CPU, {args.tokens} greedy tokens per request, k = {args.k}")
    print("| side | clients | wall s | ms per token per request | tokens per verify step | ms per step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for side in args.sides.split(","):
        extra = spec if side == "mtp" else []
        with VllmServer(mtp, env=cpu_env(True), args=common + extra,
                        log_path=os.path.join(args.out, f"server-{side}.log")) as srv:
            srv.complete_many([dict(prompt_ids=p, max_tokens=8) for p in prompts])  # warm-up
            for c in clients:
                d0 = (srv.metric_sum("vllm:spec_decode_num_accepted_tokens_total"),
                      srv.metric_sum("vllm:spec_decode_num_drafts_total"))
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as ex:
                    outs = list(ex.map(lambda p: srv.complete(p, max_tokens=args.tokens), prompts[:c]))
                wall = time.perf_counter() - t0
                n = min(len(o.token_ids) for o in outs)
                acc = srv.metric_sum("vllm:spec_decode_num_accepted_tokens_total") - d0[0]
                steps = srv.metric_sum("vllm:spec_decode_num_drafts_total") - d0[1]
                per_step = (1 + acc / steps) if steps else 1.0
                ms_tok = wall * 1e3 / n
                print(f"| {side} | {c} | {wall:.2f} | {ms_tok:.1f} | {per_step:.2f} | "
                      f"{ms_tok * per_step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
