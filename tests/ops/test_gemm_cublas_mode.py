"""``VLLM_BI_GEMM=cublas`` on CPU: the setting parses, CPU tensors keep the float64 GEMM, the arithmetic a server
reports names cuBLAS's identity, and a process whose cuBLAS may split K is refused. Its bits on CUDA are measured by
``benchmarks/gemm_cublas_bits.py`` and ``tests/gpu/test_gemm_cublas_cuda.py``."""

import os

import pytest
import torch

from vllm_bi import settings
from vllm_bi.ops import linear


@pytest.fixture
def reductions():
    """Restores torch's reduced-precision flag (its cuBLAS module does not take monkeypatch's undo)."""
    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction
    yield m
    m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


@pytest.fixture
def cublas(monkeypatch):
    monkeypatch.setenv("VLLM_BI_GEMM", "cublas")
    settings.reload()
    yield
    monkeypatch.delenv("VLLM_BI_GEMM")
    settings.reload()


def test_cpu_keeps_the_float64_gemm(cublas):
    assert settings.current().gemm_on("cuda") == "cublas" and settings.current().gemm_on("cpu") == "fp64"
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    ref = (x.double() @ w.double().t()).bfloat16()
    assert torch.equal(linear.bi_linear(x, w), ref)


def test_split_k_settings_are_required(cublas, monkeypatch, reductions):
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="split-K"):
        linear._cublas_linear(torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16(), None)
    reductions.allow_bf16_reduced_precision_reduction = True
    for k, v in linear.NO_SPLIT_K_ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="reduced-precision"):
        linear._cublas_linear(torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16(), None)
    reductions.allow_bf16_reduced_precision_reduction = False
    x, w = torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16()
    assert torch.equal(linear._cublas_linear(x, w, None), torch.nn.functional.linear(x, w))


def test_no_split_k_sets_the_process(monkeypatch, reductions):
    for k in linear.NO_SPLIT_K_ENV:
        monkeypatch.setenv(k, "unset")  # recorded, so the test leaves the process's environment as it was
    reductions.allow_bf16_reduced_precision_reduction = True
    linear.no_split_k()
    assert all(os.environ[k] == v for k, v in linear.NO_SPLIT_K_ENV.items())
    assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


def test_trainer_and_server_compare_cublas_identity(cublas, monkeypatch):
    monkeypatch.setattr(settings, "cublas_identity", lambda: "cuBLAS (CUDA 13.0) on H100")
    a = settings.current().arithmetic("cuda")
    assert a["gemm"] == "cublas" and a["gemm_configs"] == "cuBLAS (CUDA 13.0) on H100"
    other = dict(a, gemm_configs="cuBLAS (CUDA 13.0) on H200")
    assert [k for k, *_ in settings.diff(a, other)] == ["gemm_configs"]
    assert settings.diff(a, dict(a)) == []


def test_trainer_model_loader_sets_no_split_k_first(cublas, monkeypatch):
    """The trainer's model loader sets cuBLAS without split-K before the model exists (cuBLAS reads it once per
    process); under the default GEMM it leaves the process alone."""
    from vllm_bi import models

    order = []
    monkeypatch.setattr(linear, "no_split_k", lambda: order.append("no_split_k"))
    monkeypatch.setattr(models, "model_class", lambda path: type("M", (), {
        "from_pretrained": staticmethod(lambda p: order.append("model") or "model")}))
    assert models.from_pretrained("ckpt") == "model" and order == ["no_split_k", "model"]
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    order.clear()
    models.from_pretrained("ckpt")
    assert order == ["model"]


def test_server_plugin_sets_no_split_k_under_cublas(cublas, monkeypatch):
    """The server's CUDA op-library setup takes the whole no-split-K set (cuBLASLt, no reduced-precision reductions)
    under the cuBLAS GEMM, and only the workspace variables under the others."""
    from vllm_bi.patch import aten_overrides

    for k, v in linear.NO_SPLIT_K_ENV.items():  # recorded, so the test leaves the process's environment as it was
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(aten_overrides, "register_overrides", lambda key: calls.append(key))
    monkeypatch.setattr(linear, "no_split_k", lambda: calls.append("no_split_k"))
    aten_overrides.enable_cuda_own_ops_mode()
    assert calls == ["no_split_k", "CUDA"]
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    calls.clear()
    aten_overrides.enable_cuda_own_ops_mode()
    assert calls == ["CUDA"] and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1"
