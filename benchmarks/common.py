"""Shared timing helper of the GPU benchmarks (``python benchmarks/<name>.py`` puts this folder on sys.path)."""

from __future__ import annotations

import torch


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def emit(table: str, out: str | None) -> None:
    """Print the finished table and also write it to ``out`` when given."""
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table)
