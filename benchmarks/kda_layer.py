"""Benchmark: one Kimi Delta Attention layer core at Kimi Linear 48B's dimensions (32 heads of dim 128, conv width 4),
vLLM's own KDA kernels (stock, not batch-invariant) against the server's batch-invariant glue.

    python benchmarks/kda_layer.py [--out kda.md] [--device cuda] [--reps 10]
    python benchmarks/kda_layer.py --device cpu --small      # the BI side only, small shapes (a smoke test)

"Core" is everything between the in-projection and the output norm: the short convolutions + SiLU, the per-key-channel
forget gate and beta, the delta-rule recurrence with each sequence's state in its cache slot. Rows: prefill B x T
(new sequences, zero states) and decode B x 1 (existing states).

* stock: the kernels vLLM 0.32's ``KimiGatedDeltaNetAttention`` runs on CUDA. Prefill: ``causal_conv1d_fn`` once per
  projection (q, k, v, each over its own conv state) + ``chunk_kda_with_fused_gate`` (initial states gathered from
  the slots, final states stored back). Decode: ``causal_conv1d_update`` over the packed q/k/v +
  ``fused_recurrent_kda_packed_decode`` (states read and written in their slots);
* BI: ``model_executor.gdn.bi_gdn_core`` as ``bi_kda_forward`` calls it, the recurrent GDN mode with KDA's gate
  (the only mode Kimi Linear serves on CUDA): conv states gathered from their slots, the packed conv, the gating, the
  in-place recurrence over the state slots (``gdn.slots.recurrent_in_slots``), the new conv states stored.

Each row has the wall time (median of CUDA events after warm-ups) and the GPU time (kernels and copies,
torch.profiler), and BI / stock for both. On CPU (``--device cpu``) only the BI side runs (vLLM's KDA kernels are
CUDA's), timed on the host clock.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
from unittest import mock

import torch

from common import emit, host_ms, ms_cell, ratio_cell

H, K, W = 32, 128, 4  # Kimi Linear 48B: 32 KDA heads of 128, short conv width 4
LOWER_BOUND = -5.0


@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    lens: tuple[int, ...]
    decode: bool


def shapes(small: bool) -> list[Shape]:
    if small:
        return [Shape("prefill 1x64", (64,), False), Shape("prefill 4x16", (16,) * 4, False),
                Shape("decode 8", (1,) * 8, True)]
    return [Shape("prefill 1x4K", (4096,), False), Shape("prefill 8x1K", (1024,) * 8, False),
            Shape("prefill 64x1K", (1024,) * 64, False), Shape("decode 64", (1,) * 64, True),
            Shape("decode 256", (1,) * 256, True)]


def _inputs(shape: Shape, heads: int, dim: int, dev: str, seed: int = 0):
    """The projections' outputs of one step (``mixed_qkv [T, 3 H K]`` bf16, forget-gate input ``a [T, H, K]``, raw
    beta ``b [T, H]``), the layer's parameters, and a cache of ``2 N`` slots (states ``[S, H, K, V]`` fp32, conv
    states ``[S, 3 H K, W - 1]``) of which the step's sequences own a shuffled half."""
    g = torch.Generator().manual_seed(seed)
    T, N, P = sum(shape.lens), len(shape.lens), heads * dim
    mixed = torch.randn(T, 3 * P, generator=g).bfloat16()
    a = (torch.randn(T, heads, dim, generator=g) * 2).bfloat16()
    b = torch.randn(T, heads, generator=g).bfloat16()
    conv_w = (torch.randn(3 * P, W, generator=g) * 0.4).bfloat16()
    A_log = torch.log(torch.rand(heads, generator=g) * 8 + 1)
    dt_bias = 0.3 * torch.randn(heads * dim, generator=g)
    ssm = torch.randn(2 * N, heads, dim, dim, generator=g) * 0.1
    conv = torch.randn(2 * N, 3 * P, W - 1, generator=g).bfloat16()
    slots = torch.randperm(2 * N, generator=g)[:N]
    qsl = torch.tensor([0, *torch.tensor(shape.lens).cumsum(0).tolist()], dtype=torch.int32)
    return {k: v.to(dev) for k, v in dict(mixed=mixed, a=a, b=b, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias,
                                          ssm=ssm, conv=conv, slots=slots, qsl=qsl).items()}


@contextlib.contextmanager
def bi_step(shape: Shape, heads: int, dim: int, dev: str):
    """The server's KDA glue for one layer and one scheduler step (``gdn.bi_gdn_core`` with a KDA layer, the recurrent
    mode), as a function of no arguments; the metadata and mode patches are entered once, around its calls. The
    step's plan is built on the first call and then shared, as the server shares it between layers."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm_bi.model_executor import gdn as G

    x = _inputs(shape, heads, dim, dev)
    N, T = len(shape.lens), sum(shape.lens)
    conv = x["conv"] if is_conv_state_dim_first() else x["conv"].transpose(1, 2).contiguous()
    layer = types.SimpleNamespace(
        kv_cache=(conv, x["ssm"]), conv1d=types.SimpleNamespace(weight=x["conv_w"][:, None, :]),
        f_b_proj=object(), local_num_heads=heads, head_dim=dim, gate_lower_bound=LOWER_BOUND, A_log=x["A_log"],
        dt_bias=x["dt_bias"], prefix="bench", num_spec=0)
    md = types.SimpleNamespace(
        num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None, non_spec_query_start_loc=x["qsl"],
        non_spec_state_indices_tensor=x["slots"], num_decodes=N if shape.decode else 0,
        num_prefills=0 if shape.decode else N, num_decode_tokens=N if shape.decode else 0,
        has_initial_state=torch.tensor([shape.decode] * N, device=dev),
        vllm_bi_num_computed=torch.tensor([64 if shape.decode else 0] * N, device=dev))
    out = torch.empty(T, heads, dim, device=dev, dtype=torch.bfloat16)

    def step():
        G.bi_gdn_core(layer, x["mixed"], x["b"], x["a"], out)

    with mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "gdn_mode",
                                                                               return_value="recurrent"):
        yield step


def stock_step(shape: Shape, heads: int, dim: int, dev: str):
    """vLLM's own KDA kernels for the same step (module doc), as a function of no arguments. CUDA only."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import (chunk_kda_with_fused_gate,
                                                                  fused_recurrent_kda_packed_decode)

    x = _inputs(shape, heads, dim, dev)
    P, N = heads * dim, len(shape.lens)
    state_kv = x["ssm"]  # the kernels' own slot order: the benchmark times, it compares no bits
    conv_state, conv_w = x["conv"], x["conv_w"]
    q_cs, k_cs, v_cs = conv_state.split(P, dim=-2)
    q_w, k_w, v_w = conv_w.split(P, dim=0)
    slots, qsl = x["slots"].to(torch.int32), x["qsl"]
    has_init = torch.tensor([shape.decode] * N, device=dev)
    g1, beta = x["a"][None], x["b"][None]

    if shape.decode:
        def step():
            mixed = causal_conv1d_update(x["mixed"], conv_state, conv_w, None, activation="silu",
                                         conv_state_indices=slots)
            fused_recurrent_kda_packed_decode(mixed_qkv=mixed, raw_g=g1, raw_beta=beta, A_log=x["A_log"],
                                              dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND, initial_state=state_kv,
                                              state_indices=slots)
        return step

    def conv(part, state, weight):
        return causal_conv1d_fn(part.transpose(0, 1), weight, None, conv_states=state, query_start_loc=qsl,
                                cache_indices=slots, has_initial_state=has_init, activation="silu").transpose(0, 1)

    def step():
        q, k, v = x["mixed"].split(P, dim=-1)
        q, k, v = (conv(t, s, w).reshape(1, -1, heads, dim) for t, s, w in ((q, q_cs, q_w), (k, k_cs, k_w),
                                                                             (v, v_cs, v_w)))
        init = state_kv[slots.long()]
        o, final = chunk_kda_with_fused_gate(q=q, k=k, v=v, raw_g=g1, raw_beta=beta, A_log=x["A_log"],
                                             g_bias=x["dt_bias"], lower_bound=LOWER_BOUND, initial_state=init,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                             cu_seqlens=qsl.long())
        state_kv[slots.long()] = final
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="4 heads of 32 and small shapes (a smoke test, CPU too)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu --small for the BI side alone")
    heads, dim = (4, 32) if args.small else (H, K)
    if dev == "cpu":
        from vllm_bi.model_executor import gdn as G

        G._in_place = lambda d: False  # noqa: SLF001 - CPU: the states gathered, run, stored (no Triton)
    lines = [f"# KDA layer core: {heads} heads x {dim}, conv width {W} ({dev}"
             + (f", {torch.cuda.get_device_name()}" if dev == "cuda" else "") + ")", "",
             "| shape | stock wall ms | BI wall ms | BI/stock wall | stock GPU ms | BI GPU ms | BI/stock GPU |",
             "|---|---|---|---|---|---|---|"]
    for shape in shapes(args.small):
        stock_wall = stock_gpu = bi_gpu = None
        if dev == "cuda":
            from common import gpu_ms, timed

            step = stock_step(shape, heads, dim, dev)
            stock_wall, stock_gpu = timed(step, args.reps), gpu_ms(step)
            with bi_step(shape, heads, dim, dev) as step:
                bi_wall, bi_gpu = timed(step, args.reps), gpu_ms(step)
        else:
            with bi_step(shape, heads, dim, dev) as step:
                bi_wall = host_ms(step, args.reps, warmup=2)
        lines.append(f"| {shape.label} | {ms_cell(stock_wall)} | {ms_cell(bi_wall)} | "
                     f"{ratio_cell(bi_wall, stock_wall)} | {ms_cell(stock_gpu)} | {ms_cell(bi_gpu)} | "
                     f"{ratio_cell(bi_gpu, stock_gpu)} |")
        print(lines[-1], flush=True)
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
