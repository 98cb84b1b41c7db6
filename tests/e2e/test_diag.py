"""`vllm-bi diag` on CPU: vLLM in-process with hooks vs the trainer model, module by module. With the same
weights every module is bitwise equal (exit 0); with one norm weight of layer 2 perturbed in the trainer's
copy, the first difference is named exactly there (exit 1) and everything before it is still equal."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.server

EXE = os.path.join(os.path.dirname(sys.executable), "vllm-bi")


def _diag(*args):
    r = subprocess.run([EXE, "diag", "--json", *args], capture_output=True, text=True, timeout=900)
    rows = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    return r, rows


def test_diag_all_equal_then_names_the_perturbed_module(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model_path("qwen3.5")
    r, rows = _diag("--model", model)
    assert r.returncode == 0, r.stderr[-3000:]
    modules = [row["module"] for row in rows]
    assert "layers.0.linear_attn" in modules and "layers.3.self_attn" in modules and modules[-1] == "prompt_logprobs"
    assert all(row["rows_differing"] == 0 and row["max_abs_diff"] == 0.0 for row in rows), rows

    bad = tmp_path / "perturbed"
    shutil.copytree(model, bad)
    w = load_file(str(bad / "model.safetensors"))
    name = "model.layers.2.post_attention_layernorm.weight"
    w[name] = (w[name].float() + 0.05).to(torch.bfloat16)
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r, rows = _diag("--model", model, "--trainer-model", str(bad))
    assert r.returncode == 1, r.stderr[-3000:]
    first = next(row for row in rows if row["rows_differing"])
    assert first["module"] == "layers.2.post_attention_layernorm"
    assert all(row["rows_differing"] == 0 for row in rows[: rows.index(first)])
