"""Benchmark: is cuBLAS's bf16 GEMM batch-invariant once split-K is off, and what does it cost?

    python benchmarks/gemm_cublas_bits.py [--out gemm_cublas_bits.md] [--rows 4096]

vLLM 0.32's batch-invariant mode keeps cuBLAS on Hopper and Blackwell, on the claim that split-K is the only source
of batch variance there and that a tiny workspace (``CUBLAS_WORKSPACE_CONFIG=:16:8``, ``CUBLASLT_WORKSPACE_SIZE=1``)
turns it off. This measures that claim on Qwen3.5-9B's linear shapes, one child process per cuBLAS environment
(cuBLAS reads it when its handle is made, so it cannot change within a process):

- ``stock``: torch's defaults (the negative control: split-K on where cuBLAS picks it);
- ``no-split-k``: vLLM's settings above, bf16 reduced-precision reductions off, cuBLASLt preferred;
- ``workspace-0``: no workspace at all (``:0:0`` and ``CUBLASLT_WORKSPACE_SIZE=0``).

For each shape ``(N, K)``: ``y = x @ W.T`` for ``x`` of ``--rows`` rows, then for every ``M`` in :data:`BITS_MS`
the rows ``x[o:o+M]`` at offsets 0 and 5, compared with ``torch.equal`` row by row to the same rows of the full
product ("rows differing": how many of the rows checked had other bits). A fused layer's parts (``gate_up``'s
halves, ``in_proj_qkvz``'s four parts) are checked against the fused product's columns. Timing: median of CUDA
event timings per call at the ``M`` of :data:`TIME_MS`, and vLLM's batch-invariant Triton persistent matmul with
vllm_bi's default tile table beside it (what ``VLLM_BI_GEMM=triton`` runs today), in the ``no-split-k`` child.

Measured on an H100 (``docs/results/2026-12-07-h100-cublas-bits-bf16-state-and-gdn-glue.md``): one row of the 64-column
``in_proj_ba`` differed at ``M = 1`` with split-K off, and it cost 2-3x cuBLAS's default at small ``M``; so vllm_bi
keeps no cuBLAS GEMM mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bi_gemm_tune import SHAPES_9B as SHAPES  # (name, N, K): Qwen3.5-9B's linear layers as vLLM merges them

PARTS = {"GDN in_proj_qkvz": (2048, 2048, 4096, 4096), "MLP gate_up": (12288, 12288),
         "attention qkv (q with its gate)": (8192, 1024, 1024)}
BITS_MS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 96, 100, 127, 128, 129, 192, 255, 256,
           257, 384, 500, 512, 513, 768, 1000, 1024, 1500, 2048, 3000)
TIME_MS = (1, 16, 64, 256, 1024, 4096)
ENVS = {
    "stock": {},
    "no-split-k": {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"},
    "workspace-0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
}


def _median_ms(fn) -> float:
    from vllm_bi.ops.gemm_tune import cuda_ms

    return cuda_ms(fn, reps=20)


def child(env_name: str, rows: int) -> dict:
    import torch
    import torch.nn.functional as F

    if env_name != "stock":  # the parent set this child's workspace variables (ENVS); vLLM's other settings here
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.preferred_blas_library(backend="cublaslt")
    out = {"env": env_name, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        full = F.linear(x, w)
        differ, checked, first_bad = 0, 0, []
        for m in BITS_MS:
            for off in (0, 5):
                if off + m > rows:
                    continue
                y = F.linear(x[off:off + m], w)
                bad = int((y != full[off:off + m]).any(dim=1).sum())
                differ += bad
                checked += m
                if bad and len(first_bad) < 6:
                    first_bad.append([m, off, bad])
        parts_equal = None
        if name in PARTS:
            parts_equal, c = True, 0
            for width in PARTS[name]:
                part = F.linear(x, w[c:c + width])
                parts_equal &= torch.equal(part, full[:, c:c + width])
                c += width
        times = {m: _median_ms(lambda m=m: F.linear(x[:m], w)) for m in TIME_MS if m <= rows}
        rec = {"rows_checked": checked, "rows_differing": differ, "first_bad": first_bad,
               "parts_equal": parts_equal, "ms": times}
        if env_name == "no-split-k":
            try:
                from vllm_bi.ops import linear

                rec["triton_ms"] = {m: _median_ms(lambda m=m: linear._PersistentLinear.apply(x[:m], w, None))
                                    for m in TIME_MS if m <= rows}
            except Exception as e:  # vLLM missing here: the cuBLAS columns still stand
                rec["triton_error"] = f"{type(e).__name__}: {e}"
        out["shapes"][name] = rec
    return out


def table(results: dict[str, dict]) -> list[str]:
    envs = [e for e in ENVS if e in results and "shapes" in results[e]]
    lines = ["## rows whose bits differ from the same rows of the full product (of rows checked)", "",
             "| shape (N x K) | " + " | ".join(envs) + " | fused == parts (" + ", ".join(envs) + ") |",
             "| --- | " + " | ".join("---:" for _ in envs) + " | --- |"]
    for name, n, k in SHAPES:
        cells = []
        for e in envs:
            r = results[e]["shapes"][name]
            cells.append(f"{r['rows_differing']} / {r['rows_checked']}")
        parts = ", ".join(str(results[e]["shapes"][name]["parts_equal"]) for e in envs)
        lines.append(f"| {name} ({n} x {k}) | " + " | ".join(cells) + f" | {parts} |")
    lines += ["", "first differing (M, offset, rows) per environment:", ""]
    for e in envs:
        bad = {nm: r["first_bad"] for nm, r in results[e]["shapes"].items() if r["first_bad"]}
        lines.append(f"- {e}: {json.dumps(bad) if bad else 'none'}")
    lines += ["", "## ms per call (median of 20, CUDA events); ratio to stock cuBLAS", "",
              "| shape | M | stock cuBLAS | " + " | ".join(f"{e} | ratio" for e in envs if e != "stock")
              + " | Triton persistent (vllm_bi today) | ratio |",
              "| --- | ---: | ---: | " + " | ".join("---: | ---:" for e in envs if e != "stock") + " | ---: | ---: |"]
    for name, _, _ in SHAPES:
        base = results["stock"]["shapes"][name]["ms"]
        for m in base:
            cells = [f"{base[m]:.4f}"]
            for e in envs:
                if e == "stock":
                    continue
                t = results[e]["shapes"][name]["ms"][m]
                cells += [f"{t:.4f}", f"{t / base[m]:.2f}x"]
            tri = results.get("no-split-k", {}).get("shapes", {}).get(name, {}).get("triton_ms", {}).get(m)
            cells += [f"{tri:.4f}", f"{tri / base[m]:.2f}x"] if tri else ["", ""]
            lines.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="rows of the full product every M is checked against")
    ap.add_argument("--out", default=None, help="also write the table (and a .json beside it) here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.rows)), flush=True)
        return 0
    results = {}
    for env_name, env in ENVS.items():
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", env_name, "--rows", str(args.rows)],
                              env={**os.environ, **env}, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        results[env_name] = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-2000:]}
        print(f"[gemm-cublas-bits] {env_name}: {'ok' if line else 'failed: ' + proc.stderr[-500:]}", flush=True)
    if "shapes" not in results.get("stock", {}):
        print("the stock child failed; nothing to compare against", file=sys.stderr)
        return 1
    from common import emit

    r0 = results["stock"]
    head = [f"# cuBLAS bf16 GEMM: batch invariance with split-K off, and its cost ({r0['device']}, torch {r0['torch']})",
            "", "command: " + " ".join([os.path.basename(sys.executable), *sys.argv]), ""]
    for e, r in results.items():
        if "error" in r:
            head.append(f"- {e}: the child failed: `{r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}`")
    emit("\n".join(head + table(results)) + "\n", args.out)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
