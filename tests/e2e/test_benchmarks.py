"""The end-to-end generator benchmark (``benchmarks/generate_throughput.py``) runs its BI mode against a real
``vllm serve`` on CPU and writes a measured row: the GPU sessions that use it have no time for a broken
script. (Its numbers on CPU mean nothing; the script itself checks every phase returned the token count
asked for.)"""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_throughput_writes_a_measured_row(tmp_path):
    out = tmp_path / "e2e.md"
    model = tmp_path / "model"  # built by the script: the small spec at 8 layers (2 of them attention)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "generate_throughput.py"), "--model", str(model),
           "--spec", "default", "--layers", "8", "--modes", "recurrent", "--requests", "3", "--prompt-len", "24",
           "--max-tokens", "5", "--repeats", "2", "--server-args", "--gpu-memory-utilization 0.3", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BI_GEMM"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = out.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| recurrent |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["recurrent", "fp64"], row  # what ran: the GDN mode and the GEMM the server got
    prefill_tok_s, gen_tok_s = float(cells[3]), float(cells[5])
    assert prefill_tok_s > 0 and gen_tok_s > 0, row
    assert len(cells[7].split("(")[1].split()) == 2, row  # two measured prefill runs, their median reported
    assert cells[9] == "vLLM's choice (V2 on CUDA)", row  # the model runner: rows on other runners are not like for like
    assert "command: " in text and re.search(r"3 concurrent requests, 24-token prompts, 5 generated", text)
    assert "median of 2 runs" in text
    assert "VLLM_BI_CUDA_GRAPHS=" in text and "VLLM_BI_GEMM=(unset)" in text
    cfg = json.loads((model / "config.json").read_text())
    assert cfg.get("num_hidden_layers", cfg.get("text_config", {}).get("num_hidden_layers")) == 8


def test_generate_throughput_refuses_a_mode_that_contradicts_the_environment():
    """A benchmark once timed the float64 GEMM while meaning the Triton one: a mode overrode ``VLLM_BI_GEMM`` from the
    environment. Now the contradiction stops the run before any server starts, naming both values."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "generate_throughput.py"), "--modes", "stock,chunk-triton"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "VLLM_BI_GEMM": "fp64"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "mode chunk-triton sets VLLM_BI_GEMM=triton but the environment has VLLM_BI_GEMM=fp64" in r.stderr
    assert "[bench]" not in r.stdout  # nothing started
