"""P1, P3 and P4 over HTTP with `vllm serve` of a small random Kimi Linear (KDA and MLA mixers, a sigmoid-routed
MoE), CPU, under ``VLLM_BATCH_INVARIANT=1``.

vLLM's CPU platform turns chunked prefill and prefix caching off for every MLA model, so a prompt is always one
prefill here and P2 has nothing to vary. The mechanism's negative controls are unit tests without an engine:
``tests/test_mla_glue.py`` (vLLM's weight-absorbed decode gives other bits than the prefill formulation) and
``tests/test_gdn_glue.py`` (KDA's per-channel decay and fp32 state)."""

import pytest
from parity_suite import check_p1, check_p3, check_p4
from scenarios import SEEDED, make_prompts, run_scenarios

from vllm_bi.launcher import VllmServer

pytestmark = pytest.mark.server

ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024"]
MODES = {"seeded": SEEDED}  # sampled at temperature 1 with a seed (the Qwen families' tests also run greedy)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    model = tiny_model_path("kimi-linear")
    with VllmServer(model, args=ARGS) as srv:
        res = run_scenarios(srv, make_prompts(seed=1), MODES, prefix=False)
    return model, res


def test_p1_batch_invariance(runs):
    assert check_p1(runs[1], "kimi-linear BI") == 6


def test_p3_decode_equals_prefill(runs):
    assert check_p3(runs[1], "kimi-linear") > 0


def test_p4_trainer_equals_server(runs):
    assert check_p4(runs[0], "kimi-linear", runs[1]) >= 48  # 3 distinct completions of 16 tokens
