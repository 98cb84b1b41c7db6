"""``benchmarks/gdn_server_io.py`` refuses a bad shape and a machine without CUDA in one line each (its sides are
CUDA's paths; the GPU run is the measurement)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gdn_server_io.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)


def test_bad_shape_refused_in_one_line():
    for shape in ("decode:64x2", "prefill:8", "warm:1x1"):
        r = _run("--shapes", shape)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].endswith(f"--shapes: {shape!r}: a shape is prefill:NxT or decode:Nx1")


def test_without_cuda_refused_in_one_line():
    r = _run("--shapes", "decode:4x1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith("needs a CUDA device (the direct glue and the gates kernel are "
                                                      "CUDA's paths)")
