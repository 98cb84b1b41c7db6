"""``benchmarks/gdn_recurrent_tiles.py`` in its small form (Triton's interpreter, tiny dims): it runs, checks each tile's
whole == split == steps == speculative consistency and reports it, and refuses a bad tile in one line."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gdn_recurrent_tiles.py")


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--small", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_small_run_reports_each_tile_exact(tmp_path):
    out = tmp_path / "tiles.md"
    r = _run("--tiles", "fla,16x1x3", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    table = out.read_text()
    assert "| fla | exact | yes |" in table and "| 16x1x3 | exact |" in table


def test_small_run_with_the_bf16_state_reports_its_columns_exact(tmp_path):
    out = tmp_path / "tiles.md"
    r = _run("--tiles", "16x1x3", "--state", "fp32,bf16", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    table = out.read_text()
    assert "| 16x1x3 | exact |" in table and "| 16x1x3+bf16 | exact |" in table


def test_bad_tile_refused_in_one_line():
    r = _run("--tiles", "fla,33x1x3")
    assert r.returncode == 2 and "33x1x3" in r.stderr and "Traceback" not in r.stderr
    r = _run("--state", "fp16")
    assert r.returncode == 2 and "--state 'fp16'" in r.stderr and "Traceback" not in r.stderr
