"""Real `vllm serve` on CUDA with VLLM_BATCH_INVARIANT=1 (vllm_bi plugin): P1 (alone vs busy batch),
P2 (--max-num-batched-tokens 32 vs 2048), P3 (decode vs prompt_logprobs), exact equality, on a tiny
Qwen3.5 built on the spot. Runs scripts/gpu_serve_parity.py (two server starts, a few minutes).

On the device: `scripts/gpu_run.sh` installs vLLM's GPU build; then `pytest -m gpu tests/gpu`.
"""

import json
import os
import subprocess
import sys

import pytest
from gpu_env import require_cuda_vllm_fla

pytestmark = [pytest.mark.gpu, pytest.mark.server]

require_cuda_vllm_fla()

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serving_parity_qwen3_5(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_serve_parity.py"), "--family", "qwen3.5",
           "--modes", "bi", "--trials", "1", "--out", str(tmp_path), "--models", str(tmp_path / "models")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    (res,) = results.values()
    assert "error" not in res, res.get("error", "") + proc.stdout[-2000:]
    for key in ("P1", "P2", "P3"):
        bad = [r for r in res[key] if not r["equal"]]
        assert not bad, f"{key} not bitwise equal: {bad}"
