"""Elementwise transcendental functions: the result for a value must not depend on tensor size or offset.

Negative control: stock ATen on CPU rounds the SIMD body and the scalar tail
differently for several of these (measured: softplus, log1p, rsqrt, sigmoid, silu).
"""

import torch
import torch.nn.functional as F

from vllm_bi.ops import pointwise

torch.manual_seed(0)
X = torch.randn(1000) * 3


def _mismatches(fn, x):
    full = fn(x)
    bad = sum(int(not torch.equal(fn(x[:n]), full[:n])) for n in range(1, 40))
    bad += sum(int(not torch.equal(fn(x[k : k + 37]), full[k : k + 37])) for k in range(30))
    bad += int(not torch.equal(fn(x.view(10, 100))[3], full[300:400]))
    return bad


def test_pointwise_is_position_invariant():
    for name in ("exp", "log1p", "sigmoid", "silu", "softplus", "rsqrt"):
        fn = getattr(pointwise, name)
        x = X.abs() + 0.1 if name in ("rsqrt", "log1p") else X
        assert _mismatches(fn, x) == 0, name
        assert _mismatches(fn, x.bfloat16()) == 0, name + " bf16"
    assert _mismatches(pointwise.log, X.abs() + 0.1) == 0


def test_negative_control_stock_aten_is_not():
    stock = {"softplus": F.softplus, "log1p": torch.log1p, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid}
    bad = {n: _mismatches(f, X.abs() + 0.1 if n in ("rsqrt", "log1p") else X) for n, f in stock.items()}
    assert sum(bad.values()) > 0, bad


def test_pointwise_accuracy():
    x = X.double()
    torch.testing.assert_close(pointwise.sigmoid(X).double(), torch.sigmoid(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(pointwise.silu(X).double(), F.silu(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pointwise.softplus(X).double(), F.softplus(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pointwise.rsqrt(X.abs() + 0.1).double(), torch.rsqrt(x.abs() + 0.1), rtol=1e-6, atol=0)


def test_pointwise_gradients_against_float64():
    """Gradients vs autograd of torch's own functions in float64; tolerance 1e-6 relative (fp32 math)."""
    ref_fns = {
        "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "sigmoid": torch.sigmoid,
        "silu": F.silu, "softplus": F.softplus, "rsqrt": torch.rsqrt,
    }
    for name, ref in ref_fns.items():
        x = (X[:50].abs() + 0.1) if name in ("log", "log1p", "rsqrt") else X[:50].clone()
        x32 = x.clone().requires_grad_(True)
        getattr(pointwise, name)(x32).sum().backward()
        x64 = x.double().requires_grad_(True)
        ref(x64).sum().backward()
        torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-5, atol=1e-6, msg=name)
