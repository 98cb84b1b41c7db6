"""``benchmarks/trainer_step.py``: the table's ratios against the first side, its GPU-part rows only where every side
was profiled, a bad side refused, and one CPU run end to end (both sides in processes of their own)."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "trainer_step.py")
spec = importlib.util.spec_from_file_location("trainer_step", BENCH)
TS = importlib.util.module_from_spec(spec)
spec.loader.exec_module(TS)


def _side(name, wall, peak=None, parts=None):
    return {"side": name, "wall_ms": wall, "peak_gib": peak, "parts": parts, "arithmetic": ""}


def test_table_ratios_are_against_the_first_side_and_parts_need_every_side():
    rows = [_side("stock", 10.0, 40.0, {"GEMM": 4.0, "GDN": 2.0}),
            _side("vllm_bi", 16.0, 44.0, {"GEMM": 5.0, "GDN": 8.0, "other": 1.0})]
    text = "\n".join(TS.table(rows))
    assert "| wall ms per micro-batch (median) | 10.0 | 16.0 | 1.60x |" in text
    assert "| peak GiB allocated | 40.00 | 44.00 | 1.10x |" in text
    assert "| GPU ms: GDN | 2.0 | 8.0 | 4.00x |" in text and "| GPU ms: all kernels | 6.0 | 14.0 | 2.33x |" in text
    assert "| GPU ms: other | 0.0 | 1.0 |  |" in text  # a part the reference side has none of: no ratio
    cpu = "\n".join(TS.table([_side("stock", 10.0), _side("vllm_bi", 5.0)]))
    assert "0.50x" in cpu and "GPU ms" not in cpu and "peak" not in cpu


def test_a_bad_side_or_model_is_refused_in_one_line():
    r = subprocess.run([sys.executable, BENCH, "--model", "m", "--sides", "stock,fast"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and "side 'fast'" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, BENCH, "--model", "/no/such/checkpoint"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "--model /no/such/checkpoint: no such directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_both_sides_run_on_cpu(tiny_model_path, tmp_path):
    model = tiny_model_path("qwen3-next")
    out = tmp_path / "t.md"
    r = subprocess.run([sys.executable, BENCH, "--model", model, "--sides", "stock,vllm_bi", "--seqs", "2",
                        "--prompt", "8", "--completion", "4", "--reps", "1", "--accumulate", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "| | stock | vllm_bi | vllm_bi / stock |" in text and "wall ms per micro-batch" in text
    assert "of it the forward (logprobs, entropy)" in text and "of it the gradients added to the fp32 masters" in text
    assert "vllm_bi: GDN recurrent" in text and "lm_head over completions rows" in text
