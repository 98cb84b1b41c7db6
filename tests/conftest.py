import os

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
