"""Where an op's Triton implementation may run (the choice itself is a setting: :mod:`vllm_bi.settings`)."""

from __future__ import annotations

import os


def check_triton_device(env: str, choice: str, dev_type: str) -> None:
    """A Triton op off CUDA runs only in Triton's interpreter (tests): refuse it otherwise, naming the fix."""
    if choice == "triton" and dev_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{env}=triton on {dev_type} needs TRITON_INTERPRET=1 (slow; for tests only)")
