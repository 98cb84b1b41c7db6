"""Benchmark: the lm_head GEMM and the returned logprobs at Qwen3.5-9B's 248,320-token vocabulary on CUDA,
stock against vllm_bi, per part, side by side in one process.

    python benchmarks/lm_head.py [--rows 64,256] [--reps 20] [--tiles TUNED.json] [--out lm_head.md]

Parts, per number of rows M (a decode step's sequences, or a prefill's last rows):
- **lm_head**: ``hidden [M, 4096] @ W[248320, 4096].T`` in bf16: cuBLAS (stock) against ``ops.linear.bi_linear``
  (the CUDA default: vLLM's batch-invariant persistent matmul with vllm_bi's tile table). With ``--tiles`` (a table
  written by ``bi_gemm_tune.py --shapes 248320x4096``) also those tiles, and whether their logits equal the
  default's bit for bit at every M;
- **logprobs**: each row's sampled token's logprob from the bf16 logits, as vLLM's sampler computes it (stock: the
  fp32 copy and torch's ``log_softmax``, then a gather) against vllm_bi's (``ops.softmax.log_softmax`` under the
  current ``VLLM_BI_LOGPROBS``; ``triton``: two Triton kernels over spans of each row), and the op library's torch
  formula (``x32 - logsumexp(x32)``, seven kernels); the table says how many rows carry the formula's bits (the
  kernel's summation order differs, so not all need to) and whether a row alone equals the row in the batch.
Median ms of CUDA-event timings after warm-ups; ratio = vllm_bi / stock.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from common import timed

V, HID = 248320, 4096


def stock_logprobs(logits, tok):
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tok)


def formula_logprobs(logits, tok):
    from vllm_bi.ops.softmax import logsumexp

    x32 = logits.float()
    return (x32 - logsumexp(x32)).gather(1, tok)


def bi_logprobs(logits, tok):
    from vllm_bi.ops.softmax import log_softmax

    return log_softmax(logits, dim=-1, dtype=torch.float32).gather(1, tok)


def use_tiles(path: str) -> None:
    """Put the lm_head shape's entry of a tuner table into vLLM's resolved lookup for this device."""
    from vllm.model_executor.determinism import batch_invariant_configs as C

    doc = json.load(open(path))
    entry = dict(doc["shapes"])[f"{V}x{HID}"]
    C._TUNED_MATMUL_CONFIGS_FOR_DEVICE[(V, HID)] = C._MatmulShapeConfig(
        block_k=entry["block_k"], m_buckets=tuple((m, C._MatmulMConfig(*t)) for m, *t in entry["m_buckets"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", default=None, help="a bi_gemm_tune.py table holding the 248320x4096 shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from vllm_bi.ops.gemm_configs import table_digest
    from vllm_bi.ops.linear import bi_linear, gemm_mode
    from vllm_bi.ops.softmax import log_softmax, logsumexp

    from vllm_bi.settings import current

    logprobs_op = current().logprobs_op("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(V, HID, generator=g) * 0.02).bfloat16().cuda()
    x = torch.randn(max(rows), HID, generator=g).bfloat16().cuda()
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; lm_head {V} x {HID} bf16; GEMM mode "
             f"{gemm_mode()}, table {table_digest()}; median ms of {args.reps}", ""]
    head = "| part | M | stock | vllm_bi | vllm_bi / stock | note |"
    lines += [head, "| --- | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    default_logits = {}
    for m in rows:
        xm = x[:m]
        s = timed(lambda: F.linear(xm, w), args.reps)
        b = timed(lambda: bi_linear(xm, w), args.reps)
        default_logits[m] = bi_linear(xm, w)
        lines.append(f"| lm_head GEMM | {m} | {s:.3f} | {b:.3f} | {b / s:.2f}x | default tiles |")
        print(lines[-1], flush=True)
    for m in rows:
        logits = default_logits[m]
        tok = torch.randint(0, V, (m, 1), generator=g).cuda()
        s = timed(lambda: stock_logprobs(logits, tok), args.reps)
        f = timed(lambda: formula_logprobs(logits, tok), args.reps)
        b = timed(lambda: bi_logprobs(logits, tok), args.reps)
        rows_same = int((log_softmax(logits, -1) == logits.float() - logsumexp(logits.float())).all(-1).sum())
        alone = all(torch.equal(log_softmax(logits[i:i + 1], -1), log_softmax(logits, -1)[i:i + 1])
                    for i in (0, m // 2, m - 1))
        lines.append(f"| logprobs ({logprobs_op}) | {m} | {s:.3f} | {b:.3f} | {b / s:.2f}x | rows with the formula's "
                     f"bits: {rows_same}/{m}; a row alone == in the batch: {'yes' if alone else '**NO**'} |")
        lines.append(f"| logprobs (torch formula) | {m} | {s:.3f} | {f:.3f} | {f / s:.2f}x | seven kernels |")
        print("\n".join(lines[-2:]), flush=True)
    if args.tiles:
        use_tiles(args.tiles)
        for m in rows:
            xm = x[:m]
            s = timed(lambda: F.linear(xm, w), args.reps)
            b = timed(lambda: bi_linear(xm, w), args.reps)
            same = all(torch.equal(bi_linear(x[:k], w)[:1], default_logits[rows[0]][:1]) for k in (1, 7, m)) and \
                torch.equal(bi_linear(xm, w), default_logits[m])
            lines.append(f"| lm_head GEMM | {m} | {s:.3f} | {b:.3f} | {b / s:.2f}x | tuned tiles ({args.tiles}); "
                         f"== default tiles' bits: {'yes' if same else '**NO**'} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
