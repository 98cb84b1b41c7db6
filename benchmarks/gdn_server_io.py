"""Benchmark: the recurrent GDN server step's glue on CUDA, one layer at Qwen3.5-9B dimensions, side by side in one
process: with torch copies around the kernels (``VLLM_BI_GDN_IO=copies``, the portable preset's) against without
them (``direct``, CUDA's default: the conv reading and writing its states in their cache slots, q, k and v written
apart, the kernel writing the layer's rows), each with the gates as torch's elementwise kernels or one Triton kernel
(``VLLM_BI_GDN_GATES``); and stock's core (fla-core's conv and chunked / fused recurrent kernels) for scale.

    python benchmarks/gdn_server_io.py [--shapes prefill:64x1024,decode:64x1,decode:256x1] [--no-stock] [--out io.md]

Each row: the step's wall time (CUDA events, median) and GPU time (kernels and copies, torch.profiler: what a decode
step replayed in a CUDA graph pays), and whether the side's outputs, conv cache and state slots after one step equal
the first side's from the same inputs (``torch.equal``): the sides are meant to give the same bits.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import gpu_ms, timed
from gdn_layer import Shape, server_step, time_stock_forward

from vllm_bi.settings import reload as reload_settings

SIDES = (("copies", "torch"), ("direct", "torch"), ("copies", "triton"), ("direct", "triton"))


def parse_shape(text: str) -> Shape:
    """``prefill:NxT`` (N new sequences of T tokens) or ``decode:Nx1`` (N sequences, one token each)."""
    try:
        kind, dims = text.split(":")
        n, t = (int(x) for x in dims.split("x"))
    except ValueError:
        raise ValueError(f"{text!r}: a shape is prefill:NxT or decode:Nx1") from None
    if kind not in ("prefill", "decode") or n < 1 or t < 1 or (kind == "decode" and t != 1):
        raise ValueError(f"{text!r}: a shape is prefill:NxT or decode:Nx1")
    return Shape(f"{kind} {n}x{t}", [t] * n, decode=kind == "decode")


def side_step(shape: Shape, io: str, gates: str, dev: str, reps: int) -> tuple[float, float, tuple]:
    """(wall ms, GPU ms, (out, conv cache, states) after one step from the seeded inputs) of one side."""
    os.environ["VLLM_BI_GDN_IO"], os.environ["VLLM_BI_GDN_GATES"] = io, gates
    reload_settings()
    torch.manual_seed(0)
    with server_step(shape, "recurrent", dev) as step:
        step()
        torch.cuda.synchronize()
        first = tuple(t.clone() for t in (step.out, *step.caches))
        return timed(step, reps), gpu_ms(step), first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="prefill:64x1024,prefill:8x8192,decode:64x1,decode:256x1")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--stock", action=argparse.BooleanOptionalAction, default=True,
                    help="also time stock's core (its first calls autotune fla-core's kernels: minutes)")
    ap.add_argument("--out", default=None, help="also write the table to this file (rewritten after each row)")
    args = ap.parse_args()
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
    except ValueError as e:
        ap.error(f"--shapes: {e}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the direct glue and the gates kernel are CUDA's paths)")
    lines = [f"GDN server step glue, one layer at Qwen3.5-9B dims, {torch.cuda.get_device_name()}; wall (CUDA events, "
             f"median of {args.reps}) and GPU time (torch.profiler) in ms; same bits: == the first side after one step",
             "", "| shape | stock core wall | stock core GPU | " + " | ".join(
                 f"{io}+{g} wall | GPU | same bits" for io, g in SIDES) + " |",
             "| --- | ---: | ---: |" + " ---: | ---: | :---: |" * len(SIDES)]

    def write():
        print(lines[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    for line in lines[:-1]:
        print(line)
    write()
    for sh in shapes:
        s_wall, s_gpu = time_stock_forward(sh, "cuda", args.reps) if args.stock else (float("nan"),) * 2
        cells, ref = [], None
        for io, gates in SIDES:
            wall, gpu, first = side_step(sh, io, gates, "cuda", args.reps)
            ref = ref or first
            same = all(torch.equal(a, b) for a, b in zip(first, ref))
            cells.append(f"{wall:.3f} | {gpu:.3f} | {'yes' if same else 'NO'}")
        lines.append(f"| {sh.label} | {s_wall:.3f} | {s_gpu:.3f} | " + " | ".join(cells) + " |")
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
