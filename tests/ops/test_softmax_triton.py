"""The CUDA path of ``log_softmax`` (``ops.softmax_triton``: one Triton program per row, three passes) run through
Triton's interpreter on CPU: its logic (masking of a partial last block, the max's guard, widening bf16 input)
against float64's log-softmax (absolute error <= 2e-5 on logits of scale 8), and a row alone == the same row in a
batch (exact). Its bits against the torch formula are measured on the GPU (tests/gpu/test_ops_cuda.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_bi.ops.reduce import GPU_BLOCK
    from vllm_bi.ops.softmax_triton import _forward
    torch.manual_seed(0)
    for n in (1, 5, GPU_BLOCK, 2 * GPU_BLOCK + 3):
        for dt in (torch.float32, torch.bfloat16):
            x = (torch.randn(5, n) * 8).to(dt)
            x[1, 0] = float("-inf")
            out = _forward(x)
            assert out.dtype == torch.float32 and out.shape == x.shape
            ref = torch.log_softmax(x.double(), -1)
            fin = torch.isfinite(ref)
            assert torch.equal(fin, torch.isfinite(out)), (n, dt)
            err = float((out.double() - ref)[fin].abs().max()) if fin.any() else 0.0
            assert err <= 2e-5, (n, dt, err)
            for i in range(5):
                one = _forward(x[i : i + 1])
                assert torch.equal(one.isnan(), out[i : i + 1].isnan()) and torch.equal(one.nan_to_num(7.0), out[i : i + 1].nan_to_num(7.0)), (n, dt, i)
    print("ok")
""")


def test_fused_log_softmax_logic_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
