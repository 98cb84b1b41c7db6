"""The CUDA path of ``log_softmax`` (``ops.softmax_triton``: each row cut into spans, per-span partials, then the
output) run through Triton's interpreter on CPU: its logic (masking of a partial last block and span, a span whose
values are all -inf, the max's guard, widening bf16 input, strided and offset views) against float64's log-softmax (absolute error <= 2e-5 on
logits of scale 8), and a row alone == the same row in a batch (exact). Its speed and bits on a GPU are measured in
tests/gpu/test_ops_cuda.py and benchmarks/lm_head.py."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_bi.ops.reduce import GPU_BLOCK
    from vllm_bi.ops.softmax_triton import SPAN, _forward, parts
    torch.manual_seed(0)
    assert parts(1) == 1 and parts(SPAN) == 1 and parts(SPAN + 1) == 2 and parts(248320) == 31
    for n in (1, 5, GPU_BLOCK + 3, SPAN + 1, 2 * SPAN + 7):
        for dt in (torch.float32, torch.bfloat16):
            x = (torch.randn(5, n) * 8).to(dt)
            x[1, 0] = float("-inf")
            x[2] = float("-inf")  # nothing finite: NaN, as log_softmax gives
            if n > SPAN:
                x[3, :SPAN] = float("-inf")  # a whole span without a finite max
                x[4, SPAN:] -= 200.0  # a span far below the row's max
            out = _forward(x)
            assert out.dtype == torch.float32 and out.shape == x.shape
            ref = torch.log_softmax(x.double(), -1)
            fin = torch.isfinite(ref)
            assert torch.equal(fin, torch.isfinite(out)), (n, dt)
            assert torch.equal(ref.isnan(), out.isnan()), (n, dt)
            err = float((out.double() - ref)[fin].abs().max()) if fin.any() else 0.0
            assert err <= 2e-5, (n, dt, err)
            for i in range(5):
                one = _forward(x[i : i + 1])
                assert torch.equal(one.isnan(), out[i : i + 1].isnan()) and torch.equal(one.nan_to_num(7.0), out[i : i + 1].nan_to_num(7.0)), (n, dt, i)
    # the same values through another dtype, a strided view and an odd offset give the same bits
    x = torch.randn(6, 3000) * 8
    ref = _forward(x)
    wide = torch.full((6, 3008), -1.0)
    wide[:, :3000] = x
    flat = torch.empty(1 + 6 * 3000)
    flat[1:] = x.reshape(-1)
    for other in (wide[:, :3000], flat[1:].view(6, 3000), x.to(torch.float64).to(torch.float32)):
        assert torch.equal(_forward(other), ref)
    xb = x.bfloat16()
    assert torch.equal(_forward(xb), _forward(xb.float()))
    # negative control: the same check sees a one-ulp change of the row's normaliser
    x = torch.randn(3, SPAN + 1) * 8
    out = _forward(x)
    assert not torch.equal(out, x - (torch.logsumexp(x.double(), -1, keepdim=True).float().nextafter(torch.tensor(1e9))))
    print("ok")
""")


def test_fused_log_softmax_logic_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


BACKWARD = textwrap.dedent("""
    import torch
    from vllm_bi.ops.softmax_triton import SPAN, fused_log_softmax
    torch.manual_seed(0)
    for n in (7, SPAN + 3):
        for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2.0 ** -8)):
            x = (torch.randn(4, n) * 8).to(dt).requires_grad_(True)
            g = torch.randn(4, n)
            fused_log_softmax(x).backward(g)
            x64 = x.detach().double().requires_grad_(True)
            torch.log_softmax(x64, -1).backward(g.double())
            ref = x64.grad
            assert x.grad.dtype == dt and x.grad.shape == x.shape
            err = float(((x.grad.double() - ref).abs() / (ref.abs() + 1e-3)).max())
            assert err <= tol, (n, dt, err)
            # control: the same check sees a gradient without its softmax term
            assert float(((g.double() - ref).abs() / (ref.abs() + 1e-3)).max()) > tol
    print("ok")
""")


def test_fused_log_softmax_backward_against_float64_in_interpreter():
    """The fused log-softmax's gradient (CUDA's trainer path), through Triton's interpreter: within the input dtype's
    rounding of float64's (relative error, with an absolute floor of 1e-3: 1e-4 for fp32 input, which covers an fp32
    sum over a row of 8K entries; 2^-8 for bf16)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", BACKWARD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
