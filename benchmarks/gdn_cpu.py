"""Benchmark (CPU): the GDN core in vllm_bi's two modes, recurrent and chunk-aligned (``gdn_varlen``).

    python benchmarks/gdn_cpu.py [--threads N] [--out results.md]

Dimensions of the tiny test models (1 key / 2 value heads of 128, conv width 4) and of the ``wide`` spec
(4 / 8 heads). Rows: a prefill (one sequence of T tokens), a decode step of 16 sequences (recurrent: one
token each; chunk: each recomputes a 32-token partial block, the average fill), and a trainer
forward+backward over 8 sequences of 128 tokens. Median wall-clock ms of 5 runs after one warm-up.
"""

from __future__ import annotations

import argparse

import torch

from common import emit, host_ms

from vllm_bi.gdn.layer import gdn_varlen

DIMS = {"tiny (1/2 heads)": (1, 2), "wide (4/8 heads)": (4, 8)}
K = V = 128
W = 4


def _case(H, HV, lens, grad=False):
    D = 2 * H * K + HV * V
    T, n = sum(lens), len(lens)
    mixed = (torch.randn(T, D) * 0.5).bfloat16().requires_grad_(grad)
    w = (torch.randn(D, W) * 0.3).bfloat16()
    a, b = torch.randn(T, HV).bfloat16(), torch.randn(T, HV).bfloat16()
    A_log, dt_bias = torch.log(torch.rand(HV) * 15 + 1), torch.rand(HV) - 0.5
    ranges, s = [], 0
    for m in lens:
        ranges.append((s, s + m))
        s += m
    conv = torch.zeros(n, W - 1, D, dtype=torch.bfloat16)
    states = torch.zeros(n, HV, V, K)

    def run(mode):
        outs, _, _ = gdn_varlen(mixed, ranges, w, conv, A_log, a, b, dt_bias, states, H, K, V, mode=mode)
        if grad:
            torch.cat(outs).square().mean().backward()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms of 5\n",
            "| dims | work | recurrent (ms) | chunk (ms) | chunk / recurrent |", "| --- | --- | ---: | ---: | ---: |"]
    for name, (H, HV) in DIMS.items():
        cases = [("prefill 1x512", _case(H, HV, [512]), _case(H, HV, [512])),
                 ("decode 16 seqs", _case(H, HV, [1] * 16), _case(H, HV, [32] * 16)),
                 ("train fwd+bwd 8x128", _case(H, HV, [128] * 8, grad=True), _case(H, HV, [128] * 8, grad=True))]
        for label, rec, chk in cases:
            t_r, t_c = host_ms(lambda: rec("recurrent")), host_ms(lambda: chk("chunk"))
            rows.append(f"| {name} | {label} | {t_r:.1f} | {t_c:.1f} | {t_c / t_r:.2f}x |")
            print(rows[-1], flush=True)
    emit("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
