"""The grouped MoE kernels (``VLLM_BI_MOE=triton|exact``, meant for CUDA) served end to end on CPU through Triton's
interpreter: a real ``vllm serve`` of a Qwen3.5-MoE whose expert layers run the bf16 kernels, and ``vllm-bi
parity`` whose trainer runs them too: every sampled token's logprob equal; a trainer on the float64 loop path is
refused before sampling (exit 2), since the two give other bits. A server on the float64 kernels (``exact``) and a
trainer on the default loop path: every token equal, no refusal (the same bits)."""

import json

import pytest


pytestmark = pytest.mark.server

MOE_ENV = {"VLLM_BI_MOE": "triton", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def server(bi_server):
    pytest.importorskip("triton")
    with bi_server("qwen3.5-moe", MOE_ENV) as srv:
        yield srv.model, srv.url


def test_trainer_equals_server_with_the_grouped_moe_kernels(server, parity_cli):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--n", "2", "--max-tokens", "8", "--json",
                   env=MOE_ENV)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 8 * 2 * 8 and rep["bitwise_equal"] == rep["tokens"], rep
    assert "MoE experts triton" in rep["settings"], rep


def test_a_trainer_on_the_loop_path_is_refused(server, parity_cli):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--n", "1", "--max-tokens", "4",
                   env={"VLLM_BI_MOE": "loop"})
    assert r.returncode == 4, r.stdout + r.stderr[-3000:]  # settings differ
    assert "VLLM_BI_MOE" in r.stderr and "triton" in r.stderr


def test_a_server_on_the_exact_kernels_gives_the_loop_paths_bits(bi_server, parity_cli):
    pytest.importorskip("triton")
    with bi_server("qwen3.5-moe", {"VLLM_BI_MOE": "exact", "TRITON_INTERPRET": "1"}) as srv:
        r = parity_cli("--model", srv.model, "--server", srv.url, "--n", "2", "--max-tokens", "8", "--json",
                       env={"VLLM_BI_MOE": "loop"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 8 * 2 * 8 and rep["bitwise_equal"] == rep["tokens"], rep
    assert "MoE experts loop" in rep["settings"], rep
