"""`vllm-bi parity` against a real BI server: passes with vllm_bi's trainer, fails (and shows where)
with HF transformers or with perturbed trainer weights."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_bi.launcher import VllmServer

pytestmark = pytest.mark.server

EXE = os.path.join(os.path.dirname(sys.executable), "vllm-bi")


@pytest.fixture(scope="module")
def server(tiny_model_path):
    model = tiny_model_path("qwen3-next")
    with VllmServer(model, args=["--max-num-batched-tokens", "64", "--max-num-seqs", "16"]) as srv:
        yield model, srv.url


def _parity(*args):
    return subprocess.run([EXE, "parity", *args], capture_output=True, text=True, timeout=900)


def test_parity_passes_with_the_vllm_bi_trainer(server):
    model, url = server
    r = _parity("--model", model, "--server", url, "--n", "2", "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 8 * 2 * 16 and rep["bitwise_equal"] == rep["tokens"]
    assert rep["max_abs_diff"] == 0.0 and rep["mean_abs_diff"] == 0.0 and rep["first_mismatch"] is None


def test_parity_fails_with_hf_transformers(server):
    model, url = server
    r = _parity("--model", model, "--server", url, "--n", "1", "--max-tokens", "8", "--trainer", "hf")
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "FAIL" in r.stdout and "first mismatch   sequence" in r.stdout


def test_parity_fails_with_perturbed_trainer_weights(server, tmp_path):
    from safetensors.torch import load_file, save_file

    model, url = server
    bad = tmp_path / "perturbed"
    shutil.copytree(model, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["model.norm.weight"] = (w["model.norm.weight"].float() + 0.01).to(torch.bfloat16)
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = _parity("--model", model, "--server", url, "--trainer-model", str(bad), "--n", "1", "--max-tokens", "8",
                "--json")
    assert r.returncode == 1
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["bitwise_equal"] < rep["tokens"] and rep["first_mismatch"] is not None


def test_parity_rejects_bad_prompt_file(server, tmp_path):
    model, url = server
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "no prompt field"}\n')
    r = _parity("--model", model, "--server", url, "--prompts", str(f))
    assert r.returncode == 2 and "expected an object with a string \"prompt\" field" in r.stderr
    assert "Traceback" not in r.stderr


def test_parity_on_multiturn_prompts(server, tmp_path):
    """A prompts file with tool outputs: each sample is a trajectory of model turns with the file's tool outputs
    between them, each turn a new request on the conversation's token ids; every model token's logprob equals the
    trainer's one forward over the trajectory. Control: transformers' own model fails on the same file."""
    model, url = server
    f = tmp_path / "turns.jsonl"
    f.write_text(json.dumps({"prompt": "the quick red fox ran over the river and", "tools": [" tool: ok.", " two"]})
                 + "\n" + json.dumps({"prompt": "one two three", "tools": [" result: 7"]}) + "\n")
    r = _parity("--model", model, "--server", url, "--prompts", str(f), "--n", "2", "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["sequences"] == 4 and rep["tokens"] == (2 * 3 + 2 * 2) * 8 == rep["bitwise_equal"]
    assert "multi-turn" in r.stderr
    r = _parity("--model", model, "--server", url, "--prompts", str(f), "--n", "1", "--max-tokens", "8",
                "--trainer", "hf")
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr[-2000:]
    f.write_text(json.dumps({"prompt": "x", "tools": "not a list"}) + "\n")
    r = _parity("--model", model, "--server", url, "--prompts", str(f))
    assert r.returncode == 2 and "\"tools\" must be a non-empty list" in r.stderr and "Traceback" not in r.stderr
