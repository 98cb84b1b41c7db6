"""Launch settings of the chunk mode's two decode kernels at Qwen3.5-9B GDN dimensions on CUDA, a 256 x 33 decode
step (the mean partial block): the ring conv (``ops.conv.ring_causal_conv1d``: tokens x channels per program, warps)
and the partial-block kernel (``gdn_chunk_decode.PARTIAL_LAUNCH``: warps, pipeline stages, and whether a program
takes a key head's value heads and every value tile); and, at 64 rows per request (every block completes), the
block-state kernel (``gdn_chunk_decode.STATE_LAUNCH``). The GPU ms of the partial-block rows and the block-state rows
are those of ``partial_blocks_in_slots`` whole (fla-core's launches before the kernels included).

    python benchmarks/decode_tiles.py [--batch 256] [--rows 33] [--out table.md]

Each setting is first checked to give the first setting's bits (``torch.equal`` of every output; a setting that
differs is reported and not timed, and must not be used), then timed: GPU time from ``torch.profiler``.
"""

from __future__ import annotations

import argparse

import torch

from common import emit, gpu_ms
from gdn_layer import H, HV, K, V

CONV_BLOCKS = [(16, 256, 4), (4, 256, 4), (8, 256, 4), (32, 256, 4), (4, 512, 4), (8, 512, 4), (8, 128, 4),
               (16, 128, 4), (32, 128, 4), (64, 64, 4), (4, 256, 2), (8, 256, 2), (16, 128, 2), (16, 256, 8),
               (32, 256, 8), (8, 512, 8), (16, 512, 8), (64, 128, 8), (4, 1024, 8)]
# gdn_chunk_decode.PARTIAL_LAUNCH settings (group: a key head's value heads in one program, all_v: every value tile
# in one program); the first is the reference
PARTIAL = [dict(num_warps=w, num_stages=st, group=gr, all_v=av) for w, st, gr, av in (
    (4, 3, False, True), (4, 3, False, False), (4, 2, False, False), (8, 2, False, False), (4, 3, True, False),
    (8, 3, True, False), (4, 1, False, True), (4, 2, False, True), (4, 4, False, True), (2, 3, False, True),
    (8, 3, False, True), (4, 3, True, True), (8, 3, True, True), (2, 2, True, True))]
# gdn_chunk_decode.STATE_LAUNCH settings (the block-state kernel), timed at 64 rows per request; the first is the
# reference
STATE = [dict(num_warps=w, num_stages=st) for w, st in ((4, 4), (4, 3), (4, 2), (8, 4), (8, 2))]


def conv_rows(batch: int, rows: int, dev: str) -> list[str]:
    from vllm_bi.ops.conv import ring_causal_conv1d

    W, R, D = 4, 67, 2 * H * K + HV * V
    ring = torch.randn(2 * batch, R, D + 2 * HV, device=dev).bfloat16()
    weight = (torch.randn(D, W, device=dev) * 0.5).bfloat16()
    slots = torch.randperm(2 * batch, device=dev)[:batch]
    start = torch.randint(0, R, (batch,), device=dev)
    per = W - 1 + rows
    ext = (slots[:, None] * R + (start[:, None] + torch.arange(per, device=dev)) % R).reshape(-1)
    seq = torch.arange(batch, device=dev).repeat_interleave(rows)
    ref = ring_causal_conv1d(ring, ext, seq, weight, True, H * K, CONV_BLOCKS[0])  # the plain conv's tiles
    out = []
    for blocks in CONV_BLOCKS:
        got = ring_causal_conv1d(ring, ext, seq, weight, True, H * K, blocks)
        if not all(torch.equal(a, b) for a, b in zip(got, ref)):
            out.append(f"| ring conv | {blocks} | **differs** | |")
            continue
        ms = gpu_ms(lambda: ring_causal_conv1d(ring, ext, seq, weight, True, H * K, blocks))
        out.append(f"| ring conv | {blocks} | equal | {ms:.3f} |")
    return out


def launch_rows(kernel: str, attr: str, settings: list[dict], batch: int, rows: int, dev: str) -> list[str]:
    """``partial_blocks_in_slots`` on ``batch`` blocks of ``rows`` rows under each of ``settings`` for
    ``gdn_chunk_decode.<attr>``, each run from the same state pool: its outputs and the pool after it (at 64 rows
    the block-state kernel writes each block's end state into its slot) must equal the first setting's, or the row
    says it differs and is not timed. The timed calls keep writing into one pool (the values change, the work does
    not)."""
    from chunk_decode import _inputs

    from vllm_bi.gdn import chunk_decode as CD

    q, k, v, g, beta, pool0, slots, cu = _inputs(batch, rows, dev)
    saved = dict(getattr(CD, attr))

    def run(pool):
        return CD.partial_blocks_in_slots(q, k, v, g, beta, pool, slots, cu, K**-0.5)

    out, ref = [], None
    try:
        for setting in settings:
            setattr(CD, attr, dict(setting))
            name = ", ".join(k if v is True else f"{k} {v}" for k, v in setting.items() if v is not False)
            pool = pool0.clone()
            got = (run(pool), pool)
            ref = ref or tuple(t.clone() for t in got)  # the timed calls below write into this pool
            if not all(torch.equal(x, y) for x, y in zip(got, ref)):
                out.append(f"| {kernel} | {name} | **differs** | |")
                continue
            out.append(f"| {kernel} | {name} | equal | {gpu_ms(lambda: run(pool)):.3f} |")
    finally:
        setattr(CD, attr, saved)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rows", type=int, default=33)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.batch} x {args.rows} decode "
             f"rows at Qwen3.5-9B GDN dims; GPU ms (the first row of each kernel is the reference setting)", "",
             "| kernel | setting | bits | GPU ms |", "| --- | --- | --- | ---: |",
             *conv_rows(args.batch, args.rows, "cuda"),
             *launch_rows("partial block", "PARTIAL_LAUNCH", PARTIAL, args.batch, args.rows, "cuda"),
             *launch_rows("block state (64 rows)", "STATE_LAUNCH", STATE, args.batch, 64, "cuda")]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
