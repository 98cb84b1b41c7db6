"""Benchmark: one GDN layer core at Qwen3.5-9B dimensions (16 key / 32 value heads of dim 128, conv width 4),
stock (non-batch-invariant) vs vllm_bi's recurrent batch-invariant mode, on CUDA.

    python benchmarks/gdn_layer.py [--out results.md] [--quick]

"Core" is everything between the in-projection and the output norm: causal conv1d + SiLU, q/k/v split,
gating (g, beta), the delta-rule recurrence with per-sequence states. Rows:

* prefill B x T (new sequences, zero states) and decode B x 1 (existing states):
  - stock: fla-core ``causal_conv1d`` (varlen) + ``chunk_gated_delta_rule`` (prefill) or
    ``fused_recurrent_gated_delta_rule`` (decode), the kernels vLLM's GDN layer uses;
  - BI recurrence: vllm_bi's kernel call alone (``gdn_recurrent_varlen``: fla-core fused recurrent, explicit
    fp32 states) on the same q/k/v/g/beta;
  - BI core: ``gdn_varlen`` (what the server and the trainer run: per-sequence conv in torch + gating +
    the recurrence).
* trainer forward+backward B x T: stock = fla conv + chunk forward and backward; BI = ``gdn_varlen``
  forward (recurrent) and its backward (fla-core's chunked kernel, or the torch recurrence where fla-core
  refuses it; the table says which).

Median of N timed runs (CUDA events) after warm-ups; ratios are BI / stock.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import emit, timed

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

    from vllm_bi.attention.gdn_recurrent import gdn_gating

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


def bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, states):
    from vllm_bi.attention.gdn_recurrent import gdn_varlen

    ranges, s = [], 0
    for n in lens:
        ranges.append((s, s + n))
        s += n
    return gdn_varlen(mixed, ranges, conv_w, conv_states, A_log, a, b, dt_bias, states, H, K, V)


def bi_recurrence(lens, q, k, v, g, beta, states):
    from vllm_bi.attention.gdn_recurrent import gdn_recurrent_varlen

    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return gdn_recurrent_varlen(q, k, v, g, beta, states, cu)


def run_forward(label: str, lens: list[int], decode: bool, dev: str, reps: int) -> str:
    from vllm_bi.attention.gdn_recurrent import gdn_gating

    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev)
    conv0 = torch.randn(N, D, W, device=dev).bfloat16() * (1.0 if decode else 0.0)  # fla layout [N, D, W]
    conv_states = conv0[:, :, 1:].transpose(1, 2).contiguous()  # vllm_bi layout [N, W-1, D]
    st_kv = torch.randn(N, HV, K, V, device=dev) * (0.1 if decode else 0.0)  # fla layout
    st_vk = st_kv.transpose(-1, -2).contiguous()  # vllm_bi layout [N, HV, V, K]
    T = sum(lens)
    q = mixed[:, :KEY].reshape(T, H, K).contiguous()
    k = mixed[:, KEY:2 * KEY].reshape(T, H, K).contiguous()
    v = mixed[:, 2 * KEY:].reshape(T, HV, V).contiguous()
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    t_stock = timed(lambda: stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv, decode), reps)
    t_rec = timed(lambda: bi_recurrence(lens, q, k, v, g, beta, st_vk), reps)
    t_core = timed(lambda: bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, st_vk), reps)
    return (f"| {label} | {t_stock:.3f} | {t_rec:.3f} | {t_rec / t_stock:.2f}x | {t_core:.3f} | "
            f"{t_core / t_stock:.2f}x |")


def run_train(label: str, lens: list[int], dev: str, reps: int) -> str:
    from vllm_bi.attention import gdn_recurrent as gr

    N = len(lens)
    mixed, conv_w, A_log, a, b, dt_bias = _inputs(lens, dev, grad=True)
    conv0 = torch.zeros(N, D, W, device=dev, dtype=torch.bfloat16)
    st_kv = torch.zeros(N, HV, K, V, device=dev)
    conv_states = torch.zeros(N, W - 1, D, device=dev, dtype=torch.bfloat16)
    st_vk = torch.zeros(N, HV, V, K, device=dev)

    def stock():
        o, _ = stock_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv0, st_kv, decode=False)
        o.float().square().mean().backward()

    def bi():
        outs, _, _ = bi_core(lens, mixed, conv_w, A_log, a, b, dt_bias, conv_states, st_vk)
        torch.cat(outs).float().square().mean().backward()

    t_stock = timed(stock, reps, warmup=1)
    gr._warned_fallback = False
    t_bi = timed(bi, reps, warmup=1)
    path = "torch recurrence" if gr._warned_fallback else "fla chunked"
    return f"| {label} | {t_stock:.3f} | {t_bi:.3f} | {t_bi / t_stock:.2f}x | {path} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer runs (a smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    q = args.quick
    prefill = [("prefill 1x16K", [16384]), ("prefill 8x8K", [8192] * 8), ("prefill 64x1K", [1024] * 64)]
    decode = [("decode 1", [1]), ("decode 16", [1] * 16), ("decode 256", [1] * 256)]
    # 4K tokens each: the torch-recurrence backward keeps every step's state for autograd (~2 MB a token here)
    train = [("train 1x4K", [4096]), ("train 4x1K", [1024] * 4), ("train 16x256", [256] * 16)]
    if q:
        prefill, decode, train = [("prefill 4x512", [512] * 4)], [("decode 16", [1] * 16)], [("train 2x256", [256] * 2)]
    out = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; GDN core at Qwen3.5-9B dims "
           f"(H={H}, HV={HV}, K=V={K}); median ms of {args.reps}\n",
           "| shape | stock (ms) | BI recurrence (ms) | ratio | BI core (ms) | ratio |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, lens in prefill + decode:
        t0 = time.time()
        out.append(run_forward(label, lens, label.startswith("decode"), dev, args.reps))
        print(out[-1], f"({time.time() - t0:.0f} s)", flush=True)
    out += ["", "| trainer fwd+bwd | stock (ms) | BI (ms) | ratio | BI backward path |", "| --- | ---: | ---: | ---: | --- |"]
    for label, lens in train:
        t0 = time.time()
        out.append(run_train(label, lens, dev, max(3, args.reps // 3)))
        print(out[-1], f"({time.time() - t0:.0f} s)", flush=True)
    table = "\n".join(out) + "\n"
    emit(table, args.out)


if __name__ == "__main__":
    main()
