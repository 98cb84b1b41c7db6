"""The CUDA path of ``row_sum`` (a Triton kernel, one program per row) run through Triton's interpreter
on CPU: its logic (masking, blocks, fp32/fp64 accumulation) against a float64 reference (relative error
<= 1e-6 for fp32, 1e-15 for fp64), and a row's sum alone == the same row in a batch (exact). Its invariance
in compiled form is measured on the GPU (tests/gpu/test_ops_cuda.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_bi.ops.reduce import GPU_BLOCK, triton_row_sum
    torch.manual_seed(0)
    for n in (1, 7, GPU_BLOCK, GPU_BLOCK + 3, 3 * GPU_BLOCK - 1):
        x = torch.randn(6, n, dtype=torch.float32) * torch.logspace(-3, 3, n)
        ref = x.double().sum(-1, keepdim=True)
        for dt, tol in ((torch.float32, 1e-6), (torch.float64, 1e-15)):
            full = triton_row_sum(x, dt)
            assert full.dtype == dt and full.shape == (6, 1)
            rel = float(((full.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max())
            assert rel <= tol, (n, dt, rel)
            for i in range(6):
                assert torch.equal(triton_row_sum(x[i : i + 1], dt), full[i : i + 1]), (n, dt, i)
    bf = torch.randn(3, 5, 40).bfloat16()
    assert triton_row_sum(bf, torch.float32).shape == (3, 5, 1)
    print("ok")
""")


def test_triton_row_sum_logic_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
