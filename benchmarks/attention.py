"""Benchmark: one attention layer's core at Qwen3.5-9B dimensions (16 query / 4 KV heads of dim 256) on CUDA:
vllm_bi's batch-invariant attention as the server runs it (``model_executor.attention.bi_attn_forward`` on a paged
cache), with its Triton kernel (``ops/attention_triton.py``, the CUDA default) and with the torch op
(``VLLM_BI_ATTENTION=torch``, ``ops/attention.py``), against PyTorch's fused ``scaled_dot_product_attention`` on
contiguous keys (a stand-in for a fused kernel such as vLLM's TRITON_ATTN; not batch-invariant). Each Triton row
also checks the first and last query rows computed alone (a one-row decode) against the batched bits. A second
table times the trainer's attention forward + backward against SDPA's, and a third the kernel's other block
sizes, warps and stages (each one is other arithmetic: other bits).

    python benchmarks/attention.py [--out attention.md] [--reps 10] [--no-torch-op] [--no-configs] [--no-train]

Rows: decode B sequences x 1 query at context C (every sequence the same length), and prefills of B x T tokens.
Median ms of CUDA-event timings after warm-ups.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from common import timed

from vllm_bi.settings import reload as reload_settings

H, HKV, D, BS = 16, 4, 256, 16
ROWS = [("decode 1 x ctx 1K", 1, 1, 1024), ("decode 16 x ctx 1K", 16, 1, 1024), ("decode 256 x ctx 1K", 256, 1, 1024),
        ("decode 64 x ctx 4K", 64, 1, 4096), ("prefill 1 x 4K", 1, 4096, 4096), ("prefill 8 x 1K", 8, 1024, 1024),
        ("prefill 1 x 16K", 1, 16384, 16384)]
TORCH_OP_MAX_ROWS = 4096  # the torch op at 16K query rows takes minutes
TRAIN_ROWS = [("train 1 x 4K", 1, 4096), ("train 4 x 1K", 4, 1024), ("train 16 x 256", 16, 256)]
CONFIGS = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 4, 2),
           (128, 64, 8, 3), (256, 32, 8, 2)]  # BLOCK_M, BLOCK_N, warps, stages


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


IMPL = SimpleNamespace(scale=D**-0.5, attn_type="decoder", alibi_slopes=None, sliding_window=None,
                       logits_soft_cap=None, sinks=None, kv_cache_dtype="auto")


def time_server(n_seqs, q_len, ctx, dev, reps, backend):
    """The server's attention call (``bi_attn_forward``) with ``VLLM_BI_ATTENTION=backend``; for the Triton kernel
    also whether the first and last rows computed alone give the batched bits."""
    from vllm_bi.model_executor.attention import bi_attn_forward

    os.environ["VLLM_BI_ATTENTION"] = backend
    reload_settings()
    cache, q, md = paged(n_seqs, q_len, ctx, dev)
    out = torch.empty_like(q)

    def run(md=md, q=q, out=out):
        for key in ("_vllm_bi_rows", "_vllm_bi_tiles"):  # a new step: its host reads again (once per step)
            md.__dict__.pop(key, None)
        return bi_attn_forward(IMPL, None, q, None, None, cache, md, out)

    ms = timed(run, reps)
    same = None
    if backend == "triton":
        full = run().clone()
        same = True
        for r in (0, q.shape[0] - 1):
            s, p = r // q_len, ctx - q_len + r % q_len
            one = SimpleNamespace(query_start_loc=torch.tensor([0, 1], device=dev),
                                  seq_lens=torch.tensor([p + 1], device=dev), block_table=md.block_table[s:s + 1],
                                  causal=True)
            same &= torch.equal(run(one, q[r:r + 1], torch.empty_like(q[r:r + 1]))[0], full[r])
    return ms, same


def time_sdpa(n_seqs, q_len, ctx, dev, reps):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(n_seqs, H, q_len, D, generator=g).bfloat16().to(dev)
    k = torch.randn(n_seqs, HKV, ctx, D, generator=g).bfloat16().to(dev).repeat_interleave(H // HKV, dim=1)
    v = torch.randn_like(k)
    causal = q_len > 1
    return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps)


def time_train(n_seqs, length, dev, reps):
    """Forward + backward ms of the trainer's attention (``packed_attention``: the Triton kernel forward, PyTorch's
    attention backward per sequence) and of SDPA on the same equal-length sequences (batched)."""
    from vllm_bi.ops.attention_triton import packed_attention

    g = torch.Generator(device="cpu").manual_seed(0)
    T = n_seqs * length
    q, gy = (torch.randn(T, H, D, generator=g).bfloat16().to(dev) for _ in range(2))
    k, v = (torch.randn(T, HKV, D, generator=g).bfloat16().to(dev) for _ in range(2))
    cu = [i * length for i in range(n_seqs + 1)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def ours():
        out = packed_attention(*leaves, cu, D**-0.5)
        torch.autograd.grad(out, leaves, gy)

    def batched(x):
        return x.view(n_seqs, length, x.shape[1], D).transpose(1, 2).contiguous().requires_grad_()

    qs, ks, vs = batched(q), batched(k), batched(v)
    gys = gy.view(n_seqs, length, H, D).transpose(1, 2)

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (qs, ks, vs), gys)

    return timed(sdpa, reps), timed(ours, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch-op", action="store_true", help="skip the torch op's column (slow)")
    ap.add_argument("--no-configs", action="store_true", help="skip the table of the kernel's other configs")
    ap.add_argument("--no-train", action="store_true", help="skip the trainer's forward + backward table")
    args = ap.parse_args()
    import vllm_bi.ops.attention_triton as A

    pin = (A.BLOCK_M, A.BLOCK_N, A.NUM_WARPS, A.NUM_STAGES)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; attention core at H={H}, Hkv={HKV}, "
             f"D={D}, cache block {BS}; kernel BLOCK_M {pin[0]}, BLOCK_N {pin[1]}, {pin[2]} warps, {pin[3]} "
             f"stages; median ms of {args.reps}", "",
             "| shape | SDPA (fused, not BI) | BI Triton kernel | ratio | rows alone == batched | BI torch op | ratio |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]

    def flush():
        print(lines[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    print("\n".join(lines[:-1]), flush=True)
    for label, n, ql, ctx in ROWS:
        s = time_sdpa(n, ql, ctx, "cuda", args.reps)
        t, same = time_server(n, ql, ctx, "cuda", args.reps, "triton")
        cells = f"| {label} | {s:.3f} | {t:.3f} | {t / s:.2f}x | {'yes' if same else '**NO**'} |"
        if args.no_torch_op or n * ql > TORCH_OP_MAX_ROWS:
            cells += " | |"
        else:
            b, _ = time_server(n, ql, ctx, "cuda", max(3, args.reps // 3), "torch")
            cells += f" {b:.3f} | {b / s:.1f}x |"
        lines.append(cells)
        flush()
    if not args.no_train:
        lines += ["", "trainer forward + backward (the kernel's forward, PyTorch's backward per sequence)", "",
                  "| shape | SDPA fwd+bwd | vllm_bi packed_attention fwd+bwd | ratio |", "| --- | ---: | ---: | ---: |"]
        print("\n".join(lines[-4:-1]), flush=True)
        for label, n, length in TRAIN_ROWS:
            s, t = time_train(n, length, "cuda", args.reps)
            lines.append(f"| {label} | {s:.3f} | {t:.3f} | {t / s:.2f}x |")
            flush()
    if not args.no_configs:
        lines += ["", "the kernel's configs (each other bits; the first is the pinned one)", "",
                  "| BLOCK_M, BLOCK_N, warps, stages | " + " | ".join(r[0] for r in ROWS) + " |",
                  "| --- |" + " ---: |" * len(ROWS)]
        print("\n".join(lines[-4:-1]), flush=True)
        for cfg in [pin] + [c for c in CONFIGS if c != pin]:
            A.BLOCK_M, A.BLOCK_N, A.NUM_WARPS, A.NUM_STAGES = cfg
            try:
                cells = [f"{time_server(n, ql, ctx, 'cuda', args.reps, 'triton')[0]:.3f}" for _, n, ql, ctx in ROWS]
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is a result
                cells = [f"fails: {type(e).__name__}"] + [""] * (len(ROWS) - 1)
            lines.append(f"| {', '.join(map(str, cfg))} | " + " | ".join(cells) + " |")
            flush()
        A.BLOCK_M, A.BLOCK_N, A.NUM_WARPS, A.NUM_STAGES = pin


if __name__ == "__main__":
    main()
