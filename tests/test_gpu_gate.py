"""The GPU gate's record (``vllm_bi.gpu_gate``): every module with a Triton kernel or a CUDA branch is in the manifest
of hashed CUDA sources; the status names a changed file and a failed job; the README's status line is the one the
record generates; CI prints the status (``scripts/test.sh``)."""

import json
import os
import re

import pytest

from vllm_bi import gpu_gate as G

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a Triton kernel, fla-core, a CUDA branch of a tensor or the platform
CUDA_CODE = re.compile(r"triton\.jit|\bis_cuda\b|^\s*(from|import) fla\b|current_platform\.is_cuda", re.M)
# modules that mention CUDA only to choose a device for the trainer or a tool, with no CUDA-only arithmetic
DEVICE_CHOICE_ONLY = {"vllm_bi/diag.py", "vllm_bi/parity.py", "vllm_bi/trainer/distributed.py", "vllm_bi/weights.py",
                      "vllm_bi/gpu_gate.py"}


def _modules():
    for base, _, files in os.walk(os.path.join(ROOT, "vllm_bi")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                yield os.path.relpath(path, ROOT).replace(os.sep, "/"), open(path).read()


def test_every_cuda_module_is_in_the_manifest():
    cuda = {rel for rel, text in _modules() if CUDA_CODE.search(text) or os.path.basename(rel).startswith("cuda")}
    missing = sorted(cuda - set(G.CUDA_SOURCES) - DEVICE_CHOICE_ONLY)
    assert not missing, f"modules with CUDA code missing from vllm_bi.gpu_gate.CUDA_SOURCES: {missing}"
    tables = {f"vllm_bi/ops/gemm_tiles/{f}" for f in os.listdir(os.path.join(ROOT, "vllm_bi", "ops", "gemm_tiles"))
              if f.endswith(".json")}
    assert tables and not tables - set(G.CUDA_SOURCES), f"shipped tile tables missing: {tables - set(G.CUDA_SOURCES)}"
    gone = [f for f in G.CUDA_SOURCES if not os.path.exists(os.path.join(ROOT, f))]
    assert not gone, f"CUDA_SOURCES lists files that do not exist: {gone}"
    # the rule finds the kernels it is meant to find (a pattern that matched nothing would pass the check above)
    assert {"vllm_bi/gdn/chunk_decode.py", "vllm_bi/ops/conv.py", "vllm_bi/patch/cuda_ops.py"} <= cuda


def _record(**over):
    hashes = G.source_hashes(ROOT)
    rec = {"date": "2026-12-02", "device": "NVIDIA H200", "versions": {"vllm": "0.32.0", "torch": "2.11.0",
                                                                       "triton": "3.6.0", "fla": "0.6.0"},
           "sources": hashes, "sources_hash": G.combined_hash(hashes),
           "jobs": [{"job": "qwen3.5 chunk default", "as_expected": True}]}
    rec.update(over)
    return rec


def test_status_names_changed_sources_and_failed_jobs():
    ok, line = G.status(_record(), G.source_hashes(ROOT))
    assert ok and line.startswith("GPU-verified"), line
    hashes = dict(G.source_hashes(ROOT), **{"vllm_bi/ops/conv.py": "0" * 64})
    ok, line = G.status(_record(), hashes)
    assert not ok and "changed since the last GPU gate" in line and "vllm_bi/ops/conv.py" in line, line
    ok, line = G.status(_record(jobs=[{"job": "qwen3.5 chunk default", "as_expected": False}]), G.source_hashes(ROOT))
    assert not ok and "failed" in line and "qwen3.5 chunk default" in line, line
    ok, line = G.status(None)
    assert not ok and "no GPU gate record" in line
    # a record of part of its matrix (--match, one --part) verifies nothing
    ok, line = G.status(_record(matrix=["qwen3.5 chunk default", "control: stock vLLM qwen3.5"]), G.source_hashes(ROOT))
    assert not ok and "1 jobs missing" in line and "control: stock vLLM qwen3.5" in line, line
    ok, line = G.status(_record(matrix=["qwen3.5 chunk default"]), G.source_hashes(ROOT))
    assert ok, line


def test_readme_status_line_is_generated_from_the_record():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    record = G.load_record(os.path.join(ROOT, G.RECORD))
    assert G.readme_block(record) in readme, (
        "README's GPU gate line differs from docs/results/gpu-gate.json: run python -m vllm_bi.gpu_gate --readme "
        "README.md")


def test_the_record_is_complete():
    path = os.path.join(ROOT, G.RECORD)
    if not os.path.exists(path):
        pytest.skip("no GPU gate has run")
    with open(path) as f:
        rec = json.load(f)
    assert {"date", "device", "versions", "command", "sources", "sources_hash", "jobs"} <= set(rec)
    assert rec["sources_hash"] == G.combined_hash(rec["sources"])
    assert all({"job", "result", "as_expected"} <= set(j) for j in rec["jobs"])


def test_ci_prints_the_gate_status():
    with open(os.path.join(ROOT, "scripts", "test.sh")) as f:
        assert "vllm_bi.gpu_gate" in f.read()


def test_a_gate_split_over_calls_is_combined_only_at_the_same_sources(tmp_path):
    """``scripts/gpu_gate.py --combine``: one call's record plus another call's per-job lines make one record with
    every job; a record of other sources is refused (exit 2, nothing written)."""
    import json
    import subprocess
    import sys

    from vllm_bi.gpu_gate import combined_hash, source_hashes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hashes = source_hashes(root)
    base = {"date": "2026-12-02", "device": "NVIDIA H200", "versions": {}, "command": "gate --match control",
            "seconds": 1, "sources": hashes, "sources_hash": combined_hash(hashes),
            "jobs": [{"job": "control", "result": "0/8 equal", "passed": False, "expect_pass": False,
                      "as_expected": True}]}
    (tmp_path / "base.json").write_text(json.dumps(base))
    line = {"job": "qwen3.5 chunk default", "kind": "parity", "env": {}, "expect_pass": True, "passed": True,
            "tokens": 8, "bitwise_equal": 8, "max_abs_diff": 0.0, "seconds": 2.0}
    (tmp_path / "gate.jsonl").write_text(json.dumps(line) + "\n")
    script = os.path.join(root, "scripts", "gpu_gate.py")
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--combine", str(tmp_path / "base.json"),
                        str(tmp_path / "gate.jsonl")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((tmp_path / "gpu-gate.json").read_text())
    assert [j["job"] for j in rec["jobs"]] == ["control", "qwen3.5 chunk default"]
    assert rec["jobs"][1]["result"] == "8/8 equal, max |diff| 0" and rec["jobs"][1]["as_expected"]
    (tmp_path / "gpu-gate.json").unlink()
    # a matrix job that no call finished enters the record as not run
    (tmp_path / "base.json").write_text(json.dumps(dict(base, matrix=["control", "qwen3.5 chunk default",
                                                                      "qwen3-next chunk default"])))
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--combine", str(tmp_path / "base.json"),
                        str(tmp_path / "gate.jsonl")], capture_output=True, text=True)
    assert r.returncode == 1 and "2/3 as expected" in r.stdout, r.stdout + r.stderr
    rec = json.loads((tmp_path / "gpu-gate.json").read_text())
    assert rec["jobs"][2] == {"job": "qwen3-next chunk default", "result": "not run", "passed": False,
                              "expect_pass": True, "as_expected": False}
    (tmp_path / "gpu-gate.json").unlink()
    base["sources_hash"] = "0" * 64  # control: another checkout's record
    (tmp_path / "base.json").write_text(json.dumps(base))
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--combine", str(tmp_path / "base.json"),
                        str(tmp_path / "gate.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "other CUDA sources" in r.stderr and not (tmp_path / "gpu-gate.json").exists()


def test_the_matrix_splits_into_parts_that_cover_it_once(tmp_path):
    """``gpu_gate.py --part K/N``: the parts are disjoint and together the whole matrix, each holds the jobs of more
    than one model, and a malformed part is refused in one line."""
    import sys

    sys.path[:0] = [os.path.join(ROOT, "scripts")]
    try:
        import gpu_gate as script
    finally:
        del sys.path[:1]
    todo = script.jobs(str(tmp_path))
    names = [j.name for j, _ in todo]
    parts = [[j.name for j, _ in script.part_of(todo, f"{k}/2")] for k in (1, 2)]
    assert sorted(parts[0] + parts[1]) == sorted(names) and not set(parts[0]) & set(parts[1])
    assert all(len({w["model"] for j, w in todo if j.name in p}) > 1 for p in parts)
    for bad in ("3/2", "0/2", "half"):
        with pytest.raises(SystemExit, match="--part wants K/N"):
            script.part_of(todo, bad)


def test_gpu_run_refuses_to_skip_the_install_on_a_fresh_machine(tmp_path):
    """``VLLM_BI_NO_INSTALL=1`` on a machine with nothing staged would run every job without vLLM: one line, exit 2."""
    import subprocess

    env = {**os.environ, "VLLM_BI_SITE": str(tmp_path / "site"), "VLLM_BI_NO_INSTALL": "1", "OUT": str(tmp_path)}
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_run.sh"), "check"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "VLLM_BI_NO_INSTALL=1 but nothing is installed" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "check.log").exists()
