"""Benchmark: one attention layer's core at Qwen3.5-9B dimensions (16 query / 4 KV heads of dim 256) on CUDA,
vllm_bi's batch-invariant paged attention (``model_executor.attention.bi_attn_forward``, what the server runs:
every query row of the step at once, each with its own keys gathered from the paged cache) against PyTorch's
fused ``scaled_dot_product_attention`` on contiguous keys (a stand-in for a fused kernel such as vLLM's
TRITON_ATTN; it is not batch-invariant), and against the candidate one-kernel paged attention
(``ops/attention_triton.py``, one program per query row and head), with a check of its bits alone vs batched.

    python benchmarks/attention.py [--out attention.md] [--reps 10]

Rows: decode B sequences x 1 query at context C (every sequence the same length), and one prefill of T tokens.
Median ms of CUDA-event timings after warm-ups.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from common import timed

H, HKV, D, BS = 16, 4, 256, 16
ROWS = [("decode 1 x ctx 1K", 1, 1, 1024), ("decode 16 x ctx 1K", 16, 1, 1024), ("decode 256 x ctx 1K", 256, 1, 1024),
        ("decode 64 x ctx 4K", 64, 1, 4096), ("prefill 1 x 4K", 1, 4096, 4096)]


def paged(n_seqs: int, q_len: int, ctx: int, dev: str):
    """A paged KV cache holding n_seqs sequences of ctx tokens, blocks shuffled; queries = the last q_len."""
    g = torch.Generator(device="cpu").manual_seed(0)
    nb = (ctx + BS - 1) // BS
    blocks = torch.randperm(n_seqs * nb + 1, generator=g)[1:].view(n_seqs, nb)  # block 0 unused (vLLM's null block)
    cache = torch.randn(n_seqs * nb + 1, HKV, BS, 2 * D, generator=g).bfloat16().to(dev)
    q = torch.randn(n_seqs * q_len, H * D, generator=g).bfloat16().to(dev)
    md = SimpleNamespace(query_start_loc=torch.arange(n_seqs + 1, device=dev) * q_len,
                         seq_lens=torch.full((n_seqs,), ctx, device=dev), block_table=blocks.int().to(dev),
                         causal=True)
    return cache, q, md


def time_bi(n_seqs, q_len, ctx, dev, reps):
    from vllm_bi.model_executor.attention import bi_attn_forward

    cache, q, md = paged(n_seqs, q_len, ctx, dev)
    impl = SimpleNamespace(scale=D**-0.5, attn_type="decoder", alibi_slopes=None, sliding_window=None,
                           logits_soft_cap=None, sinks=None, kv_cache_dtype="auto")
    out = torch.empty_like(q)

    def run():
        md.__dict__.pop("_vllm_bi_rows", None)  # a new step: its host reads again (once per step in the server)
        bi_attn_forward(impl, None, q, None, None, cache, md, out)

    return timed(run, reps)


def time_triton(n_seqs, q_len, ctx, dev, reps):
    """The candidate Triton kernel (``ops/attention_triton.paged_attention``, not wired in yet) on the same
    paged cache; also whether its first and last rows alone give the batched bits."""
    from vllm_bi.ops.attention_triton import paged_attention

    cache, q, md = paged(n_seqs, q_len, ctx, dev)
    q3 = q.view(-1, H, D)
    seq = torch.arange(n_seqs, device=dev).repeat_interleave(q_len)
    pos = (torch.arange(q_len, device=dev) + ctx - q_len).repeat(n_seqs)
    run = lambda: paged_attention(q3, seq, pos, md.block_table, cache, D**-0.5)  # noqa: E731
    full = run()
    same = all(torch.equal(paged_attention(q3[r:r + 1], seq[r:r + 1], pos[r:r + 1], md.block_table, cache, D**-0.5)[0],
                           full[r]) for r in (0, q3.shape[0] - 1))
    return timed(run, reps), same


def time_sdpa(n_seqs, q_len, ctx, dev, reps):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(n_seqs, H, q_len, D, generator=g).bfloat16().to(dev)
    k = torch.randn(n_seqs, HKV, ctx, D, generator=g).bfloat16().to(dev).repeat_interleave(H // HKV, dim=1)
    v = torch.randn_like(k)
    causal = q_len > 1
    return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; attention core at H={H}, Hkv={HKV}, "
             f"D={D}, block {BS}; median ms of {args.reps}", "",
             "| shape | SDPA (fused, not BI) | vllm_bi paged BI | ratio | Triton kernel (candidate) | ratio | "
             "its rows alone == batched |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    for label, n, ql, ctx in ROWS:
        s = time_sdpa(n, ql, ctx, "cuda", args.reps)
        b = time_bi(n, ql, ctx, "cuda", args.reps)
        t, same = time_triton(n, ql, ctx, "cuda", args.reps)
        lines.append(f"| {label} | {s:.3f} | {b:.3f} | {b / s:.1f}x | {t:.3f} | {t / s:.1f}x | {'yes' if same else '**NO**'} |")
        print(lines[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
