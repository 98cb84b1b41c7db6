"""Shared preamble of the GPU tests that start a real vLLM server."""

import pytest


def require_cuda_vllm_fla() -> None:
    """Skip the calling test module unless CUDA, vLLM's GPU build and fla-core are all importable."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    pytest.importorskip("vllm")
    pytest.importorskip("fla")
