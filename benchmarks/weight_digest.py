"""Benchmark and GPU check: the weight digest (``vllm_bi.weights.weight_digest``) through the torch path and through
the fused Triton kernel (``VLLM_BI_DIGEST=triton``), side by side in one process.

    python benchmarks/weight_digest.py [--gib 16.7] [--reps 3] [--out weight_digest.md]

Checks, then times:
- special values (signed zeros, infinities, subnormals, the largest finite values) and awkward sizes in bf16, fp16
  and fp32: the kernel's digest equals the torch path's;
- a state of ``--gib`` GiB of bf16 tensors shaped like Qwen3.5-9B's (default: its 16.7 GiB without the drafter),
  on the GPU: both digests equal, and one flipped bit changes the kernel's;
- the median seconds of each path over ``--reps`` digests of that state.
The kernel can become CUDA's default (``settings.DIGEST_AUTO_CUDA``) once this prints ``equal: yes`` everywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

SHAPES = [(248320, 4096), (248320, 4096), (12288, 4096), (4096, 12288), (12288, 4096), (8192, 4096), (4096, 4096)]


def digest(state: dict, impl: str) -> tuple[dict, float]:
    from vllm_bi import settings
    from vllm_bi.weights import weight_digest

    os.environ["VLLM_BI_DIGEST"] = impl
    settings.reload()
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d = weight_digest(state.items())
        return d, time.perf_counter() - t0
    finally:
        os.environ.pop("VLLM_BI_DIGEST")
        settings.reload()


def special_state() -> dict:
    bits = {torch.bfloat16: (torch.int16, [0, -32768, 0x7F80, -128, 1, 0x7F, -32767, 0x7F7F, -129, 0x80]),
            torch.float16: (torch.int16, [0, -32768, 0x7C00, -1024, 1, 0x3FF, -32767, 0x7BFF, -1025, 0x400]),
            torch.float32: (torch.int32, [0, -2**31, 0x7F800000, -8388608, 1, 0x7FFFFF, -2**31 + 1, 0x7F7FFFFF,
                                          -8388609, 0x800000])}
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for dt, (it, values) in bits.items():
        state[f"layers.0.special.{dt}"] = torch.tensor(values, dtype=it, device="cuda").view(dt)
        for n in (1, 1023, 4097, 3_000_001):
            state[f"layers.1.random.{dt}.{n}"] = torch.randn(n, generator=g, device="cuda").to(dt)
    return state


def full_state(gib: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    state, total, i = {}, 0, 0
    while total < gib * 2**30:
        shape = SHAPES[i % len(SHAPES)]
        state[f"model.layers.{i}.w"] = (0.02 * torch.randn(shape, generator=g, device="cuda")).to(torch.bfloat16)
        total += state[f"model.layers.{i}.w"].numel() * 2
        i += 1
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=16.7, help="GiB of bf16 weights in the timed state")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="weight_digest.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("weight_digest.py: needs a CUDA GPU", file=sys.stderr)
        return 3
    rows = []
    sp = special_state()
    rows.append(("special values and sizes", digest(sp, "torch")[0] == digest(sp, "triton")[0]))
    state = full_state(args.gib)
    times = {"torch": [], "triton": []}
    ref = {}
    for impl in times:
        for _ in range(args.reps):
            d, s = digest(state, impl)
            times[impl].append(s)
            ref[impl] = d
    rows.append((f"{args.gib} GiB bf16 state", ref["torch"] == ref["triton"]))
    first = next(iter(state.values()))
    first.view(-1)[:1].view(torch.int16).bitwise_xor_(1)
    rows.append(("one bit flipped: digest changes", digest(state, "triton")[0] != ref["triton"]))
    lines = [f"# Weight digest, torch path vs fused Triton kernel, {torch.cuda.get_device_name()}", "",
             "command: " + " ".join([sys.executable, *sys.argv]), "", "| check | equal / as expected |",
             "| --- | --- |", *[f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in rows], "",
             f"| path | median s over {args.reps} digests of {args.gib} GiB |", "| --- | ---: |",
             *[f"| {impl} | {statistics.median(t):.3f} |" for impl, t in times.items()]]
    from common import emit

    emit("\n".join(lines) + "\n", args.out)
    return 0 if all(ok for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
