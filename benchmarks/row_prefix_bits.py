"""Does a row of fla-core's chunk pipeline keep its bits whatever rows follow it in its block? (CUDA, Qwen3.5-9B GDN
dimensions.) If it does, the chunk mode's decode could keep each block row's ``w``, ``u`` and normalised ``k``
between steps and compute only its new rows (docs/performance.md, "Chunk-mode decode").

    python benchmarks/row_prefix_bits.py [--batch 64] [--cuts 1,2,15,16,17,31,32,33,48,63] [--out table.md]

Each sequence is one block of random rows (q/k/v/gate inputs as after the conv). For every cut ``t`` the
same blocks are cut after ``t`` rows and run through the launches ``gdn_chunk_decode.partial_blocks_in_slots``
runs (``block_intermediates``: l2norm, ``chunk_local_cumsum``, ``chunk_gated_delta_rule_fwd_intra``, which is
the kkt solve and ``recompute_w_u``)
and through the partial-block kernel; rows ``< t`` are compared with the same blocks' at 63 rows (``torch.equal``). The
table prints, per cut and output, how many of the batch's blocks agree on every such row; the cut at 63 is the
reference itself, so its row must read N in every column.
"""

from __future__ import annotations

import argparse

import torch

from common import emit
from gdn_layer import H, HV, K, V


def stages(q, k, v, g, beta, pool, slots, lens: list[int]) -> dict[str, torch.Tensor]:
    """The decode pipeline's intermediate rows (packed) for blocks of ``lens`` rows."""
    from vllm_bi.gdn.chunk_decode import block_intermediates, partial_block_outputs

    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    qn, kn, gc, w, u, cu_t = block_intermediates(q, k, v, g, beta, cu)
    o = partial_block_outputs(qn, kn, w, u, gc, pool, slots, cu_t, K**-0.5)  # writes no state
    return dict(kn=kn, gc=gc, w=w, u=u, o=o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cuts", default="1,2,15,16,17,31,32,33,48,63")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    N, dev, B = args.batch, "cuda", 64
    T = N * B
    q, k = (torch.randn(T, H, K, device=dev).bfloat16() for _ in range(2))
    v = torch.randn(T, HV, V, device=dev).bfloat16()
    g = -torch.rand(T, HV, device=dev) * 0.2
    beta = torch.rand(T, HV, device=dev).bfloat16()
    pool = torch.randn(2 * N, HV, K, V, device=dev) * 0.1
    slots = torch.randperm(2 * N, device=dev)[:N]

    def cut_after(t: int) -> dict[str, torch.Tensor]:  # every block's first t rows
        rows = torch.arange(T, device=dev).view(N, B)[:, :t].reshape(-1)
        return stages(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, slots, [t] * N)

    # the reference: 63 rows per block (at 64 the partial-block kernel would also write the end state into the slot)
    full = cut_after(B - 1)
    names = list(full)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; {N} blocks at Qwen3.5-9B GDN dims; "
             "blocks (of N) whose rows < t equal those of the same blocks at 63 rows", "",
             "| cut t | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
    for t in [int(x) for x in args.cuts.split(",")]:
        cut = cut_after(t)
        cells = []
        for name in names:
            a = cut[name].reshape(N, t, -1)
            b = full[name].reshape(N, B - 1, -1)[:, :t]
            cells.append(str(sum(torch.equal(a[i], b[i]) for i in range(N))))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
