"""Kimi Linear (KDA and MLA mixers, a sigmoid-routed MoE) under ``VLLM_BATCH_INVARIANT=1`` on CPU, over HTTP with one
`vllm serve` of a small random checkpoint: P1, P3 and P4, then two RL trainer steps against the same server at a
logprob gap of 0.0 (its weight pushes reload the server's weights, so it runs last).

vLLM's CPU platform turns chunked prefill and prefix caching off for every MLA model, so a prompt is always one
prefill here and P2 has nothing to vary. The mechanism's negative controls are unit tests without an engine:
``tests/test_mla_glue.py`` (vLLM's weight-absorbed decode gives other bits than the prefill formulation) and
``tests/test_gdn_glue.py`` (KDA's per-channel decay and fp32 state)."""

import pytest
from parity_suite import check_p1, check_p3, check_p4
from scenarios import SEEDED, make_prompts, run_scenarios

from vllm_bi.launcher import VllmServer, cpu_env

pytestmark = pytest.mark.server

ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024"]
MODES = {"seeded": SEEDED}  # sampled at temperature 1 with a seed (the Qwen families' tests also run greedy)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    from vllm_bi.trainer.config import TrainerConfig
    from vllm_bi.trainer.loop import train

    model = tiny_model_path("kimi-linear")
    with VllmServer(model, args=ARGS, env=cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})) as srv:
        res = run_scenarios(srv, make_prompts(seed=1, batches=3), MODES, prefix=False)
        rows = train(TrainerConfig(model=model, server_url=srv.url, api_key=srv.api_key,
                                   run_dir=str(tmp_path_factory.mktemp("rl")), steps=2, prompts_per_step=4,
                                   group_size=2, max_tokens=8, lr=5e-3, progress=False, tensorboard=False))
    return model, res, rows


def test_p1_batch_invariance(runs):
    assert check_p1(runs[1], "kimi-linear BI") == 3


def test_p3_decode_equals_prefill(runs):
    assert check_p3(runs[1], "kimi-linear") > 0


def test_p4_trainer_equals_server(runs):
    assert check_p4(runs[0], "kimi-linear", runs[1]) >= 48  # 3 distinct completions of 16 tokens


def test_rl_steps_at_a_logprob_gap_of_zero(runs):
    """Two on-policy steps, a weight push after each (verified by the weight digest): every sampled token's
    trainer logprob equals the server's."""
    rows = runs[2]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["bit_wise/logprob_diff/max"] == 0.0 and r["bit_wise/frac_tokens_different"] == 0.0, r
        assert r["tokens/completion"] > 0
