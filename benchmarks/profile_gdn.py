"""Where the time of vllm_bi's GDN core goes, on CUDA: a per-step breakdown of ``gdn_varlen`` and a
torch.profiler table, at Qwen3.5-9B GDN dimensions (see gdn_layer.py).

    python benchmarks/profile_gdn.py [--shapes prefill:8x8192,decode:256x1] [--modes recurrent,chunk]
        [--out profile.md]

Per shape and mode: median ms (CUDA events) of each step of the core as ``gdn_varlen`` runs it (row
gather, conv, q/k/v split, gating, the recurrence), of the whole call, of fla-core's Triton
``causal_conv1d`` on the same packed rows (a candidate replacement for the torch conv), and the
10 ops with the most self CUDA time and self CPU time in one profiled call.
"""

from __future__ import annotations

import argparse

import torch

from common import timed
from gdn_layer import D, H, HV, K, KEY, V, W, _inputs

from vllm_bi.attention import gdn_recurrent as gr
from vllm_bi.attention.gdn_chunk import gdn_chunk_varlen


def _ranges(lens):
    out, s = [], 0
    for n in lens:
        out.append((s, s + n))
        s += n
    return out


def breakdown(lens, mode, dev, reps):
    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev)
    conv_states = torch.zeros(N, W - 1, D, device=dev, dtype=torch.bfloat16)
    states = torch.zeros(N, HV, V, K, device=dev)
    ranges = _ranges(lens)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    rows = gr.rows_of(ranges, dev)
    x, _ = gr.causal_conv1d_varlen(mixed, cu, conv_w, conv_states)
    T = x.shape[0]
    q = x[:, :KEY].reshape(T, H, K).contiguous()
    k = x[:, KEY:2 * KEY].reshape(T, H, K).contiguous()
    v = x[:, 2 * KEY:].reshape(T, HV, V).contiguous()
    g, beta = gr.gdn_gating(A_log, a, b, dt_bias)
    core = gdn_chunk_varlen if mode == "chunk" else gr.gdn_recurrent_varlen

    def split():
        return (x[:, :KEY].reshape(T, H, K).contiguous(), x[:, KEY:2 * KEY].reshape(T, H, K).contiguous(),
                x[:, 2 * KEY:].reshape(T, HV, V).contiguous())

    def fla_conv():
        from fla.modules.causal_conv1d.ops import causal_conv1d

        cu_t = torch.tensor(cu, device=dev)
        return causal_conv1d(mixed[None], conv_w, initial_state=conv_states.transpose(1, 2).contiguous(),
                             output_final_state=True, activation="silu", cu_seqlens=cu_t)

    steps = {
        "rows_of (host index + copy)": lambda: gr.rows_of(ranges, dev),
        "gather a[rows], b[rows]": lambda: (a[rows], b[rows]),
        "causal_conv1d_varlen (torch)": lambda: gr.causal_conv1d_varlen(mixed, cu, conv_w, conv_states),
        "q/k/v split + contiguous": split,
        "gdn_gating": lambda: gr.gdn_gating(A_log, a, b, dt_bias),
        f"recurrence ({core.__name__})": lambda: core(q, k, v, g, beta, states, cu),
        "whole gdn_varlen": lambda: gr.gdn_varlen(mixed, ranges, conv_w, conv_states, A_log, a, b, dt_bias,
                                                  states, H, K, V, mode=mode),
        "fla causal_conv1d (candidate)": fla_conv,
    }
    times = {}
    for name, fn in steps.items():
        try:
            times[name] = f"{timed(fn, reps):.3f}"
        except Exception as e:  # noqa: BLE001 - a candidate may not run here; the table says so
            times[name] = "error: " + str(e).splitlines()[0][:80]
    from torch.profiler import ProfilerActivity, profile

    whole = steps["whole gdn_varlen"]
    whole()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        whole()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    by_cuda = ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60)
    by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60)
    return times, by_cuda, by_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="prefill:8x8192,prefill:1x16384,prefill:64x1024,decode:16x33,decode:256x1")
    ap.add_argument("--modes", default="recurrent,chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; median ms of {args.reps}", ""]
    for spec in args.shapes.split(","):
        label, dims = spec.split(":")
        n, t = (int(x) for x in dims.split("x"))
        for mode in args.modes.split(","):
            times, by_cuda, by_cpu = breakdown([t] * n, mode, "cuda", args.reps)
            lines += [f"## {label} {n}x{t}, {mode}", "", "| step | ms |", "| --- | ---: |",
                      *[f"| {k} | {v} |" for k, v in times.items()], "", "```", by_cuda, by_cpu, "```", ""]
            print("\n".join(lines[-(len(times) + 10):]), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
