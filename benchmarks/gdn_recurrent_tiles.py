"""Benchmark: the recurrent GDN kernel's tiles (``VLLM_BI_GDN_TILE``) at Qwen3.5-9B's GDN dimensions.

    python benchmarks/gdn_recurrent_tiles.py [--tiles fla,32x2x3,...] [--state fp32,bf16] [--out tiles.md]
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
equal the ``fla`` tile's on a state of the same dtype (``= fla``; only ``fla`` itself must).

``--state``: the state pool's dtype per column, ``fp32`` (``VLLM_BI_GDN_STATE=fp32``, the default) and/or ``bf16``
(columns ``TILE+bf16``: the state rounded to bf16 after every token, half the traffic). Decode rows also time stock
vLLM's packed decode kernel (bf16 states, vLLM's ``[HV, V, K]`` slots) where vLLM is installed: the decode's bound.
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


def _inputs(lens, dev, seed=0, fresh=True, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, N = sum(lens), len(lens)
    q = torch.randn(T, H, K, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(T, H, K, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(T, HV, V, generator=g).to(dev, torch.bfloat16)
    gate = (-torch.rand(T, HV, generator=g) * 0.3).to(dev)
    beta = torch.rand(T, HV, generator=g).to(dev)
    pool = (torch.randn(2 * N + 1, HV, K, V, generator=g) * 0.1).to(dev, dtype)
    slots = (torch.randperm(2 * N, generator=g)[:N] + 1).to(dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    fr = torch.ones(N, dtype=torch.int32, device=dev) if fresh else None
    return q, k, v, gate, beta, pool, slots, cu, fr


def _consistency(tile, dev, length, dtype=torch.float32):
    """(whole == split == steps == speculative, bits == the fla tile's) for one sequence of ``length`` tokens."""
    from vllm_bi.gdn.slots import FLA_TILE, recurrent_in_slots

    q, k, v, g, beta, pool0, slots, cu, _ = _inputs([length], dev, seed=1, fresh=False, dtype=dtype)
    pool0 = torch.cat([pool0, torch.zeros(length, HV, K, V, device=dev, dtype=dtype)])  # the speculative path's slots
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


def _stock_decode(n, dev):
    """Stock vLLM's one-token GDN decode (its packed decode kernel: gates, l2norm and the update in one launch, bf16
    states updated in their slots), milliseconds; None without vLLM."""
    try:
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode
    except ImportError:
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    mixed = torch.randn(n, 2 * H * K + HV * V, generator=g).to(dev, torch.bfloat16)
    a, b = (torch.randn(n, HV, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.rand(HV, generator=g).to(dev), torch.rand(HV, generator=g).to(dev)
    pool = (torch.randn(2 * n + 1, HV, V, K, generator=g) * 0.1).to(dev, torch.bfloat16)
    slots = (torch.randperm(2 * n, generator=g)[:n] + 1).to(dev)
    out = torch.empty(n, 1, HV, V, device=dev, dtype=torch.bfloat16)

    def call():
        fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                                       scale=K**-0.5, initial_state=pool, out=out,
                                                       ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)

    return timed(call, reps=20, warmup=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="comma-separated VLLM_BI_GDN_TILE values (default: %(default)s)")
    ap.add_argument("--state", default="fp32", help="comma-separated state dtypes, fp32 and/or bf16 "
                    "(VLLM_BI_GDN_STATE; default: %(default)s)")
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
    states = list(dict.fromkeys(x.strip() for x in args.state.split(",") if x.strip()))
    if not states or set(states) - {"fp32", "bf16"}:
        ap.error(f"--state {args.state!r}: use fp32, bf16 or fp32,bf16")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu needs TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    dev = args.device
    globals().update(SMALL_DIMS if args.small else DIMS)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    tiles = {n + ("" if st == "fp32" else "+" + st): (parse_tile(n), st) for st in states for n in names}
    names = list(tiles)
    rows = [[name, *(_consistency(t, dev, 24 if args.small else 200, dtypes[st]))] for name, (t, st) in tiles.items()]
    lines = ["| tile | whole = split = steps = speculative | bits = fla |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'exact' if e else 'DIFFERS'} | {'yes' if s else 'no'} |" for n, e, s in rows]
    if args.small:
        emit("\n".join(lines) + "\n", args.out)
        return 0 if all(e for _, e, _ in rows) else 1
    shapes = [("prefill 1x16K", [16384], True), ("prefill 8x8K", [8192] * 8, True), ("prefill 64x1K", [1024] * 64, True),
              ("prefill 256x256", [256] * 256, True), ("decode 64", [1] * 64, False), ("decode 256", [1] * 256, False)]
    head = ("| shape | stock ms (fla-core chunk / vLLM packed decode) | " + " | ".join(f"{n} ms" for n in names)
            + " | best / fla | best / stock |")
    table = [head, "|" + " --- |" * (len(names) + 4)]
    for label, lens, fresh in shapes:
        inputs = {st: _inputs(lens, dev, fresh=fresh, dtype=dtypes[st]) for st in states}
        times = {}
        for n, (t, st) in tiles.items():
            q, k, v, g, beta, pool, slots, cu, fr = inputs[st]
            times[n] = timed(lambda t=t, pool=pool: recurrent_in_slots(q, k, v, g, beta, pool, slots, cu, K**-0.5, fr,
                                                                       tile=t),
                             reps=5 if sum(lens) > 4096 else 20, warmup=2)
        ref = _fla_chunk(lens, dev) if fresh else _stock_decode(len(lens), dev)
        best = min(times, key=times.get)
        table.append(f"| {label} | {ms_cell(ref)} | " + " | ".join(ms_cell(times[n]) for n in names)
                     + f" | {best}: {ratio_cell(times[best], times['fla'] if 'fla' in times else None)}"
                     + f" | {ratio_cell(times[best], ref)} |")
        print(table[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    text = ("Consistency (one sequence of 200 tokens, 9B GDN dims):\n\n" + "\n".join(lines)
            + "\n\nTimes (CUDA events, median; Qwen3.5-9B GDN dims H=16, HV=32, K=V=128):\n\n" + "\n".join(table) + "\n")
    text += f"\ntorch {torch.__version__}, device {torch.cuda.get_device_name()}\n"
    emit(text, args.out)
    return 0 if all(e for _, e, _ in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
