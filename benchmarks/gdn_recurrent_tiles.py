"""Benchmark: the recurrent GDN kernel's tiles (``VLLM_BI_GDN_TILE``) at Qwen3.5-9B's GDN dimensions.

    python benchmarks/gdn_recurrent_tiles.py [--tiles fla,32x2x3,...] [--out tiles.md]
    TRITON_INTERPRET=1 python benchmarks/gdn_recurrent_tiles.py --device cpu --small   # logic only, small dims

The recurrent mode walks every token of a prompt through the state, so its prefill costs 3-20x fla-core's chunked
kernels per layer (``docs/performance.md``). :func:`vllm_bi.gdn.slots.recurrent_in_slots` runs fla-core's launch
(``fla``: ``[K, 8]`` of the state per program, one warp) by default; other tiles give a program more values of the
state, more warps or other pipelining. Each tile has its own bits, which the trainer then reproduces by running the
same kernel.

Rows: prefill ``B x T`` (new sequences) and decode ``B x 1`` (states in shuffled slots). Columns: the median
milliseconds (CUDA events) per tile, its ratio to the ``fla`` tile, and, for prefills, fla-core's chunked kernel
(stock vLLM's GDN prefill arithmetic, states zero) for reference. Before timing, every tile is checked for the
property the mode rests on: a sequence run whole, run as a split prefill, and run as a prefill then one-token steps,
and through the speculative path, gives the same outputs and final state bit for bit (``exact``), and whether its bits
equal the ``fla`` tile's (``= fla``; only ``fla`` itself must).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from common import emit, ms_cell, ratio_cell, timed

DIMS = {"H": 16, "HV": 32, "K": 128, "V": 128}  # Qwen3.5-9B: 16 key heads, 32 value heads, head dim 128
SMALL_DIMS = {"H": 1, "HV": 2, "K": 16, "V": 16}  # --small: the logic in seconds through the interpreter

DEFAULT_TILES = "fla,16x1x1,16x1x2,16x1x3,16x1x4,16x2x2,32x1x2,32x1x3,8x1x3,64x4x3"
H = HV = K = V = 0  # set by main from DIMS or SMALL_DIMS


def _inputs(lens, dev, seed=0, fresh=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, N = sum(lens), len(lens)
    q = torch.randn(T, H, K, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(T, H, K, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(T, HV, V, generator=g).to(dev, torch.bfloat16)
    gate = (-torch.rand(T, HV, generator=g) * 0.3).to(dev)
    beta = torch.rand(T, HV, generator=g).to(dev)
    pool = (torch.randn(2 * N + 1, HV, K, V, generator=g) * 0.1).to(dev)
    slots = (torch.randperm(2 * N, generator=g)[:N] + 1).to(dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    fr = torch.ones(N, dtype=torch.int32, device=dev) if fresh else None
    return q, k, v, gate, beta, pool, slots, cu, fr


def _consistency(tile, dev, length):
    """(whole == split == steps == speculative, bits == the fla tile's) for one sequence of ``length`` tokens."""
    from vllm_bi.gdn.slots import FLA_TILE, recurrent_in_slots

    q, k, v, g, beta, pool0, slots, cu, _ = _inputs([length], dev, seed=1, fresh=False)
    pool0 = torch.cat([pool0, torch.zeros(length, HV, K, V, device=dev)])  # room for the speculative path's slots
    scale = K**-0.5

    def run(lo, hi, pool, t):
        return recurrent_in_slots(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, slots,
                                  torch.tensor([0, hi - lo], device=dev), scale, tile=t)

    whole_pool = pool0.clone()
    whole = run(0, length, whole_pool, tile)
    cut = length * 3 // 5
    split_pool = pool0.clone()
    split = torch.cat([run(0, cut, split_pool, tile), run(cut, length, split_pool, tile)])
    step_pool = pool0.clone()
    steps = torch.cat([run(0, cut, step_pool, tile)] + [run(t, t + 1, step_pool, tile) for t in range(cut, length)])
    spec_pool = pool0.clone()
    head = run(0, cut, spec_pool, tile)
    n = length - cut
    table = torch.arange(n, device=dev).view(1, n) + spec_pool.shape[0] - n  # the last n slots
    spec = recurrent_in_slots(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], spec_pool, slots,
                              torch.tensor([0, n], device=dev), scale, spec_slots=table, tile=tile)
    spec_final = spec_pool[int(table[0, -1])]
    final = whole_pool[slots[0]]
    exact = (torch.equal(whole, split) and torch.equal(whole, steps) and torch.equal(whole, torch.cat([head, spec]))
             and torch.equal(final, split_pool[slots[0]]) and torch.equal(final, step_pool[slots[0]])
             and torch.equal(final, spec_final))
    fla_pool = pool0.clone()
    same_as_fla = torch.equal(run(0, length, fla_pool, FLA_TILE), whole) and torch.equal(fla_pool, whole_pool)
    return exact, same_as_fla


def _fla_chunk(lens, dev):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    q, k, v, g, beta, pool, slots, cu, _ = _inputs(lens, dev)
    h0 = torch.zeros(len(lens), HV, K, V, device=dev)
    qq, kk = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))  # stock vLLM hands fla-core HV heads

    def call():
        chunk_gated_delta_rule(q=qq[None], k=kk[None], v=v[None], g=g[None], beta=beta[None], scale=K**-0.5,
                               initial_state=h0, output_final_state=True, cu_seqlens=cu,
                               use_qk_l2norm_in_kernel=True)

    return timed(call, reps=5, warmup=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="comma-separated VLLM_BI_GDN_TILE values (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes, no timing (with --device cpu)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    from vllm_bi.errors import UsageError
    from vllm_bi.gdn.slots import parse_tile, recurrent_in_slots
    from vllm_bi.settings import GDN_TILE_AUTO_CUDA, _tile_value

    try:
        names = [_tile_value(t, "--tiles") for t in args.tiles.split(",") if t.strip()]
        names = list(dict.fromkeys(GDN_TILE_AUTO_CUDA if n == "auto" else n for n in names))  # auto: CUDA's default
    except UsageError as e:
        ap.error(str(e))
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu needs TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    dev = args.device
    globals().update(SMALL_DIMS if args.small else DIMS)
    tiles = {n: parse_tile(n) for n in names}
    rows = [[name, *(_consistency(t, dev, 24 if args.small else 200))] for name, t in tiles.items()]
    lines = ["| tile | whole = split = steps = speculative | bits = fla |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'exact' if e else 'DIFFERS'} | {'yes' if s else 'no'} |" for n, e, s in rows]
    if args.small:
        emit("\n".join(lines) + "\n", args.out)
        return 0 if all(e for _, e, _ in rows) else 1
    shapes = [("prefill 1x16K", [16384], True), ("prefill 8x8K", [8192] * 8, True), ("prefill 64x1K", [1024] * 64, True),
              ("prefill 256x256", [256] * 256, True), ("decode 64", [1] * 64, False), ("decode 256", [1] * 256, False)]
    head = "| shape | fla-core chunk ms | " + " | ".join(f"{n} ms" for n in names) + " | best / fla |"
    table = [head, "|" + " --- |" * (len(names) + 3)]
    for label, lens, fresh in shapes:
        q, k, v, g, beta, pool, slots, cu, fr = _inputs(lens, dev, fresh=fresh)
        times = {}
        for n, t in tiles.items():
            times[n] = timed(lambda t=t: recurrent_in_slots(q, k, v, g, beta, pool, slots, cu, K**-0.5, fr, tile=t),
                             reps=5 if sum(lens) > 4096 else 20, warmup=2)
        ref = _fla_chunk(lens, dev) if fresh else None
        best = min(times, key=times.get)
        table.append(f"| {label} | {ms_cell(ref)} | " + " | ".join(ms_cell(times[n]) for n in names)
                     + f" | {best}: {ratio_cell(times[best], times['fla'] if 'fla' in times else None)} |")
        print(table[-1], flush=True)
        del q, k, v, g, beta, pool
        torch.cuda.empty_cache()
    text = ("Consistency (one sequence of 200 tokens, 9B GDN dims):\n\n" + "\n".join(lines)
            + "\n\nTimes (CUDA events, median; Qwen3.5-9B GDN dims H=16, HV=32, K=V=128):\n\n" + "\n".join(table) + "\n")
    text += f"\ntorch {torch.__version__}, device {torch.cuda.get_device_name()}\n"
    emit(text, args.out)
    return 0 if all(e for _, e, _ in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
