"""Where the time of vllm_bi's GDN core goes, on CUDA: a per-step breakdown of ``gdn_varlen`` and a
torch.profiler table, at Qwen3.5-9B GDN dimensions (see gdn_layer.py).

    python benchmarks/profile_gdn.py [--shapes prefill:8x8192,decode:256x1,train:1x4096] [--modes recurrent,chunk]
        [--out profile.md]

A ``server:BxP`` shape profiles the server's whole chunk-mode decode step for one layer instead
(``gdn_layer.server_step``: ``B`` requests, each with ``P - 1`` cached rows of its partial block and one new
token; the conv-history glue and the state slots included), for the modes given other than stock. A ``train:BxT`` shape breaks the trainer's forward + backward down instead: the whole core's forward and
forward + backward, then the conv and the recurrence each alone (forward + backward), for stock and BI.

Per shape and mode: median ms (CUDA events) of each step of the core as ``gdn_varlen`` runs it (row
gather, conv, q/k/v split, gating, the recurrence) and of the whole call, and the 10 ops with the most self
CUDA time and self CPU time in one profiled call. Mode ``stock`` (run first: the chunk mode pins fla-core's
kernels process-wide) is gdn_layer.py's stock core, timed with fla-core's defaults and again with the
backend re-dispatch the chunk mode turns off (FLA_INTRACARD_CP=0, FLA_FLASH_QLA=0). First, the Triton conv
kernel's time for several tilings (``--conv-blocks``), which change no bit: the fastest can be made the
default (``vllm_bi.ops.conv.BLOCK_T``/``BLOCK_D``).
"""

from __future__ import annotations

import argparse

import torch

from common import timed
from gdn_layer import D, H, HV, K, KEY, V, W, _inputs, stock_core

from vllm_bi.gdn import recurrent as gr
from vllm_bi.gdn.chunk import gdn_chunk_varlen


def _ranges(lens):
    out, s = [], 0
    for n in lens:
        out.append((s, s + n))
        s += n
    return out


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    return (ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60),
            ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))


def stock(lens, dev, reps):
    import os

    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev)
    conv0 = torch.zeros(N, D, W, device=dev, dtype=torch.bfloat16)
    st = torch.zeros(N, HV, K, V, device=dev)

    def run():
        return stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st, decode=False)

    times = {"stock core, fla-core defaults": f"{timed(run, reps):.3f}"}
    by_cuda, by_cpu = _profile(run)
    saved = {k: os.environ.get(k) for k in ("FLA_INTRACARD_CP", "FLA_FLASH_QLA")}
    os.environ.update(FLA_INTRACARD_CP="0", FLA_FLASH_QLA="0")
    times["stock core, FLA_INTRACARD_CP=0 FLA_FLASH_QLA=0"] = f"{timed(run, reps):.3f}"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v
    return times, by_cuda, by_cpu


def breakdown(lens, mode, dev, reps):
    if mode == "stock":
        return stock(lens, dev, reps)
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

    steps = {
        "rows_of (host index + copy)": lambda: gr.rows_of(ranges, dev),
        "gather a[rows], b[rows]": lambda: (a[rows], b[rows]),
        "causal_conv1d_varlen": lambda: gr.causal_conv1d_varlen(mixed, cu, conv_w, conv_states),
        "q/k/v split + contiguous": split,
        "gdn_gating": lambda: gr.gdn_gating(A_log, a, b, dt_bias),
        f"recurrence ({core.__name__})": lambda: core(q, k, v, g, beta, states, cu),
        "whole gdn_varlen": lambda: gr.gdn_varlen(mixed, ranges, conv_w, conv_states, A_log, a, b, dt_bias,
                                                  states, H, K, V, mode=mode),
    }
    times = {}
    for name, fn in steps.items():
        try:
            times[name] = f"{timed(fn, reps):.3f}"
        except Exception as e:  # noqa: BLE001 - a candidate may not run here; the table says so
            times[name] = "error: " + str(e).splitlines()[0][:80]
    by_cuda, by_cpu = _profile(steps["whole gdn_varlen"])
    return times, by_cuda, by_cpu


def train_breakdown(lens, mode, dev, reps):
    """Trainer forward + backward of the core (gdn_layer.py --part train's step), split into the conv
    (forward + backward alone) and the recurrence (forward + backward alone, on leaf q/k/v/g/beta)."""
    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev, grad=True)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    loss = lambda o: o.float().square().mean()  # noqa: E731
    if mode == "stock":
        from fla.modules.causal_conv1d.ops import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        conv0, st = torch.zeros(N, D, W, device=dev, dtype=torch.bfloat16), torch.zeros(N, HV, K, V, device=dev)
        cu_t = torch.tensor(cu, device=dev)
        whole = lambda: stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st, decode=False)[0]  # noqa: E731
        conv = lambda: causal_conv1d(mixed[None], conv_w, initial_state=conv0, activation="silu", cu_seqlens=cu_t)[0]  # noqa: E731

        def rec(q, k, v, g, beta):
            return chunk_gated_delta_rule(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None],
                                          scale=K**-0.5, initial_state=st, output_final_state=True, cu_seqlens=cu_t,
                                          use_qk_l2norm_in_kernel=True)[0]
    else:
        conv_states = torch.zeros(N, W - 1, D, device=dev, dtype=torch.bfloat16)
        states = torch.zeros(N, HV, V, K, device=dev)
        whole = lambda: gr.gdn_varlen(mixed, _ranges(lens), conv_w, conv_states, A_log, a, b, dt_bias, states,  # noqa: E731
                                      H, K, V, mode=mode, packed=True)[0]
        conv = lambda: gr.causal_conv1d_varlen(mixed, cu, conv_w, conv_states)[0]  # noqa: E731
        core = gdn_chunk_varlen if mode == "chunk" else gr.gdn_recurrent_varlen

        def rec(q, k, v, g, beta):
            return core(q, k, v, g, beta, states, cu)[0]
    with torch.no_grad():
        x = conv().reshape(-1, D)
    T = x.shape[0]
    leaves = [x[:, :KEY].reshape(T, H, K).contiguous(), x[:, KEY:2 * KEY].reshape(T, H, K).contiguous(),
              x[:, 2 * KEY:].reshape(T, HV, V).contiguous(), *gr.gdn_gating(A_log, a, b, dt_bias)]
    leaves = [t.detach().float().requires_grad_(True) if i == 3 else t.detach().requires_grad_(True)
              for i, t in enumerate(leaves)]
    steps = {
        "whole core, forward (with autograd graph)": whole,
        "whole core, forward + backward": lambda: loss(whole()).backward(),
        "conv, forward + backward": lambda: loss(conv()).backward(),
        "recurrence, forward + backward": lambda: loss(rec(*leaves)).backward(),
    }
    times = {}
    for name, fn in steps.items():
        try:
            times[name] = f"{timed(fn, reps, warmup=2):.3f}"
        except Exception as e:  # noqa: BLE001 - e.g. fla-core refusing its backward here; the table says so
            times[name] = "error: " + str(e).splitlines()[0][:80]
    by_cuda, by_cpu = _profile(steps["whole core, forward + backward"])
    return times, by_cuda, by_cpu


def server_breakdown(n: int, rows: int, mode: str, reps: int):
    """The server's decode step (``gdn_layer.server_step``) of ``n`` requests with ``rows - 1`` cached rows of
    their partial block: its wall and GPU time, and the profiler's tables."""
    from common import gpu_ms
    from gdn_layer import Shape, server_step

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    with server_step(Shape(f"decode {n}", [1] * n, True, rows - 1), mode, "cuda") as step:
        return ({"server step (wall)": f"{timed(step, reps):.3f}", "server step (GPU)": f"{gpu_ms(step):.3f}",
                 "conv state dim first": str(is_conv_state_dim_first())}, *_profile(step))


def conv_tilings(spec: str, reps: int) -> dict[str, float]:
    """Median ms of the Triton conv kernel at 8 x 8192 tokens (9B width) for each tiling in ``spec``."""
    from vllm_bi.ops.conv import triton_causal_conv1d

    lens = [8192] * 8
    mixed, conv_w, *_ = _inputs(lens, "cuda")
    st = torch.zeros(len(lens), W - 1, D, device="cuda", dtype=torch.bfloat16)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).int().cuda()
    pos = torch.arange(8192).repeat(len(lens)).int().cuda()
    starts = torch.arange(0, sum(lens), 8192).cuda()
    out = {}
    for b in spec.split(","):
        blocks = tuple(int(v) for v in b.split("x"))
        out[b] = timed(lambda: triton_causal_conv1d(mixed, conv_w, st, seq, pos, starts, True, blocks), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="prefill:8x8192,prefill:1x16384,prefill:64x1024,decode:16x33,decode:256x1")
    ap.add_argument("--modes", default="stock,recurrent,chunk", help="stock runs first whatever the order")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--conv-blocks", default="16x256x4,32x256x4,64x128x4,64x64x4,128x64x8",
                    help="tilings (tokens x channels x warps) of the Triton conv kernel to time at 8 x 8192 "
                         "tokens ('' to skip); they change no bit (tests/gpu/test_gdn_conv_cuda.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; median ms of {args.reps}", ""]
    if args.conv_blocks:
        lines += ["## Triton conv tilings, 8 x 8192 tokens", "", "| tokens x channels x warps | ms |", "| --- | ---: |",
                  *[f"| {b} | {t:.3f} |" for b, t in conv_tilings(args.conv_blocks, args.reps).items()], ""]
        print("\n".join(lines), flush=True)
    modes = sorted(args.modes.split(","), key=lambda m: m != "stock")
    bad = [m for m in modes if m not in ("stock", "recurrent", "chunk")]
    if bad:
        ap.error(f"unknown mode(s) {bad}: choose from stock, recurrent, chunk")
    for mode in modes:
        for spec in args.shapes.split(","):
            label, dims = spec.split(":")
            n, t = (int(x) for x in dims.split("x"))
            if mode == "stock" and label in ("decode", "server"):
                continue
            if label == "server":
                times, by_cuda, by_cpu = server_breakdown(n, t, mode, args.reps)
            else:
                fn = train_breakdown if label == "train" else breakdown
                times, by_cuda, by_cpu = fn([t] * n, mode, "cuda", args.reps)
            block = [f"## {label} {n}x{t}, {mode}", "", "| step | ms |", "| --- | ---: |",
                     *[f"| {k} | {v} |" for k, v in times.items()], "", "```", by_cuda, by_cpu, "```", ""]
            lines += block
            print("\n".join(block), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
