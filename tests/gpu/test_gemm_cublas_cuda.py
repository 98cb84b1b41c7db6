"""``VLLM_BI_GEMM=cublas``'s premise on CUDA: with split-K off (``ops.linear.no_split_k``'s settings), cuBLAS's bf16
GEMM gives a row the same bits in every batch size and at every offset, and a fused layer's columns its parts'
bits, on Qwen3.5-9B's linear shapes (``benchmarks/gemm_cublas_bits.py``'s checks, 38 batch sizes from 1 to 3000
against a 4096-row product, ``torch.equal`` row by row). Control: torch's default settings (split-K allowed) give
some row other bits, so the equality is the settings', not a check that cannot fail. Each side runs in a process
of its own: cuBLAS reads its workspace settings once per process.

Run on a GPU machine: ``pytest tests/gpu/test_gemm_cublas_cuda.py`` (about a minute)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gemm_cublas_bits.py")


def _child(env_name: str) -> dict:
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import gemm_cublas_bits as G

    proc = subprocess.run([sys.executable, SCRIPT, "--child", env_name, "--rows", "4096"],
                          env={**os.environ, **G.ENVS[env_name]}, capture_output=True, text=True, timeout=400)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    return json.loads(line[-1][7:])["shapes"]


def test_no_split_k_rows_and_parts_are_invariant():
    shapes = _child("no-split-k")
    bad = {n: (r["rows_differing"], r["first_bad"]) for n, r in shapes.items() if r["rows_differing"]}
    assert not bad, f"rows with other bits under no split-K: {bad}"
    assert all(r["parts_equal"] is not False for r in shapes.values()), {n: r["parts_equal"] for n, r in shapes.items()}


def test_control_stock_settings_split_k_somewhere():
    shapes = _child("stock")
    assert sum(r["rows_differing"] for r in shapes.values()) > 0, "stock cuBLAS gave every row the same bits"
