"""Probe: which configs of fla-core's autotuned chunked-GDN kernels change the bits of the chunk mode's output.

The chunk-aligned mode pins every autotuned kernel of fla-core's chunked forward to one config
(``vllm_bi.gdn.chunk.FLA_CHUNK_PINS``), because a config can change a kernel's reduction order. If
all configs of a kernel (or a class of them) give the same bits, that kernel could keep choosing among them per
shape, for speed, without breaking batch invariance. For each pinned kernel, this script runs
``gdn_chunk_varlen`` (the chunk mode's CUDA path) with that kernel set to each of its own configs in turn,
the others at their pins. It compares outputs and boundary states with the all-pinned run (``torch.equal``),
and times each.

    python benchmarks/fla_config_bits.py [--out bits.md] [--kernels h,kkt] [--budget-s 400]

Shapes at Qwen3.5-9B GDN dims: a varlen prefill (lengths 2000, 1000, 700, 300, 100, 37, 1) and a decode batch
(256 sequences of 33 rows: the partial block plus the new token). A kernel row prints as soon as it is done,
and the table is rewritten to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from common import timed

H, HV, K, V = 16, 32, 128, 128
SHAPES = {"prefill varlen": [2000, 1000, 700, 300, 100, 37, 1], "decode 256x33": [33] * 256}
SHORT = {"cumsum": "chunk_local_cumsum_scalar_kernel", "kkt": "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
         "wu": "recompute_w_u_fwd_kernel", "h": "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
         "o": "chunk_fwd_kernel_o", "l2": "l2norm_fwd_kernel", "l2row": "l2norm_fwd_kernel_row"}


def inputs(lens: list[int], dev: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    T, N = sum(lens), len(lens)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    q, k = r(T, H, K).bfloat16(), r(T, H, K).bfloat16()
    v = r(T, HV, V).bfloat16()
    gate = -torch.nn.functional.softplus(r(T, HV)) * 0.5  # log decay < 0
    beta = torch.sigmoid(r(T, HV)).bfloat16()
    states = r(N, HV, V, K, scale=0.1)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return q, k, v, gate, beta, states, cu


def autotuners() -> dict:
    """{kernel name: (Autotuner, its full config list)}, read before the chunk mode pins them."""
    from triton.runtime.autotuner import Autotuner

    from vllm_bi.gdn.chunk import FLA_CHUNK_PINS

    out = {}
    for mod, name in FLA_CHUNK_PINS:
        kern = getattr(importlib.import_module(mod), name)
        while not isinstance(kern, Autotuner) and hasattr(kern, "fn"):
            kern = kern.fn
        out[name] = (kern, list(kern.configs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", default=",".join(SHORT), help=f"which pinned kernels to vary: {','.join(SHORT)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting new configs after this many seconds")
    args = ap.parse_args()
    from vllm_bi.gdn.chunk import gdn_chunk_varlen, pin_fla_chunk_configs

    t_start = time.time()
    tuners = autotuners()
    pins = pin_fla_chunk_configs()
    data = {label: inputs(lens, "cuda") for label, lens in SHAPES.items()}

    def run(label):
        q, k, v, gate, beta, states, cu = data[label]
        return gdn_chunk_varlen(q, k, v, gate, beta, states, cu)

    base = {label: [t.clone() for t in run(label)] for label in SHAPES}
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; fla-core chunked GDN forward "
             f"(vllm_bi chunk mode) at H={H}, HV={HV}, K=V={K}; 'equal' = output and boundary states "
             "torch.equal to the all-pinned run; ms = median of the chunk call",
             "", "| kernel | config | pinned | " + " | ".join(f"{s}: equal | ms" for s in SHAPES) + " |",
             "| --- | --- | --- |" + " --- | ---: |" * len(SHAPES)]

    def emit(line=None):
        if line is not None:
            lines.append(line)
            print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    emit()
    for short in args.kernels.split(","):
        name = SHORT[short.strip()]
        kern, configs = tuners[name]
        pinned = kern.configs
        try:
            for cfg in configs:
                if time.time() - t_start > args.budget_s:
                    emit(f"| {name} | (stopped: --budget-s {args.budget_s:.0f} reached) | | " + " | ".join(
                        "" for _ in SHAPES) + " |")
                    return
                kern.configs = [cfg]
                kern.cache.clear()
                cells = []
                for label in SHAPES:
                    try:
                        got = run(label)
                        same = all(torch.equal(a, b) for a, b in zip(got, base[label]))
                        cells.append(f"{'yes' if same else '**no**'} | {timed(lambda: run(label), args.reps):.3f}")
                    except Exception as e:  # noqa: BLE001 - a config that cannot run on this shape is reported
                        cells.append(f"error: {type(e).__name__} | ")
                emit(f"| {name} | {cfg} | {'yes' if str(cfg) == pins.get(name) else ''} | " + " | ".join(cells) + " |")
        finally:
            kern.configs = pinned
            kern.cache.clear()
    emit(f"\n{time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
