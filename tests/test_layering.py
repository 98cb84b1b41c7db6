"""The package's layering (import-linter contracts in ``pyproject.toml``, run by ``scripts/test.sh``): the check passes
on the tree, and fails when a copy of the tree gets an upward import (the op library importing the GDN family) or
an import cycle."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def lint(tree: str, tmp_path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the package at ``tree`` (its parent first on the path), with the repository's contracts."""
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.run([LINT, "--config", os.path.join(ROOT, "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def tree(tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "vllm_bi"), dst / "vllm_bi", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_the_tree_keeps_every_contract(tree, tmp_path):
    r = lint(str(tree), tmp_path)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_an_upward_import_breaks_the_layers(tree, tmp_path):
    with open(tree / "vllm_bi" / "ops" / "reduce.py", "a") as f:
        f.write("\nfrom vllm_bi.gdn import layer  # an op importing the GDN family: upward\n")
    r = lint(str(tree), tmp_path)
    assert r.returncode != 0 and "vllm_bi.ops.reduce -> vllm_bi.gdn.layer" in r.stdout, r.stdout[-3000:]


def test_an_import_cycle_breaks_the_acyclic_contract(tree, tmp_path):
    with open(tree / "vllm_bi" / "gdn" / "recurrent.py", "a") as f:
        f.write("\nfrom vllm_bi.gdn import chunk  # chunk imports recurrent: a cycle\n")
    r = lint(str(tree), tmp_path)
    assert r.returncode != 0 and "no import cycles" in r.stdout and "BROKEN" in r.stdout, r.stdout[-3000:]
