"""Tune the Triton GEMM mode's tiles (``VLLM_BI_GEMM=triton``) per weight shape and batch-size bucket, check that
a row's bits do not depend on the bucket, and write a table for ``VLLM_BI_GEMM_CONFIGS`` (``ops/gemm_configs.py``).

    python benchmarks/bi_gemm_tune.py [--out-json tiles.json] [--out tiles.md] [--shapes 12288x4096,...]
                                      [--buckets 1,16,256,...] [--block-k 64,128] [--reps 5]

For each weight shape ``(N, K)`` (default: Qwen3.5-9B's linear layers as vLLM merges them) the library's tuner
(``vllm_bi.ops.gemm_tune``: the algorithm a server runs under ``VLLM_BI_GEMM_CONFIGS=tune``) times vLLM 0.32's
batch-invariant persistent matmul with candidate tiles per bucket of ``M`` and ``BLOCK_K``, keeps one ``BLOCK_K``
per ``K`` and the fastest tiles per bucket whose rows equal the largest batch's. This script adds the report: cuBLAS
bf16, vLLM's default tiles, the tuned tiles, ms and ratios (median of ``--reps`` CUDA-event timings after warm-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from vllm_bi.ops import gemm_tune as T
from vllm_bi.settings import DEFAULT_GEMM_TABLE

SHAPES_9B = [  # (what, N, K): Qwen3.5-9B's linear layers as vLLM merges them
    ("attention qkv (q with its gate)", 10240, 4096),
    ("attention o, GDN out", 4096, 4096),
    ("GDN in_proj_qkvz", 12288, 4096),
    ("GDN in_proj_ba", 64, 4096),
    ("MLP gate_up", 24576, 4096),
    ("MLP down", 4096, 12288),
    ("lm_head", 248320, 4096),
]


def time_table(table: str, timings: dict, bench) -> dict:
    """``{(n, k, m): ms}`` of the Triton GEMM as a server runs it (``ops.linear``'s persistent product, which
    installs ``VLLM_BI_GEMM_CONFIGS``'s table and gives a shape it lacks the reference tiles of its ``K``) with
    ``table``, for every shape and bucket of ``timings``, on the tuner's own tensors (``bench``). Call it after the
    tuner has put vLLM's own table back."""
    from vllm_bi.ops.linear import _persistent_mm
    from vllm_bi.settings import reload

    os.environ["VLLM_BI_GEMM_CONFIGS"] = table
    reload()
    out = {}
    for (n, k), picks in timings.items():
        w, x = bench._tensors(n, k)
        for m, *_ in picks:
            out[(n, k, m)] = T.cuda_ms(lambda: _persistent_mm(x[:m], w.t(), None), bench.reps)
        bench.done_shape(n, k)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--out-json", default="bi_gemm_tiles.json", help="the VLLM_BI_GEMM_CONFIGS table to write")
    ap.add_argument("--shapes", default=None, help="NxK,... (default: Qwen3.5-9B's)")
    ap.add_argument("--buckets", default=",".join(map(str, T.BUCKETS)))
    ap.add_argument("--block-k", default=",".join(map(str, T.BLOCK_KS)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare", default=DEFAULT_GEMM_TABLE,
                    help="a tile table (a shipped table's name or a file) timed beside the tuned tiles through the op "
                         "a server runs, with the reference tiles of its K for shapes it lacks; '' for none "
                         f"(default: {DEFAULT_GEMM_TABLE}, the table VLLM_BI_GEMM_CONFIGS=auto names)")
    args = ap.parse_args()

    shapes = SHAPES_9B if not args.shapes else [(s, *map(int, s.split("x"))) for s in args.shapes.split(",")]
    what = {(n, k): w for w, n, k in shapes}
    buckets = sorted({int(b) for b in args.buckets.split(",")})
    block_ks = [int(b) for b in args.block_k.split(",")]
    bench = T.PersistentGemmBench(reps=args.reps, rows=max(max(buckets), max(T.CHECK_MS)))
    t0 = time.time()
    rows = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, arch {bench.arch}; median ms of "
            f"{args.reps}; tiles = BLOCK_M, BLOCK_N, warps, stages (BLOCK_K per shape)", "",
            "| shape | N x K | M | cuBLAS | vLLM default tiles | ratio | tuned | ratio | tiles |"
            + (f" {args.compare} | ratio | tuned / {args.compare} |" if args.compare else ""),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
            + (" ---: | ---: | ---: |" if args.compare else "")]
    print("\n".join(rows), flush=True)
    vdef = {}

    def reference(n, k, m):  # cuBLAS, and vLLM's default tiles for the report
        vdef[(n, k, m)] = bench.time_default(n, k, m)
        return bench.time_reference(n, k, m)

    try:
        res = T.tune_shapes([(n, k) for _, n, k in shapes], reference, bench.time_tiles, bench.product,
                            buckets=buckets, block_ks=block_ks, done_shape=bench.done_shape)
    finally:
        bench.restore()
    failed = [f"{n}x{k} ({why})" for n, k, why in res.failed]
    compared = time_table(args.compare, res.timings, bench) if args.compare else {}
    for (n, k), picks in res.timings.items():
        bk = res.entries[(n, k)][0]
        for m, ref, t, tile in picks:
            d = vdef[(n, k, m)]
            row = (f"| {what[(n, k)]} | {n} x {k} | {m} | {ref:.3f} | {d:.3f} | {d / ref:.2f}x | {t:.3f} | "
                   f"{t / ref:.2f}x | {', '.join(map(str, tile))} (K {bk}) |")
            if (n, k, m) in compared:
                c = compared[(n, k, m)]
                row += f" {c:.3f} | {c / ref:.2f}x | {t / c:.2f}x |"
            rows.append(row)
            print(rows[-1], flush=True)
    rejected = "; ".join(f"{n}x{k} M<={m} {tile}" for n, k, m, tile in res.rejected)
    rows += ["", f"rows equal whatever the batch: {'all shapes' if not failed else 'NOT for ' + ', '.join(failed)}"
             f"{'; candidates rejected (rows differ by M): ' + rejected if rejected else ''}; "
             f"{time.time() - t0:.0f} s"]
    print(rows[-1])
    if res.entries:
        command = "python benchmarks/bi_gemm_tune.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")
        doc = T.table_doc(res, bench.arch, device=torch.cuda.get_device_name(), command=command,
                          date=time.strftime("%Y-%m-%d"))
        with open(args.out_json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out_json} ({len(doc['shapes'])} shapes): "
              f"VLLM_BI_GEMM_CONFIGS={os.path.abspath(args.out_json)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
