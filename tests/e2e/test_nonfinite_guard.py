"""A NaN is never served (``vllm_bi.patch.nonfinite``, on by default): a BI server (on CPU here; the same test
runs on a GPU machine) whose checkpoint has one embedding row poisoned with NaN fails exactly the request that reads
that token (HTTP 500 with vllm_bi's message), a clean request served alongside it gets finite logprobs, and after it
the server serves a clean request with the same tokens and logprobs as before it. Without the guard's count, the same
logits are served (control, on the counting function and on the scheduler's step)."""

import json
import math
import os
import shutil
import threading
import types
import urllib.error
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.server

POISON = 7  # the token whose embedding row is NaN


@pytest.fixture(scope="module")
def poisoned_server(tiny_model_path, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from vllm_bi.launcher import VllmServer, cpu_env

    src = tiny_model_path("qwen3.5")
    path = str(tmp_path_factory.mktemp("poisoned") / "model")
    shutil.copytree(src, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    (name,) = [k for k in weights if k.endswith("embed_tokens.weight")]
    weights[name][POISON] = float("nan")
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with VllmServer(path, args=["--max-num-batched-tokens", "64", "--max-num-seqs", "8"],
                    env=cpu_env(True, {"VLLM_BI_NONFINITE_GUARD": ""})) as srv:
        yield srv


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _request(srv, prompt: list[int]) -> dict:
    return {"model": srv.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True}


def test_a_nan_fails_its_request_and_the_server_serves_the_others(poisoned_server):
    srv = poisoned_server
    clean = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    poisoned = [21, 22, POISON, 23, 24]
    results = {}

    def send(key, prompt):
        results[key] = _post(srv.url, _request(srv, prompt))

    threads = [threading.Thread(target=send, args=("clean", clean)),
               threading.Thread(target=send, args=("poisoned", poisoned))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    code, body = results["poisoned"]
    assert code == 500, (code, body)
    assert "NaN or +inf" in body["error"]["message"], body
    code, body = results["clean"]
    assert code == 200, (code, body)
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == 6 and all(math.isfinite(x) for x in lps), lps
    # the engine goes on serving: the clean request again, alone, gives the same tokens and logprobs
    code, again = _post(srv.url, _request(srv, clean))
    assert code == 200 and again["choices"][0]["logprobs"] == body["choices"][0]["logprobs"]
    assert srv.healthy()


def test_the_count_takes_nan_and_plus_inf_not_minus_inf():
    from vllm_bi.patch.nonfinite import count_nonfinite_per_row

    x = torch.zeros(4, 5)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    x[3, :] = float("-inf")
    assert count_nonfinite_per_row(x).tolist() == [0, 1, 1, 0]
    # control: vLLM's own per-row count (NaN alone) misses the +inf row
    assert x.isnan().sum(-1, dtype=torch.int32).tolist() == [0, 1, 0, 0]


def test_the_scheduler_step_drops_the_bad_token_and_fails_the_request():
    from vllm_bi.patch.nonfinite import wrap_update_from_output as _wrap_update_from_output

    seen = {}

    def orig(self, so, mro):
        seen["tokens"] = [list(t) for t in mro.sampled_token_ids]
        seen["failed"] = set(self.encoder_cache_mismatch_reqs)
        return {}

    def step(counts):
        sched = types.SimpleNamespace(encoder_cache_mismatch_reqs=set())
        so = types.SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1})
        mro = types.SimpleNamespace(num_nans_in_logits=counts, sampled_token_ids=[[5], [6]],
                                    req_id_to_index={"a": 0, "b": 1})
        _wrap_update_from_output(orig)(sched, so, mro)
        return seen["tokens"], seen["failed"]

    assert step({"a": 0, "b": 3}) == ([[5], []], {"b"})
    # control: with no count (the guard off, vLLM's accounting disabled) every token goes through
    assert step(None) == ([[5], [6]], set())
