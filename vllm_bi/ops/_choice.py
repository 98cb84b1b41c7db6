"""Reading an op's implementation choice from the environment (``VLLM_BI_ATTENTION``, ``VLLM_BI_MOE``)."""

from __future__ import annotations

import os


def env_choice(env: str, default: str, allowed: tuple[str, ...], hint: str) -> str:
    """``env``'s value (lower case; ``default`` when unset or empty); a value not in ``allowed`` raises
    ``ValueError`` with ``hint`` (what to use)."""
    choice = os.environ.get(env, default).strip().lower() or default
    if choice not in allowed:
        raise ValueError(f"{env}={choice!r}: use {hint}")
    return choice


def check_triton_device(env: str, choice: str, dev_type: str) -> None:
    """A Triton op off CUDA runs only in Triton's interpreter (tests): refuse it otherwise, naming the fix."""
    if choice == "triton" and dev_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{env}=triton on {dev_type} needs TRITON_INTERPRET=1 (slow; for tests only)")
