"""``benchmarks/gdn_state_error.py`` at small dims: it runs, prints one row per state arithmetic with its error against
float64 (the fp32 state's far below the bf16 state's, which is the point of the table), and refuses bad options in one
line."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gdn_state_error.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def _max_error(row: str) -> float:
    return float(row.split("|")[2].split("/")[0])


def test_small_run_reports_each_state(tmp_path):
    out = tmp_path / "err.md"
    r = _run("--dims", "small", "--tokens", "96", "--cache-every", "32", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in out.read_text().splitlines() if line.startswith("| ")}
    fp32, bf16 = rows["fp32 state (default)"], rows["bf16 state (VLLM_BI_GDN_STATE=bf16)"]
    assert "fp32, bf16 cache every 32 (stock's prefill split into 32-token steps)" in rows
    assert _max_error(fp32) < 1e-5 < _max_error(bf16) < 1e-2


def test_bad_options_refused_in_one_line():
    r = _run("--cache-every", "x")
    assert r.returncode == 2 and "--cache-every 'x'" in r.stderr and "Traceback" not in r.stderr
