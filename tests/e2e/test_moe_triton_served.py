"""The grouped MoE kernels (``VLLM_BI_MOE=triton|exact``, meant for CUDA) served end to end on CPU through Triton's
interpreter: a real ``vllm serve`` of a Qwen3.5-MoE whose expert layers run the bf16 kernels, and ``vllm-bi
parity`` whose trainer runs them too: every sampled token's logprob equal; a trainer on the float64 loop path is
refused before sampling (exit 2), since the two give other bits. A server on the float64 kernels (``exact``) and a
trainer on the default loop path: every token equal, no refusal (the same bits)."""

import json

import pytest


pytestmark = pytest.mark.server

MOE_ENV = {"VLLM_BI_MOE": "triton", "TRITON_INTERPRET": "1"}
# three short prompts, 2 samples of 6 tokens each: every expert kernel runs interpreted, on the server and in the
# trainer, so each token costs seconds
PROMPTS = ["The grouped kernels sort", "Seven experts of", "A short third prompt about routing tokens"]
TOKENS = len(PROMPTS) * 2 * 6


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture(scope="module")
def server(bi_server):
    pytest.importorskip("triton")
    with bi_server("qwen3.5-moe", MOE_ENV) as srv:
        yield srv.model, srv.url


def test_trainer_equals_server_with_the_grouped_moe_kernels(server, parity_cli, prompts_file):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--prompts", prompts_file, "--n", "2", "--max-tokens", "6",
                   "--json", env=MOE_ENV)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == TOKENS and rep["bitwise_equal"] == rep["tokens"], rep
    assert "MoE experts triton" in rep["settings"], rep


def test_a_trainer_on_the_loop_path_is_refused(server, parity_cli):
    model, url = server
    r = parity_cli("--model", model, "--server", url, "--n", "1", "--max-tokens", "4",
                   env={"VLLM_BI_MOE": "loop"})
    assert r.returncode == 4, r.stdout + r.stderr[-3000:]  # settings differ
    assert "VLLM_BI_MOE" in r.stderr and "triton" in r.stderr


@pytest.mark.extended  # the float64 kernels interpreted: minutes; tests/ops/test_moe_triton.py checks their bits
def test_a_server_on_the_exact_kernels_gives_the_loop_paths_bits(bi_server, parity_cli, prompts_file):
    pytest.importorskip("triton")
    with bi_server("qwen3.5-moe", {"VLLM_BI_MOE": "exact", "TRITON_INTERPRET": "1"}) as srv:
        r = parity_cli("--model", srv.model, "--server", srv.url, "--prompts", prompts_file, "--n", "2",
                       "--max-tokens", "6", "--json", env={"VLLM_BI_MOE": "loop"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == TOKENS and rep["bitwise_equal"] == rep["tokens"], rep
    assert "MoE experts loop" in rep["settings"], rep
