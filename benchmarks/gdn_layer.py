"""Benchmark: one GDN layer core at Qwen3.5-9B dimensions (16 key / 32 value heads of dim 128, conv width 4),
stock (non-batch-invariant) vs vllm_bi's recurrent and chunk-aligned batch-invariant modes, on CUDA.

    python benchmarks/gdn_layer.py --part forward [--out forward.md] [--quick] [--rows decode]
    python benchmarks/gdn_layer.py --part train [--out train.md]
    python benchmarks/gdn_layer.py --part layer [--out layer.md]

"Core" is everything between the in-projection and the output norm: causal conv1d + SiLU, q/k/v split,
gating (g, beta), the delta-rule recurrence with per-sequence states. Rows:

* prefill B x T (new sequences, zero states) and decode B x 1 (existing states):
  - stock: fla-core ``causal_conv1d`` (varlen) + ``chunk_gated_delta_rule`` (prefill) or
    ``fused_recurrent_gated_delta_rule`` (decode), the kernels vLLM's GDN layer uses;
  - recurrent / chunk kernel: vllm_bi's recurrence alone on the same q/k/v/g/beta
    (``gdn_recurrent_varlen``: fla-core fused recurrent; ``gdn_chunk_varlen``: fla-core chunked, two launches,
    pinned configs), explicit fp32 states;
  - recurrent / chunk core: ``gdn_varlen`` (what the server and the trainer run: the packed conv +
    gating + the recurrence), states passed in ``[N, HV, V, K]`` memory (one transposing copy for fla-core);
  - recurrent / chunk server: ``gdn.bi_gdn_core``, the server's glue around that core for one layer
    and one step: states and conv states gathered from cache slots and stored back (the chunk mode: the
    partial block assembled from the conv history).
    Stock's vLLM kernels read and write the cache in place, which the stock column (states passed directly)
    matches;
  - decode in the chunk mode recomputes the partial block after the last 64-token boundary: its rows run
    ``--partial`` (default 32, the mean) + 1 tokens per sequence, and one row the worst case, 63 + 1.
* trainer forward+backward B x T: stock = fla conv + chunk forward and backward; BI = ``gdn_varlen``
  forward in each mode and its backward (fla-core's chunked kernel, or the torch recurrence where fla-core
  refuses it; the table says which). The stock run is "n/a" where fla-core refuses its own backward
  (Hopper with Triton < 3.7.1 and no tilelang). Each row has the step's wall time and its GPU time (kernels and
  copies, torch.profiler): the step is host-bound at these sizes, so the wall ratio moves with host noise
  (chunk 4x1K 1.13x then 1.56x in consecutive runs on one machine: ``docs/results/2026-11-30-h200-gdn-layer-targets-and-moe.md``)
  while the GPU time does not.

* layer (``--part layer``): in-projections + core + out-projection (no gated output norm), stock = cuBLAS
  bf16 GEMMs + the stock core, BI = ``bi_linear`` (float64, or ``VLLM_BI_GEMM=triton``) + ``gdn_varlen``.

All stock runs come first: the chunk mode pins fla-core's autotuned kernels process-wide, and the table
lists what autotuning had picked for the stock runs and what the chunk mode pins.

Median of N timed runs (CUDA events) after warm-ups; ratios are BI / stock. ``--part forward`` adds a table of the
server columns' GPU time (kernels and copies, torch.profiler): what a decode step replayed in a CUDA graph pays.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from common import gpu_ms, ms_cell, ratio_cell, timed

from vllm_bi.settings import reload as reload_settings

H, HV, K, V, W = 16, 32, 128, 128, 4
KEY, VAL = H * K, HV * V
D = 2 * KEY + VAL


def _inputs(lens: list[int], dev: str, grad: bool = False):
    T = sum(lens)
    mixed = (torch.randn(T, D, device=dev) * 0.5).bfloat16()
    conv_w = (torch.randn(D, W, device=dev) * 0.3).bfloat16()
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    a, b = torch.randn(T, HV, device=dev).bfloat16(), torch.randn(T, HV, device=dev).bfloat16()
    dt_bias = torch.rand(HV, device=dev) - 0.5
    if grad:
        for t in (mixed, conv_w, a, b):
            t.requires_grad_(True)
    return mixed, conv_w, A_log, a, b, dt_bias


def _cu(lens, dev):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.long)


def stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, state0, decode: bool):
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from vllm_bi.gdn.recurrent import gdn_gating

    cu = _cu(lens, mixed.device)
    x, _ = causal_conv1d(mixed[None], conv_w, initial_state=conv0, output_final_state=True, activation="silu",
                         cu_seqlens=cu)
    x = x[0]
    T = x.shape[0]
    q = x[:, :KEY].reshape(1, T, H, K)
    k = x[:, KEY:2 * KEY].reshape(1, T, H, K)
    v = x[:, 2 * KEY:].reshape(1, T, HV, V)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    fn = fused_recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
    return fn(q=q, k=k, v=v, g=g[None], beta=beta[None], scale=K**-0.5, initial_state=state0,
              output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, states, mode="recurrent", packed=False):
    from vllm_bi.gdn.layer import gdn_varlen

    ranges, s = [], 0
    for n in lens:
        ranges.append((s, s + n))
        s += n
    return gdn_varlen(mixed, ranges, conv_w, conv_states, A_log, a, b, dt_bias, states, H, K, V, mode=mode,
                      packed=packed)


def bi_kernel(lens, q, k, v, g, beta, states, mode):
    from vllm_bi.gdn.chunk import gdn_chunk_varlen
    from vllm_bi.gdn.recurrent import gdn_recurrent_varlen

    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    fn = gdn_chunk_varlen if mode == "chunk" else gdn_recurrent_varlen
    return fn(q, k, v, g, beta, states, cu)


class Shape:
    """One benchmark row: stock runs ``lens`` (decode: one token per sequence); the chunk mode runs
    ``chunk_lens`` (decode: the partial block it recomputes plus the new token)."""

    def __init__(self, label, lens, decode=False, partial=0):
        self.label, self.lens, self.decode = label, lens, decode
        self.chunk_lens = [n + partial for n in lens]


def _forward_inputs(lens, decode, dev):
    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev)
    conv0 = torch.randn(N, D, W, device=dev).bfloat16() * (1.0 if decode else 0.0)  # fla layout [N, D, W]
    st_kv = torch.randn(N, HV, K, V, device=dev) * (0.1 if decode else 0.0)  # fla layout
    return mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv


def _qkvgb(mixed, A_log, a, b, dt_bias):
    from vllm_bi.gdn.recurrent import gdn_gating

    T = mixed.shape[0]
    q = mixed[:, :KEY].reshape(T, H, K).contiguous()
    k = mixed[:, KEY:2 * KEY].reshape(T, H, K).contiguous()
    v = mixed[:, 2 * KEY:].reshape(T, HV, V).contiguous()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    return q, k, v, g, beta


def time_stock_forward(shape: Shape, dev: str, reps: int) -> tuple[float, float]:
    """(wall, GPU time) milliseconds of the stock core (:func:`common.gpu_ms`)."""
    mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv = _forward_inputs(shape.lens, shape.decode, dev)

    def step():
        stock_core(shape.lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv, shape.decode)

    return timed(step, reps), gpu_ms(step)


def time_server_core(shape: Shape, mode: str, dev: str, reps: int) -> tuple[float, float]:
    """:func:`server_step` timed: (wall, GPU time) milliseconds."""
    with server_step(shape, mode, dev) as step:
        return timed(step, reps), gpu_ms(step)


@contextlib.contextmanager
def server_step(shape: Shape, mode: str, dev: str):
    """The server's GDN glue for one layer and one scheduler step, ``gdn.bi_gdn_core`` as vLLM calls it, as a
    function of no arguments (yielded; the metadata and mode patches are entered once, around its calls, so
    their cost is not timed): the states and conv states read from shuffled cache slots (new requests zeroed),
    the core, the states stored back; in the chunk mode decode also assembles the partial block from the
    widened conv history (``shape.chunk_lens`` - 1 cached rows per sequence) and stores the new history. The
    step's plan (the host reads of the scheduler metadata and the index tensors) is built on the first call and
    then shared, as the server shares it between the model's GDN layers."""
    import types
    from unittest import mock

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm_bi.gdn.chunk import CHUNK
    from vllm_bi.model_executor import gdn as G

    N, T = len(shape.lens), sum(shape.lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(shape.lens, dev)
    dim_first = is_conv_state_dim_first()
    rows, width = (G.history_rows(W), D + 2 * HV) if mode == "chunk" else (W - 1, D)
    conv = torch.randn(2 * N, *((width, rows) if dim_first else (rows, width)), device=dev).bfloat16()
    ssm = torch.randn(2 * N, HV, V, K, device=dev) * 0.1
    layer = types.SimpleNamespace(
        kv_cache=(conv, ssm), conv1d=types.SimpleNamespace(weight=conv_w[:, None, :]), num_k_heads=H, tp_size=1,
        head_k_dim=K, head_v_dim=V, A_log=A_log, dt_bias=dt_bias, activation="silu", prefix="bench")
    qsl = [0, *torch.tensor(shape.lens).cumsum(0).tolist()]
    partial = shape.chunk_lens[0] - shape.lens[0]  # decode: tokens since the last boundary
    computed = [4 * CHUNK + partial if shape.decode else 0] * N
    md = types.SimpleNamespace(
        num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None,
        non_spec_query_start_loc=torch.tensor(qsl, device=dev),
        non_spec_state_indices_tensor=torch.randperm(2 * N)[:N].to(dev),
        num_decodes=N if shape.decode else 0, num_prefills=0 if shape.decode else N,
        num_decode_tokens=N if shape.decode else 0, has_initial_state=torch.tensor([shape.decode] * N, device=dev),
        vllm_bi_num_computed=torch.tensor(computed, device=dev))
    out = torch.empty(T, HV, V, device=dev, dtype=torch.bfloat16)

    def step():
        G.bi_gdn_core(layer, mixed, b, a, out)

    step.out, step.caches = out, layer.kv_cache  # what a step writes, for callers comparing two glues' bits
    with mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "gdn_mode", return_value=mode):
        yield step


def time_bi_forward(shape: Shape, mode: str, dev: str, reps: int) -> tuple[float, float]:
    """(kernel alone, whole BI core) milliseconds in ``mode``."""
    lens = shape.chunk_lens if mode == "chunk" else shape.lens
    mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv = _forward_inputs(lens, shape.decode, dev)
    conv_states = conv0[:, :, 1:].transpose(1, 2).contiguous()  # vllm_bi layout [N, W-1, D]
    st_vk = st_kv.transpose(-1, -2).contiguous()  # vllm_bi layout [N, HV, V, K]
    q, k, v, g, beta = _qkvgb(mixed, A_log, a, b, dt_bias)
    t_kernel = timed(lambda: bi_kernel(lens, q, k, v, g, beta, st_vk, mode), reps)
    t_core = timed(lambda: bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, st_vk, mode), reps)
    return t_kernel, t_core


def time_train(lens: list[int], mode: str, dev: str, reps: int) -> tuple[float | None, float | None, str]:
    """fwd+bwd milliseconds (wall, then GPU time: :func:`common.gpu_ms`) and the backward path; ``mode`` stock |
    recurrent | chunk."""
    from vllm_bi.gdn import recurrent as gr

    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev, grad=True)
    if mode == "stock":
        conv0 = torch.zeros(N, D, W, device=dev, dtype=torch.bfloat16)
        st_kv = torch.zeros(N, HV, K, V, device=dev)

        def step():
            o, _ = stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv, decode=False)
            o.float().square().mean().backward()
    else:
        conv_states = torch.zeros(N, W - 1, D, device=dev, dtype=torch.bfloat16)
        st_vk = torch.zeros(N, HV, V, K, device=dev)

        def step():
            # packed, as the trainer's model calls it (per-sequence slices cost the backward O(N x T))
            o, _, _ = bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, st_vk, mode, packed=True)
            o.float().square().mean().backward()

    gr._warned_fallback = False
    try:
        t = timed(step, reps, warmup=1)
    except RuntimeError as e:  # fla-core refuses its chunked backward on Hopper with Triton < 3.7.1, no tilelang
        return None, None, "refused: " + str(e).splitlines()[0][:60]
    return t, gpu_ms(step), "torch recurrence" if gr._warned_fallback else "fla chunked"


def _autotuned() -> str:
    """The configs fla-core's autotuner picked for the stock runs (before vllm_bi pins them)."""
    import importlib

    from triton.runtime.autotuner import Autotuner

    from vllm_bi.gdn.chunk import FLA_CHUNK_PINS

    out = []
    for mod, name in FLA_CHUNK_PINS:
        kern = getattr(importlib.import_module(mod), name)
        while not isinstance(kern, Autotuner) and hasattr(kern, "fn"):
            kern = kern.fn
        picks = sorted({str(c) for c in getattr(kern, "cache", {}).values()})
        out.append(f"- {name}: {'; '.join(picks) or 'not run'}")
    return "\n".join(out)


class Report:
    """The output: printed and, with ``--out``, rewritten after every row (a cut run keeps what it measured)."""

    def __init__(self, path: str | None):
        self.path, self.lines = path, []

    def add(self, *lines: str) -> None:
        self.lines += lines
        for line in lines:
            print(line, flush=True)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def forward_tables(rep: Report, shapes: list[Shape], dev: str, reps: int) -> None:
    # stock first: the chunk mode pins fla-core's kernels process-wide, which would change the stock runs
    stock = {sh.label: time_stock_forward(sh, dev, reps) for sh in shapes}
    rep.add("| shape | stock | recurrent kernel | ratio | chunk kernel | ratio | recurrent core | ratio | "
            "chunk core | ratio | recurrent server | ratio | chunk server | ratio |",
            "| --- |" + " ---: |" * 13)
    tuned = _autotuned()
    gpu_rows = []
    for sh in shapes:
        rk, rc = time_bi_forward(sh, "recurrent", dev, reps)
        ck, cc = time_bi_forward(sh, "chunk", dev, reps)
        servers = [time_server_core(sh, m, dev, reps) for m in ("recurrent", "chunk")]
        s, s_gpu = stock[sh.label]
        rep.add(f"| {sh.label} | {s:.3f} | " + " | ".join(
            f"{t:.3f} | {t / s:.2f}x" for t in (rk, ck, rc, cc, *(w for w, _ in servers))) + " |")
        gpu_rows.append(f"| {sh.label} | {s_gpu:.3f} | " + " | ".join(
            f"{g:.3f} | {g / s_gpu:.2f}x" for _, g in servers) + " |")
    # a decode step replayed in a CUDA graph (VLLM_BI_CUDA_GRAPHS=decode, stock's default) pays no host time
    rep.add("", "GPU time (kernels and copies, torch.profiler; host gaps excluded, as in a replayed CUDA graph):", "",
            "| shape | stock | recurrent server | ratio | chunk server | ratio |",
            "| --- |" + " ---: |" * 5, *gpu_rows)
    _configs(rep, tuned)


def train_tables(rep: Report, train: list, dev: str, reps: int) -> None:
    stock = {}
    for label, lens in train:  # first use compiles fla-core's backward (tilelang on Hopper): say what is done
        t0 = time.time()
        stock[label] = time_train(lens, "stock", dev, reps)
        print(f"[train] stock {label}: {ms_cell(stock[label][0])} ms ({time.time() - t0:.0f} s with compiles)",
              flush=True)
    tuned = _autotuned()
    rep.add("Wall: CUDA events around the step (host "
            "time included: at these sizes the step is host-bound and the wall ratio follows host noise). GPU: "
            "the kernels' and copies' device time per step (torch.profiler), host gaps excluded.", "",
            "| trainer fwd+bwd | stock | recurrent BI | ratio | chunk BI | ratio | "
            "GPU ms: stock | recurrent | ratio | chunk | ratio | "
            "backward (stock; recurrent; chunk) |",
            "| --- |" + " ---: |" * 10 + " --- |")
    slow = False  # the torch-recurrence backward ran (fla-core refused its own): too slow for 64K tokens
    for label, lens in train:
        if slow and len(lens) > 16:
            rep.add(f"| {label} | skipped: the BI backward runs the torch recurrence here |")
            continue
        runs = [stock[label]] + [time_train(lens, m, dev, reps) for m in ("recurrent", "chunk")]
        slow = slow or any(p == "torch recurrence" for _, _, p in runs)
        (ts, gs, _) = runs[0]
        wall = " | ".join(f"{ms_cell(t)} | {ratio_cell(t, ts)}" for t, _, _ in runs[1:])
        gpu = " | ".join(f"{ms_cell(g)} | {ratio_cell(g, gs)}" for _, g, _ in runs[1:])
        rep.add(f"| {label} | {ms_cell(ts)} | {wall} | {ms_cell(gs)} | {gpu} | {'; '.join(p for _, _, p in runs)} |")
    _configs(rep, tuned)


HIDDEN = 4096  # Qwen3.5-9B hidden size


def _projections(dev):
    """Random bf16 weights of the GDN layer's projections: in_proj_qkvz (q, k, v, z), in_proj_ba, out_proj."""
    g = torch.Generator(device="cpu").manual_seed(1)
    w = {"qkvz": (D + VAL, HIDDEN), "ba": (2 * HV, HIDDEN), "out": (HIDDEN, VAL)}
    return {k: (torch.randn(*shape, generator=g) * 0.02).bfloat16().to(dev) for k, shape in w.items()}


def time_layer(shape: Shape, mode: str, gemm: str, dev: str, reps: int) -> float:
    """One GDN layer without its gated output norm: in-projections, the core, out-projection. ``mode`` stock
    (cuBLAS bf16 GEMMs, fla-core core) or recurrent | chunk (``bi_linear`` with ``VLLM_BI_GEMM=gemm``, vllm_bi's
    core). Decode in the chunk mode: the GEMMs see the new tokens, the core recomputes the partial block."""
    import os

    from vllm_bi.ops.linear import bi_linear

    W_ = _projections(dev)
    T_new = sum(shape.lens)
    h = (torch.randn(T_new, HIDDEN, device=dev) * 0.5).bfloat16()
    core_lens = shape.chunk_lens if mode == "chunk" else shape.lens
    mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv = _forward_inputs(core_lens, shape.decode, dev)
    if mode == "stock":
        def run():
            qkvz = torch.mm(h, W_["qkvz"].t())
            torch.mm(h, W_["ba"].t())
            o, _ = stock_core(shape.lens, qkvz[:, :D].contiguous(), conv_w, A_log, a, b, dt_bias, conv0, st_kv,
                              shape.decode)
            return torch.mm(o.reshape(T_new, VAL), W_["out"].t())
        return timed(run, reps)
    os.environ["VLLM_BI_GEMM"] = gemm
    reload_settings()
    conv_states = conv0[:, :, 1:].transpose(1, 2).contiguous()
    st_vk = st_kv.transpose(-1, -2).contiguous()

    def run():
        qkvz = bi_linear(h, W_["qkvz"])
        bi_linear(h, W_["ba"])
        # the core's rows: the new tokens' projections (prefill), or the cached partial block + new token (chunk
        # decode, whose cached rows the server gathers from its history)
        x = qkvz[:, :D] if mode != "chunk" or not shape.decode else mixed
        outs, _, _ = bi_core(core_lens, x, conv_w, A_log, a, b, dt_bias, conv_states, st_vk, mode)
        o = torch.cat(outs) if mode != "chunk" or not shape.decode else torch.cat([t[-1:] for t in outs])
        return bi_linear(o.reshape(T_new, VAL), W_["out"])

    try:
        return timed(run, reps)
    finally:
        os.environ.pop("VLLM_BI_GEMM", None)
        reload_settings()


def layer_tables(rep: Report, shapes: list[Shape], dev: str, reps: int) -> None:
    stock = {sh.label: time_layer(sh, "stock", "", dev, reps) for sh in shapes}
    rep.add("| shape | stock | chunk, fp64 GEMM | ratio | chunk, Triton GEMM | ratio | recurrent, Triton GEMM | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sh in shapes:
        s = stock[sh.label]
        c64 = time_layer(sh, "chunk", "fp64", dev, reps)
        ctr = time_layer(sh, "chunk", "triton", dev, reps)
        rtr = time_layer(sh, "recurrent", "triton", dev, reps)
        rep.add(f"| {sh.label} | {s:.3f} | {c64:.3f} | {c64 / s:.2f}x | {ctr:.3f} | {ctr / s:.2f}x | {rtr:.3f} | "
                f"{rtr / s:.2f}x |")


def _configs(rep: Report, tuned: str) -> None:
    from vllm_bi.gdn.chunk import pin_fla_chunk_configs

    rep.add("", "fla-core configs autotuning picked for the stock runs:", tuned, "", "configs the chunk mode pins:",
            *[f"- {k}: {v}" for k, v in pin_fla_chunk_configs().items()], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the tables to this file (rewritten after each row)")
    ap.add_argument("--part", default="forward", choices=["forward", "train", "layer"],
                    help="forward: prefill and decode rows of the GDN core; train: forward+backward rows; layer: "
                         "the whole layer with its projections (cuBLAS vs the BI GEMMs). One per process: the "
                         "stock runs must come before the chunk mode pins fla-core's kernels")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer runs (a smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rows", default=None,
                    help="only the rows whose label contains one of these comma-separated strings (e.g. 'decode')")
    ap.add_argument("--partial", type=int, default=32,
                    help="decode rows: tokens of the partial block the chunk mode recomputes (mean 32, worst 63)")
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    p = args.partial
    shapes = [Shape("prefill 1x16K", [16384]), Shape("prefill 8x8K", [8192] * 8), Shape("prefill 64x1K", [1024] * 64),
              Shape("decode 1", [1], True, p), Shape("decode 16", [1] * 16, True, p),
              Shape("decode 256", [1] * 256, True, p), Shape("decode 256, partial 63 (worst)", [1] * 256, True, 63)]
    # the torch-recurrence backward (where fla-core refuses its chunked one) keeps every step's state: 4K tokens
    # the three shapes of the per-layer cost targets, then an RL-sized batch (many sequences: the recurrent
    # kernel of the recurrent mode runs sequences in parallel, tokens in order)
    train = [("train 1x4K", [4096]), ("train 4x1K", [1024] * 4), ("train 16x256", [256] * 16),
             ("train 64x1K (RL batch)", [1024] * 64)]
    if args.quick:
        shapes = [Shape("prefill 4x512", [512] * 4), Shape("decode 16", [1] * 16, True, p)]
        train = [("train 2x256", [256] * 2)]
    if args.rows:
        keep = [w.strip() for w in args.rows.split(",") if w.strip()]
        shapes = [sh for sh in shapes if any(w in sh.label for w in keep)]
        train = [t for t in train if any(w in t[0] for w in keep)]
        if not (shapes if args.part != "train" else train):
            ap.error(f"--rows {args.rows!r} selects no row of --part {args.part}")
    rep = Report(args.out)
    rep.add(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; GDN core at Qwen3.5-9B dims "
            f"(H={H}, HV={HV}, K=V={K}); median ms of {args.reps}; "
            "ratios are BI / stock. Decode rows: stock and recurrent run 1 token per sequence, the chunk mode "
            f"{p} + 1 (the partial block it recomputes) unless the row says otherwise.", "")
    if args.part == "forward":
        forward_tables(rep, shapes, dev, args.reps)
    elif args.part == "layer":
        layer_tables(rep, shapes, dev, args.reps)
    else:
        train_tables(rep, train, dev, args.reps)


if __name__ == "__main__":
    main()
