"""Shared timing helpers of the benchmarks (``python benchmarks/<name>.py`` puts this folder on sys.path)."""

from __future__ import annotations

import statistics
import time

import torch


def host_ms(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` by the host clock, after ``warmup`` calls (CPU runs; on CUDA
    use :func:`timed`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events) after ``warmup`` calls
    (:func:`vllm_bi.ops.gemm_tune.cuda_ms`)."""
    from vllm_bi.ops.gemm_tune import cuda_ms

    return cuda_ms(fn, reps, warmup)


def gpu_ms(fn, reps: int = 3) -> float:
    """Milliseconds the GPU spends in kernels and copies per call of ``fn`` (torch.profiler's device time of
    ``reps`` calls after one warm-up, summed, divided by ``reps``). Unlike :func:`timed`, host time between
    launches does not count: a small step's wall time follows host noise, its GPU time does not."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages())
    return us / 1000.0 / reps


def ms_cell(t: float | None) -> str:
    """A time in milliseconds for a table cell (``n/a`` when not measured)."""
    return "n/a" if t is None else f"{t:.3f}"


def ratio_cell(t: float | None, ref: float | None) -> str:
    """``t / ref`` for a table cell (``n/a`` when either is missing or ``ref`` is 0)."""
    return "n/a" if t is None or ref is None or ref == 0 else f"{t / ref:.2f}x"


def emit(table: str, out: str | None) -> None:
    """Print the finished table and also write it to ``out`` when given."""
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table)
