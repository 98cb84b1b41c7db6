"""patches/*.diff apply cleanly to the installed vLLM and the patched files compile."""

import glob
import os
import py_compile
import re
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
DIFFS = sorted(glob.glob(os.path.join(ROOT, "patches", "*.diff")))


def _site() -> str:
    import vllm

    return os.path.dirname(os.path.dirname(vllm.__file__))


def test_there_are_patches():
    assert DIFFS, "patches/ holds no .diff"


@pytest.mark.parametrize("diff", DIFFS, ids=os.path.basename)
def test_patch_applies_to_installed_vllm(diff, tmp_path):
    if shutil.which("patch") is None:
        pytest.fail("the `patch` program is missing (apt-get install patch)")
    r = subprocess.run(["patch", "--dry-run", "-p1", "-i", diff], cwd=_site(), capture_output=True, text=True)
    assert r.returncode == 0 and "FAILED" not in r.stdout and "offset" not in r.stdout, r.stdout + r.stderr
    # apply to copies of the touched files and compile them
    text = open(diff).read()
    targets = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", text, flags=re.M)))
    for rel in targets:
        src = os.path.join(_site(), rel)
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(src):
            shutil.copy(src, dst)
    r = subprocess.run(["patch", "-p1", "-i", diff], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for rel in targets:
        py_compile.compile(str(tmp_path / rel), doraise=True)
