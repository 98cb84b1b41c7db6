"""Benchmark: the routed experts of one MoE layer, batch-invariant vs stock vLLM, on the GPU.

    python benchmarks/moe_layer.py [--experts 256] [--top-k 8] [--hidden 2048] [--intermediate 512]
                                   [--tokens 1,16,64,256,1024,4096] [--reps 10] [--out moe.md]

Defaults: Qwen3.5-MoE-like routing (256 experts, top-8, hidden 2048, expert MLP 512; Qwen3-Next has 512 experts,
top-10). Random bf16 weights and a random softmax top-k routing per token count. Columns, in ms (median of
``--reps`` CUDA-event timings after warm-ups, alone on the GPU):

* stock: vLLM 0.32's ``fused_experts`` (Triton, its tuned or default configs; not batch-invariant);
* BI loop: ``vllm_bi.ops.moe.moe_experts_loop`` (``VLLM_BI_MOE=loop``, the default: a host loop over the routed
  experts, exact float64 products);
* BI exact: ``vllm_bi.ops.moe_triton.moe_experts_triton(..., exact=True)`` (``VLLM_BI_MOE=exact``: grouped float64
  kernels, no host read, the loop's bits);
* BI triton: the same with bf16 tensor cores (``VLLM_BI_MOE=triton``: other bits).

Before timing, each token count checks that the triton path gives token 0 the bits it gets alone and that the
exact path gives the loop's bits (where the loop runs), and reports the relative L2 distance of the loop and the
triton path to stock (bf16 rounding differences only).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from common import emit, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-loop-above", type=int, default=1024,
                    help="do not time the loop path above this many tokens (it takes seconds)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    from vllm_bi.ops.moe import moe_experts_loop
    from vllm_bi.ops.moe_triton import moe_experts_triton

    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    rows = [f"# MoE routed experts: {E} experts, top-{k}, hidden {H}, expert MLP {I}; "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "",
            "command: " + shlex.join([sys.executable, *sys.argv]), "",
            "| tokens | stock ms | BI loop ms | ratio | BI exact ms | ratio | BI triton ms | ratio | "
            "triton: token 0 alone == batched | exact == loop | rel. L2 to stock (loop / triton) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    print("\n".join(rows), flush=True)
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T, E, device="cuda", generator=g)
        vals, ids = torch.topk(logits, k, dim=-1)
        w = torch.softmax(vals, dim=-1)
        ids32 = ids.int()
        stock = fused_experts(x, w13, w2, w, ids32)
        tri = moe_experts_triton(x, w13, w2, w, ids32)
        same = torch.equal(moe_experts_triton(x[:1], w13, w2, w[:1], ids32[:1]), tri[:1])
        t_stock = timed(lambda: fused_experts(x, w13, w2, w, ids32), args.reps)
        t_tri = timed(lambda: moe_experts_triton(x, w13, w2, w, ids32), args.reps)
        exact = moe_experts_triton(x, w13, w2, w, ids32, exact=True)
        t_ex = timed(lambda: moe_experts_triton(x, w13, w2, w, ids32, exact=True), args.reps)

        def rel(a):
            return ((a.float() - stock.float()).norm() / stock.float().norm()).item()

        if T <= args.skip_loop_above:
            loop = moe_experts_loop(x, w13, w2, w, ids32)
            t_loop = timed(lambda: moe_experts_loop(x, w13, w2, w, ids32), max(3, args.reps // 3), warmup=1)
            loop_cells, d_loop = f"{t_loop:.3f} | {t_loop / t_stock:.1f}x", f"{rel(loop):.1e}"
            ex_same = "yes" if torch.equal(exact, loop) else "**NO**"
        else:
            loop_cells, d_loop, ex_same = "skipped | ", "-", "-"
        rows.append(f"| {T} | {t_stock:.3f} | {loop_cells} | {t_ex:.3f} | {t_ex / t_stock:.2f}x | {t_tri:.3f} | "
                    f"{t_tri / t_stock:.2f}x | {'yes' if same else '**NO**'} | {ex_same} | {d_loop} / {rel(tri):.1e} |")
        print(rows[-1], flush=True)
    emit("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
