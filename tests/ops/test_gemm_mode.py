"""``VLLM_BI_GEMM``: the exact float64 GEMM (default) and the experimental Triton-persistent mode's plumbing.

The Triton kernel itself needs CUDA (``tests/gpu/test_ops_cuda.py`` checks its M-invariance there). Here:
the mode switch, that CPU tensors keep the float64 GEMM whatever the mode, and the autograd wrapper with a
stand-in kernel (fp32 torch.mm): forward = the kernel's result, gradients vs float64 autograd within 1e-2
relative L2 (bf16 inputs).
"""

import pytest
import torch

from vllm_bi.ops import linear
from vllm_bi.ops.linear import bi_linear, gemm_mode
from vllm_bi.parity import settings_mismatch


def test_mode_switch(monkeypatch):
    monkeypatch.delenv("VLLM_BI_GEMM", raising=False)
    monkeypatch.setenv("VLLM_BI_PRESET", "auto")
    assert (gemm_mode("cuda"), gemm_mode("cpu")) == ("triton", "fp64")  # auto: fast on CUDA, exact on CPU
    monkeypatch.setenv("VLLM_BI_GEMM", "fp64")
    assert gemm_mode("cuda") == "fp64"
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    assert (gemm_mode("cuda"), gemm_mode("cpu")) == ("triton", "fp64")
    monkeypatch.setenv("VLLM_BI_GEMM", "cutlass")
    with pytest.raises(ValueError, match="VLLM_BI_GEMM='cutlass' is not a setting; use one of auto, fp64, triton "):
        gemm_mode()


def test_cublas_is_refused_with_the_measurement(monkeypatch):
    """cuBLAS without split-K was measured not batch-invariant on an H100: the setting is refused in one line, with the
    record and the fix."""
    monkeypatch.setenv("VLLM_BI_GEMM", "cublas")
    with pytest.raises(ValueError, match=r"VLLM_BI_GEMM='cublas' is refused: .*not batch-invariant.*use triton"):
        gemm_mode()


def test_cpu_keeps_the_float64_gemm(monkeypatch):
    x, w = torch.randn(7, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    monkeypatch.delenv("VLLM_BI_GEMM", raising=False)
    ref = bi_linear(x, w)
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    monkeypatch.setattr(linear, "_persistent_mm", lambda *a: pytest.fail("Triton GEMM called for CPU tensors"))
    assert torch.equal(bi_linear(x, w), ref)


def test_persistent_wrapper_forward_and_gradients(monkeypatch):
    calls = []

    def fake(a, b, bias):
        calls.append((a.shape, b.shape))
        y = torch.mm(a.float(), b.float())
        return (y if bias is None else y + bias.float()).to(a.dtype)

    monkeypatch.setattr(linear, "_persistent_mm", fake)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 48, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(24, 48, generator=gen).bfloat16().requires_grad_(True)
    bias = torch.randn(24, generator=gen).bfloat16().requires_grad_(True)
    y = linear._PersistentLinear.apply(x, w, bias)
    assert calls == [(torch.Size([9, 48]), torch.Size([48, 24]))]
    assert torch.equal(y, fake(x.detach(), w.detach().t(), bias.detach()))
    gy = torch.randn(9, 24, generator=gen)
    y.float().backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, bias))
    (torch.nn.functional.linear(x64, w64, b64) * gy.double()).sum().backward()
    for mine, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)):
        rel = ((mine.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel


def test_a_gemm_mode_mismatch_is_refused(monkeypatch):
    monkeypatch.delenv("VLLM_BI_GEMM", raising=False)
    assert settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm_bi", "gemm": "fp64"}) is None
    assert "VLLM_BI_GEMM" in settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm_bi", "gemm": "triton"})


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_exact_gemm_under_autograd_keeps_the_forward_bits_and_gives_accurate_gradients(out_dtype):
    """The trainer's float64 GEMM: under autograd the forward is bitwise the server's (no-grad) product; the
    backward runs in fp32 here (bf16 tensor cores on CUDA), within 1e-2 relative L2 of float64 autograd."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 48, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(24, 48, generator=gen).bfloat16().requires_grad_(True)
    bias = torch.randn(24, generator=gen).bfloat16().requires_grad_(True)
    with torch.no_grad():
        ref = bi_linear(x, w, bias, out_dtype)
    y = bi_linear(x, w, bias, out_dtype)
    assert y.grad_fn is not None and torch.equal(y.detach(), ref) and y.dtype == (out_dtype or torch.bfloat16)
    gy = torch.randn(y.shape, generator=gen)
    y.float().backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, bias))
    (torch.nn.functional.linear(x64, w64, b64) * gy.double()).sum().backward()
    for mine, want in ((x.grad, x64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)):
        assert mine.dtype == torch.bfloat16
        rel = ((mine.double() - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel
    # an input that needs no gradient gets none computed
    w2 = w.detach().clone().requires_grad_(True)
    bi_linear(x.detach(), w2).float().sum().backward()
    assert w2.grad is not None
