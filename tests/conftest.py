import os
import subprocess
import sys

import pytest

from vllm_bi.tiny_models import build_tiny_model

# Every server a test starts needs this key (vllm_bi's launcher passes it on; under VLLM_BATCH_INVARIANT=1 every
# route needs it), and every client, trainer and CLI subprocess sends it: the suite runs keyed end to end.
os.environ.setdefault("VLLM_API_KEY", "vllm-bi-tests-" + os.urandom(8).hex())

MODEL_ROOT = os.environ.get("VLLM_BI_TEST_MODELS", os.path.join(os.path.dirname(__file__), "..", ".test_models"))


class _SettingsMonkeyPatch(pytest.MonkeyPatch):
    """pytest's ``monkeypatch`` that re-reads vllm_bi's settings (``vllm_bi.settings.reload``) whenever it changes a
    ``VLLM_BI_`` variable and when it undoes its changes: the settings are read once per process, and a test that
    sets a variable means the process's settings."""

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        _reload_if(name)

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        _reload_if(name)

    def undo(self):
        super().undo()
        _reload_if("VLLM_BI_")

    def cuda_feature_off(self, name: str) -> None:
        """Take ``name`` out of ``vllm_bi.settings.CUDA_FEATURES`` until the test ends: the negative control of a
        gated CUDA feature (CUDA then runs it only where ``VLLM_BI_CUDA_PREVIEW`` names it)."""
        from vllm_bi import settings

        self.setattr(settings, "CUDA_FEATURES", tuple(f for f in settings.CUDA_FEATURES if f != name))


def _reload_if(name: str) -> None:
    if str(name).startswith("VLLM_BI_"):
        from vllm_bi.settings import reload

        try:
            reload()
        except ValueError:  # a test of a bad value: the settings stay unread, so the code under test raises it
            pass


@pytest.fixture
def monkeypatch():
    mp = _SettingsMonkeyPatch()
    yield mp
    mp.undo()


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


@pytest.fixture(scope="session")
def bi_server(tiny_model_path):
    """``with bi_server(family, env[, args]) as srv``: a batch-invariant ``vllm serve`` of the tiny ``family`` model
    (by default 64-token batches, 16 sequences; ``args``: other ``vllm serve`` arguments) with extra environment and
    the dev-mode routes through which ``vllm-bi parity`` reads the server's settings."""
    from vllm_bi.launcher import VllmServer, cpu_env

    def start(family, env, args=("--max-num-batched-tokens", "64", "--max-num-seqs", "16")):
        return VllmServer(tiny_model_path(family), args=list(args),
                          env=cpu_env(True, dict(env, VLLM_SERVER_DEV_MODE="1")))

    return start


# --------------------------------------------------------------------------- durations
# Each test's setup + call + teardown time; the slowest 25 go to test-durations.txt, which scripts/test.sh prints
# (where CI's time goes: shared servers are set up by the first test that asks for them).
_DURATIONS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def write_durations(durations: dict[str, float], path: str) -> None:
    """The slowest 25 of ``durations`` (test id -> seconds) as text, and every entry as JSON beside it
    (``PATH.json``, which scripts/test.sh merges when the suite runs in two shards)."""
    import json

    rows = sorted(durations.items(), key=lambda kv: -kv[1])
    total = sum(durations.values())
    with open(path, "w") as f:
        f.write(f"{len(rows)} tests, {total:.0f} s of setup + call + teardown; the slowest 25:\n")
        for nodeid, secs in rows[:25]:
            f.write(f"{secs:8.1f} s  {nodeid}\n")
    with open(path + ".json", "w") as f:
        json.dump(durations, f)


def pytest_sessionfinish(session, exitstatus):
    if not _DURATIONS or hasattr(session.config, "workerinput"):
        return
    # a shard of scripts/test.sh names its own file
    name = os.environ.get("TEST_DURATIONS_FILE", "test-durations.txt")
    write_durations(_DURATIONS, os.path.join(os.path.dirname(__file__), "..", name))
