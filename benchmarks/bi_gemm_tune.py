"""Tune the Triton GEMM mode's tiles (``VLLM_BI_GEMM=triton``) per weight shape and batch-size bucket, check that
a row's bits do not depend on the bucket, and write a table for ``VLLM_BI_GEMM_CONFIGS`` (``ops/gemm_configs.py``).

    python benchmarks/bi_gemm_tune.py [--out-json tiles.json] [--out tiles.md] [--shapes 12288x4096,...]
                                      [--buckets 1,16,256,...] [--block-k 64,128] [--reps 5]

For each weight shape ``(N, K)`` (default: Qwen3.5-9B's linear layers as vLLM merges them) and each bucket of
``M`` it times vLLM 0.32's batch-invariant persistent matmul with candidate tiles (``BLOCK_M`` by bucket,
``BLOCK_N`` 64/128/256, 4 or 8 warps, 3 or 4 stages) for each shape-wide ``BLOCK_K``, keeps the fastest per
bucket, and picks, per ``K``, the ``BLOCK_K`` with the least total time relative to cuBLAS over the shapes that
share that ``K`` (one ``BLOCK_K`` per ``K``: a fused layer must give its parts' bits, ``ops/gemm_configs.py``). Then, with the chosen table
installed, it computes the rows of ``M = 1 ... max`` batches and requires each row ``torch.equal`` to the same row
of the largest batch (a shape that fails is left out of the table and reported). Prints a table: cuBLAS bf16,
vLLM's default tiles, the tuned tiles, ms and ratios (median of ``--reps`` CUDA-event timings after warm-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from common import timed

SHAPES_9B = [  # (what, N, K): Qwen3.5-9B's linear layers as vLLM merges them
    ("attention qkv (q with its gate)", 10240, 4096),
    ("attention o, GDN out", 4096, 4096),
    ("GDN in_proj_qkvz", 12288, 4096),
    ("GDN in_proj_ba", 64, 4096),
    ("MLP gate_up", 24576, 4096),
    ("MLP down", 4096, 12288),
]
BUCKETS = (1, 4, 8, 16, 32, 64, 256, 512, 1024, 2048, 8192)
CHECK_MS = (1, 2, 3, 5, 17, 100, 300, 1000, 3000)  # batch sizes checked against the largest batch's rows
FOREVER = 1 << 30
DEV = "cuda"


def _block_m(max_m: int) -> tuple[int, ...]:
    return (16,) if max_m <= 16 else (16, 32, 64) if max_m <= 64 else (64, 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--out-json", default="bi_gemm_tiles.json", help="the VLLM_BI_GEMM_CONFIGS table to write")
    ap.add_argument("--shapes", default=None, help="NxK,... (default: Qwen3.5-9B's)")
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from vllm.model_executor.determinism import batch_invariant_configs as C
    from vllm.model_executor.determinism.batch_invariant import matmul_persistent

    shapes = SHAPES_9B if not args.shapes else [(s, *map(int, s.split("x"))) for s in args.shapes.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    block_ks = [int(b) for b in args.block_k.split(",")]
    from vllm.platforms.interface import DeviceCapability

    arch = C._get_tuned_matmul_arch_family(DeviceCapability(*torch.cuda.get_device_capability()))
    if arch is None:
        raise SystemExit(f"vLLM has no tuned-matmul arch family for {torch.cuda.get_device_name()}")
    table = C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.setdefault(arch, {})
    vllm_own = dict(table)

    def use(n, k, block_k, m_buckets):  # install one shape's tiles into vLLM's lookup
        table[(n, k)] = C._MatmulShapeConfig(block_k=block_k, m_buckets=tuple(
            (m, C._MatmulMConfig(*cfg)) for m, cfg in m_buckets))
        C._TUNED_MATMUL_CONFIGS_RESOLVED = False

    def default(n, k):
        table.pop((n, k), None)
        if (n, k) in vllm_own:
            table[(n, k)] = vllm_own[(n, k)]
        C._TUNED_MATMUL_CONFIGS_RESOLVED = False

    t0 = time.time()
    rows = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, arch {arch}; median ms of "
            f"{args.reps}; tiles = BLOCK_M, BLOCK_N, warps, stages (BLOCK_K per shape)", "",
            "| shape | N x K | M | cuBLAS | vLLM default tiles | ratio | tuned | ratio | tiles |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(rows), flush=True)
    out = {"format": 1, "arch": arch, "device": torch.cuda.get_device_name(),
           "command": "python benchmarks/bi_gemm_tune.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
           "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    failed = []
    tuned = {}  # (what, n, k) -> (weight, cuBLAS ms, vLLM default ms, {block_k: (score, picks)})
    for what, n, k in shapes:
        w = (torch.randn(n, k, device=DEV) * 0.02).bfloat16()
        xs = {m: torch.randn(m, k, device=DEV).bfloat16() for m in buckets}
        cublas = {m: timed(lambda x=xs[m]: torch.mm(x, w.t()), args.reps) for m in buckets}
        default(n, k)
        vdef = {m: timed(lambda x=xs[m]: matmul_persistent(x, w.t()), args.reps) for m in buckets}
        best: dict[int, tuple[float, list]] = {}
        for bk in block_ks:
            picks, score = [], 0.0
            for m in buckets:
                cands = []
                for bm in _block_m(m):
                    for bn in (64, 128, 256):
                        for warps in (4, 8):
                            for stages in (3, 4):
                                cfg = (bm, bn, warps, stages)
                                use(n, k, bk, [(FOREVER, cfg)])
                                try:
                                    cands.append((timed(lambda x=xs[m]: matmul_persistent(x, w.t()), args.reps), cfg))
                                except Exception:  # noqa: BLE001 - tiles that do not fit in shared memory
                                    torch.cuda.synchronize()
                if cands:
                    picks.append((m, min(cands)))
                    score += min(cands)[0] / cublas[m]
            if len(picks) == len(buckets):
                best[bk] = (score, picks)
        default(n, k)
        tuned[(what, n, k)] = (w, cublas, vdef, best)
    # one BLOCK_K per K (ops/gemm_configs.py: a fused layer's columns must give its parts' bits): the BLOCK_K with the
    # least summed score over the shapes that share the K
    block_k_of = {}
    for kk in sorted({k for _, _, k in tuned}):
        group = [b for (_, _, k), (_, _, _, b) in tuned.items() if k == kk]
        ok = [bk for bk in block_ks if all(bk in b for b in group)]
        if ok:
            block_k_of[kk] = min(ok, key=lambda bk: sum(b[bk][0] for b in group))
    for (what, n, k), (w, cublas, vdef, best) in tuned.items():
        if k not in block_k_of:
            failed.append(f"{n}x{k} (no BLOCK_K ran every bucket)")
            continue
        bk = block_k_of[k]
        picks = best[bk][1]
        m_buckets = [[m, *cfg] for m, (_, cfg) in picks]
        use(n, k, bk, [(m, tuple(cfg)) for m, *cfg in m_buckets])
        # a row's bits must not depend on the batch it is in (the bucket's tiles)
        x = torch.randn(max(buckets + [max(CHECK_MS)]), k, device=DEV).bfloat16()
        full = matmul_persistent(x, w.t())
        same = all(torch.equal(matmul_persistent(x[:m], w.t()), full[:m]) for m in sorted(set(CHECK_MS) | set(buckets)))
        if same:
            out["shapes"][f"{n}x{k}"] = {"block_k": bk, "m_buckets": m_buckets}
        else:
            failed.append(f"{n}x{k}")
        default(n, k)
        for m, (t, cfg) in picks:
            rows.append(f"| {what} | {n} x {k} | {m} | {cublas[m]:.3f} | {vdef[m]:.3f} | {vdef[m] / cublas[m]:.2f}x | "
                        f"{t:.3f} | {t / cublas[m]:.2f}x | {', '.join(map(str, cfg))} (K {bk})"
                        f"{'' if same else ' **rows differ by M**'} |")
            print(rows[-1], flush=True)
    rows += ["", f"rows equal whatever the batch: {'all shapes' if not failed else 'NOT for ' + ', '.join(failed)}; "
             f"{time.time() - t0:.0f} s"]
    print(rows[-1])
    if out["shapes"]:
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out_json} ({len(out['shapes'])} shapes): "
              f"VLLM_BI_GEMM_CONFIGS={os.path.abspath(args.out_json)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
