import os
import subprocess
import sys

import pytest

from vllm_bi.testing.tiny_models import build_tiny_model

MODEL_ROOT = os.environ.get("VLLM_BI_TEST_MODELS", os.path.join(os.path.dirname(__file__), "..", ".test_models"))


@pytest.fixture(scope="session")
def tiny_model_path():
    """``tiny_model_path(family)`` -> a built random-weight model directory (cached under .test_models/)."""

    def get(family: str, seed: int = 0) -> str:
        path = os.path.abspath(os.path.join(MODEL_ROOT, f"{family}-s{seed}"))
        return build_tiny_model(family, path, seed=seed)

    return get


@pytest.fixture(scope="session")
def parity_cli():
    """``parity_cli(*args, env={...})``: ``vllm-bi parity ARGS`` in a subprocess with extra environment; returns the
    ``CompletedProcess`` (text output captured)."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-bi")

    def run(*args, env=None, timeout=900):
        return subprocess.run([exe, "parity", *args], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))

    return run


@pytest.fixture(scope="session")
def interpreted():
    """``interpreted(script)``: run a Python script under ``TRITON_INTERPRET=1`` in a subprocess (Triton reads the
    variable at import) and require it to exit 0 printing ``ok``."""

    def run(script, timeout=900):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, TRITON_INTERPRET="1"))
        assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]

    return run
