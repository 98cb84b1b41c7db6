"""Benchmark: what the bf16 GDN state (``VLLM_BI_GDN_STATE=bf16``) costs in accuracy, on CPU, one GDN layer.

    python benchmarks/gdn_state_error.py [--tokens 2048] [--dims 9b|small] [--seed 0] [--out error.md]

One sequence through the recurrence (``vllm_bi.gdn.recurrent.gdn_recurrent``) at Qwen3.5-9B's GDN dimensions (16 key /
32 value heads of 128), from random bf16 ``q``, ``k``, ``v`` and gates made as a Qwen3.5 layer makes them
(``g = -exp(A_log) * softplus(a + dt_bias)`` with ``A_log = log(U(1, 16))``, ``beta = sigmoid(b)``), against a float64
recurrence of the same inputs:

- ``fp32 state``: vllm_bi's default (fp32 between tokens);
- ``bf16 state``: rounded to bf16 after every token (``VLLM_BI_GDN_STATE=bf16``);
- ``fp32, bf16 cache every N``: fp32 between tokens, rounded to bf16 every N tokens: what stock vLLM's bf16 cache
  does to a prefill split into N-token steps (its decode is N = 1, the bf16 state's arithmetic);
- ``bf16 output rounding``: the float64 output rounded to bf16, the floor every row above shares (the layer's output
  is bf16).

Errors are relative to the largest float64 output of the span (max and mean over the span's elements), per span of
positions, and for the final state relative to its largest entry.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

DIMS = {"9b": (16, 32, 128, 128), "small": (2, 4, 16, 16)}


def _inputs(T, H, HV, K, V, seed):
    from vllm_bi.gdn.recurrent import gdn_gating

    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H, K, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(T, HV, V, generator=g).bfloat16()
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1)
    dt_bias = torch.randn(HV, generator=g) * 0.5
    a, b = torch.randn(T, HV, generator=g), torch.randn(T, HV, generator=g)
    gate, beta = gdn_gating(A_log, a, b, dt_bias)
    return q, k, v, gate, beta


def _run(inputs, HV, V, K, state_setting, cache_every=None):
    """Outputs ``[T, HV, V]`` and the final state of the CPU recurrence under ``VLLM_BI_GDN_STATE=state_setting``; with
    ``cache_every``, in calls of that many tokens, the state rounded to bf16 between them."""
    from vllm_bi import settings
    from vllm_bi.gdn.recurrent import gdn_recurrent

    os.environ["VLLM_BI_GDN_STATE"] = state_setting
    settings.reload()
    q, k, v, gate, beta = inputs
    T = q.shape[0]
    step = cache_every or T
    state, outs = torch.zeros(HV, V, K), []
    for s in range(0, T, step):
        o, state = gdn_recurrent(q[s:s + step], k[s:s + step], v[s:s + step], gate[s:s + step], beta[s:s + step], state)
        outs.append(o)
        if cache_every:
            state = state.bfloat16().float()
    return torch.cat(outs), state


def _reference(inputs, HV, V, K):
    from vllm_bi.gdn.recurrent import gdn_torch_varlen

    q, k, v, gate, beta = (x.double() for x in inputs)
    T = q.shape[0]
    o, final = gdn_torch_varlen(q[None], k[None], v[None], gate[None], beta[None], torch.zeros(1, HV, K, V,
                                dtype=torch.float64), torch.tensor([0, T]), q.shape[-1] ** -0.5)
    return o[0], final[0].transpose(-1, -2)  # [T, HV, V], [HV, V, K]


def _errors(o, ref, spans):
    cells = []
    for lo, hi in spans:
        r = ref[lo:hi]
        d = (o[lo:hi].double() - r).abs() / r.abs().max()
        cells.append(f"{float(d.max()):.2e} / {float(d.mean()):.2e}")
    return cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dims", choices=sorted(DIMS), default="9b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-every", default="512,64", help="N values of the 'bf16 cache every N' rows (default: %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    try:
        every = [int(x) for x in args.cache_every.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--cache-every {args.cache_every!r}: comma-separated token counts, e.g. 512,64")
    if args.tokens < 4 or any(n < 1 for n in every):
        ap.error("--tokens must be at least 4 and every --cache-every at least 1")
    from common import emit

    H, HV, K, V = DIMS[args.dims]
    T = args.tokens
    t0 = time.time()
    inputs = _inputs(T, H, HV, K, V, args.seed)
    ref_o, ref_s = _reference(inputs, HV, V, K)
    bounds = [0, min(64, T), min(256, T), min(1024, T), T]
    spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    rows = [("fp32 state (default)", "fp32", None), ("bf16 state (VLLM_BI_GDN_STATE=bf16)", "bf16", None)]
    rows += [(f"fp32, bf16 cache every {n} (stock's prefill split into {n}-token steps)", "fp32", n) for n in every]
    head = ("| state | " + " | ".join(f"output, positions {lo}-{hi - 1} (max / mean)" for lo, hi in spans)
            + " | final state (max / mean) |")
    lines = [head, "|" + " --- |" * (len(spans) + 2)]
    for label, setting, n in rows:
        o, st = _run(inputs, HV, V, K, setting, n)
        ds = (st.double() - ref_s).abs() / ref_s.abs().max()
        lines.append(f"| {label} | " + " | ".join(_errors(o, ref_o, spans))
                     + f" | {float(ds.max()):.2e} / {float(ds.mean()):.2e} |")
        print(lines[-1], flush=True)
    lines.append("| bf16 output rounding (the floor) | " + " | ".join(_errors(ref_o.bfloat16(), ref_o, spans)) + " | |")
    text = (f"One GDN layer, {T} tokens, H={H}, HV={HV}, K={K}, V={V}, seed {args.seed}; error relative to the span's "
            f"largest float64 value; torch {torch.__version__}, CPU, {time.time() - t0:.0f} s\n\n" + "\n".join(lines) + "\n")
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
