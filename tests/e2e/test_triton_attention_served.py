"""The Triton attention op (``VLLM_BI_ATTENTION=triton``, meant for CUDA) served end to end on CPU through Triton's
interpreter: a real ``vllm serve`` whose attention layers run the kernel in the paged cache, and ``vllm-bi parity``
whose trainer runs it on packed sequences: every sampled token's logprob equal. A trainer on the torch op is
refused before sampling (exit 2), since the two ops give other bits."""

import json

import pytest


pytestmark = pytest.mark.server

TRITON_ENV = {"VLLM_BI_ATTENTION": "triton", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def server(bi_server):
    pytest.importorskip("triton")
    with bi_server("qwen3.5", TRITON_ENV) as srv:
        yield srv.model, srv.url


def test_trainer_equals_server_with_the_triton_attention(server, parity_cli):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--n", "2", "--max-tokens", "12", "--json",
                   env=TRITON_ENV)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 8 * 2 * 12 and rep["bitwise_equal"] == rep["tokens"], rep
    assert "attention triton" in rep["settings"], rep  # the report names the op the trainer ran
    assert rep["server"] == "eager (no CUDA graphs)", rep  # and how the server ran (vLLM on CPU: no graphs)


def test_a_trainer_on_the_torch_attention_is_refused(server, parity_cli):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--n", "1", "--max-tokens", "4",
                   env={"VLLM_BI_ATTENTION": "torch"})
    assert r.returncode == 4, r.stdout + r.stderr[-3000:]  # settings differ
    assert "VLLM_BI_ATTENTION" in r.stderr and "triton" in r.stderr
