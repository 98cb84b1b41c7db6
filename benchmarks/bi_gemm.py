"""Benchmark: vllm_bi's batch-invariant GEMMs (``ops.linear.bi_linear`` under ``VLLM_BI_GEMM=fp64``: exact float64
accumulation, the portable preset's; and ``VLLM_BI_GEMM=triton``, CUDA's default: vLLM's batch-invariant Triton
persistent matmul in bf16) against cuBLAS bf16 ``torch.mm`` on Qwen3.5-9B-like linear shapes, for M = tokens in the
batch.

    python benchmarks/bi_gemm.py [--out results.md]

Prints a markdown table: median of 10 timed runs (CUDA events) after 3 warm-ups. "bi_linear fp64" casts the bf16
weight to float64 on every call (what the float64 GEMM does); "fp64 mm, weight pre-cast" isolates the GEMM.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import emit, timed

from vllm_bi.ops import linear
from vllm_bi.ops.linear import bi_linear
from vllm_bi.settings import reload as reload_settings

SHAPES = [  # (name, K, N)
    ("qkv/o 4096x4096", 4096, 4096),
    ("gate_up 4096x24576", 4096, 24576),
    ("down 12288x4096", 12288, 4096),
]
MS = (1, 16, 256, 2048, 8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    dev = "cuda"

    def bi_triton(x, w):
        return linear._PersistentLinear.apply(x, w, None)  # VLLM_BI_GEMM=triton's kernel

    rows = ["| shape | M | cuBLAS bf16 (ms) | bi_linear fp64 (ms) | ratio | fp64 mm, weight pre-cast (ms) | ratio | "
            "triton persistent (ms) | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    os.environ["VLLM_BI_GEMM"] = "fp64"  # bi_linear below is the float64 GEMM (auto would be the Triton one on CUDA)
    reload_settings()
    for name, K, N in SHAPES:
        w = (torch.randn(N, K, device=dev) * 0.02).bfloat16()
        w64 = w.double()
        for M in MS:
            x = torch.randn(M, K, device=dev).bfloat16()
            t_ref = timed(lambda: torch.mm(x, w.t()))
            t_bi = timed(lambda: bi_linear(x, w))
            t_64 = timed(lambda: torch.mm(x.double(), w64.t()).to(torch.bfloat16))
            t_tr = timed(lambda: bi_triton(x, w))
            rows.append(f"| {name} | {M} | {t_ref:.3f} | {t_bi:.3f} | {t_bi / t_ref:.1f}x | {t_64:.3f} | {t_64 / t_ref:.1f}x | "
                        f"{t_tr:.3f} | {t_tr / t_ref:.1f}x |")
            print(rows[-1], flush=True)
    head = (f"device {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n")
    table = head + "\n".join(rows) + "\n"
    emit(table, args.out)


if __name__ == "__main__":
    main()
