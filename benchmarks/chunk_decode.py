"""The chunk mode's decode core at Qwen3.5-9B GDN dimensions on CUDA: the current path (boundary states gathered
out of their slots, then fla-core's chunked kernel, ``gdn_chunk_varlen``) against the partial-block kernel
(``gdn_chunk_decode.partial_blocks_in_slots``: states read in their slots, one kernel for ``v_new`` and ``o``).

    python benchmarks/chunk_decode.py [--batches 1,16,256] [--rows 1,33,63,64] [--reps 20] [--out table.md]

Each row first checks that the two give the same bits (``torch.equal`` of every output row and, for 64 rows, where
every block completes, of the state each writes at its block's end; a row that differs is reported and not timed),
then prints each path's median wall time (CUDA events) and GPU time (``torch.profiler``:
what a step replayed in a CUDA graph pays). The rows are a decode batch of ``batch`` requests, each with a partial
block of ``rows`` tokens (the new token included). The q/k/v/gate inputs are random, as after the conv.
"""

from __future__ import annotations

import argparse

import torch

from common import emit, gpu_ms, timed
from gdn_layer import H, HV, K, V


def _inputs(batch: int, rows: int, dev: str):
    T = batch * rows
    q = torch.randn(T, H, K, device=dev).bfloat16()
    k = torch.randn(T, H, K, device=dev).bfloat16()
    v = torch.randn(T, HV, V, device=dev).bfloat16()
    g = -torch.rand(T, HV, device=dev) * 0.2
    beta = torch.rand(T, HV, device=dev).bfloat16()
    pool = torch.randn(2 * batch, HV, K, V, device=dev) * 0.1  # vLLM's slots, fla-core's state order
    slots = torch.randperm(2 * batch, device=dev)[:batch]
    return q, k, v, g, beta, pool, slots, [i * rows for i in range(batch + 1)]


def row(batch: int, rows: int, reps: int, dev: str = "cuda") -> str:
    from vllm_bi.gdn.chunk import CHUNK, gdn_chunk_varlen
    from vllm_bi.gdn.chunk_decode import partial_blocks_in_slots

    q, k, v, g, beta, pool, slots, cu = _inputs(batch, rows, dev)

    def current():  # the server's gather of the boundary states, the chunk mode's core, the new ones stored
        states = torch.index_select(pool, 0, slots).transpose(-1, -2)
        o, ends = gdn_chunk_varlen(q, k, v, g, beta, states, cu)
        if rows == CHUNK:
            pool.index_copy_(0, slots, ends.transpose(-1, -2))
        return o

    def in_slots():
        return partial_blocks_in_slots(q, k, v, g, beta, pool, slots, cu, K**-0.5)

    states = torch.index_select(pool, 0, slots).transpose(-1, -2)
    a, ends = gdn_chunk_varlen(q, k, v, g, beta, states, cu)
    pool0 = pool.clone()
    b = in_slots()
    if not torch.equal(a, b):
        bad = sum(not torch.equal(a[i * rows : (i + 1) * rows], b[i * rows : (i + 1) * rows]) for i in range(batch))
        return f"| {batch} x {rows} | **outputs differ** ({bad} of {batch} blocks) | | | | | |"
    want = ends.transpose(-1, -2) if rows == CHUNK else pool0[slots]
    if not torch.equal(pool[slots], want):
        bad = sum(not torch.equal(pool[slots[i]], want[i]) for i in range(batch))
        return f"| {batch} x {rows} | **states differ** ({bad} of {batch} slots) | | | | | |"
    t_cur, t_new = timed(current, reps), timed(in_slots, reps)
    g_cur, g_new = gpu_ms(current), gpu_ms(in_slots)
    return (f"| {batch} x {rows} | equal | {t_cur:.3f} | {t_new:.3f} ({t_new / t_cur:.2f}x) | {g_cur:.3f} | "
            f"{g_new:.3f} ({g_new / g_cur:.2f}x) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,256")
    ap.add_argument("--rows", default="1,33,63,64",
                    help="tokens of each request's partial block, the new one included (64: every block completes, "
                         "and the in-slots path also writes the state at its end)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; GDN core at Qwen3.5-9B dims "
             f"(H={H}, HV={HV}, K=V={K}); median ms of {args.reps}", "",
             "| batch x rows | bits | current wall | in-slots wall | current GPU | in-slots GPU |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for batch in (int(x) for x in args.batches.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            lines.append(row(batch, rows, args.reps))
            print(lines[-1], flush=True)
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
