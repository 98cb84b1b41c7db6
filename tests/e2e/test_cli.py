"""The README's main command: `vllm-bi demo` (real `vllm serve`, BI on, then stock for contrast)."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server

EXE = os.path.join(os.path.dirname(sys.executable), "vllm-bi")


def test_help_lists_commands():
    r = subprocess.run([EXE, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for cmd in ("demo", "make-model", "info"):
        assert cmd in r.stdout


def test_demo_passes_and_shows_the_stock_gap(tmp_path):
    r = subprocess.run([EXE, "demo", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS: batch-invariant with vllm_bi" in r.stdout
    eq = [int(a) for a, b in re.findall(r"logprobs bitwise equal: (\d+)/(\d+)", r.stdout)]
    assert eq[:2] == [16, 16], r.stdout[-2000:]
    assert len(eq) == 3  # the stock row is printed (its value is a measurement, not asserted)
