"""Kimi Linear (KDA and MLA mixers, a sigmoid-routed MoE) under ``VLLM_BATCH_INVARIANT=1`` on CPU, over HTTP with one
`vllm serve` of a small random checkpoint per GDN mode: P1-P4, then two steps of an FSDP2-sharded RL trainer (two
processes) against the same server at a logprob gap of 0.0 (its weight pushes reload the server's weights, so it runs
last). The recurrent mode runs in CI; the chunk mode (server, trainer and the checks here all in it) in the extended
tier (`-m extended`).

The server prefills at most 32 tokens a step with prefix caching on (vLLM's CPU platform turns both off for MLA
models; vllm_bi keeps them for Kimi Linear), so every prompt but the shortest is split, at other places alone than
in a busy batch. P2: a prompt that hits an 800-token cached prefix equals the same prompt after the cache is reset,
computed from position 0 in other pieces. The mechanism's negative controls are unit tests without an engine:
``tests/test_mla_glue.py`` (vLLM's weight-absorbed decode gives other bits than the prefill formulation) and
``tests/test_gdn_glue.py`` (KDA's per-channel decay and fp32 state)."""

import subprocess
import sys

import pytest
from parity_suite import check_p1, check_p3, check_p4
from scenarios import MAX_TOKENS, SEEDED, make_prompts, run_scenarios, same

from vllm_bi.launcher import VllmServer, cpu_env, free_port
from vllm_bi.models.kimi_linear import KimiLinearForCausalLM
from vllm_bi.trainer.metrics import read_metrics
from vllm_bi.weights import weight_digest

pytestmark = pytest.mark.server

ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024", "--max-num-batched-tokens", "32",
        "--enable-prefix-caching"]
MODES = {"seeded": SEEDED}  # sampled at temperature 1 with a seed (the Qwen families' tests also run greedy)


@pytest.fixture(scope="module", params=["recurrent", pytest.param("chunk", marks=pytest.mark.extended)])
def runs(request, tiny_model_path, tmp_path_factory):
    from vllm_bi import settings

    try:
        with pytest.MonkeyPatch.context() as mp:  # the server, the trainer and this process's checks in one mode
            mp.setenv("VLLM_BI_GDN_MODE", request.param)
            settings.reload()
            yield _serve(tiny_model_path("kimi-linear"), tmp_path_factory.mktemp("rl"), request.param)
    finally:
        settings.reload()  # the environment as it was


def _serve(model, run_dir, mode):
    with VllmServer(model, args=ARGS, env=cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})) as srv:
        assert srv.collective_rpc("vllm_bi_info")[0]["gdn_mode"] == mode
        prompts = make_prompts(seed=1, batches=3)
        res = run_scenarios(srv, prompts, MODES)
        srv.reset_prefix_cache()
        hits0 = srv.metric_sum("vllm:prefix_cache_hits_total")
        cold = srv.complete(prompts.shared_prefix_b, max_tokens=MAX_TOKENS, **SEEDED)
        cold_hits = srv.metric_sum("vllm:prefix_cache_hits_total") - hits0
        # the RL trainer FSDP2-sharded over two CPU processes (gloo): a unit per decoder layer
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "vllm_bi.trainer", "--server-url", srv.url, "--api-key", srv.api_key,
               "--model", model, "--run-dir", str(run_dir), "--steps", "2", "--prompts-per-step", "4",
               "--group-size", "2", "--max-tokens", "8", "--lr", "5e-3", "--progress", "false",
               "--tensorboard", "false"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        digest = srv.weight_digest()
    final = KimiLinearForCausalLM.from_pretrained(str(run_dir / "weights" / "v000002"))
    pushed = weight_digest(final.hf_state_dict().items())
    return model, res, read_metrics(str(run_dir)), (cold, cold_hits), (digest, pushed)


def test_p1_batch_invariance(runs):
    assert check_p1(runs[1], "kimi-linear BI") == 3


def test_p2_prefix_cache_hit_equals_a_cold_prompt(runs):
    res, (cold, cold_hits) = runs[1], runs[3]
    assert res.prefix_hits > 0, "the shared-prefix request did not hit the prefix cache"
    assert cold_hits == 0, f"the request after the cache reset hit {cold_hits} cached tokens"
    assert same(res.prefix_b["seeded"], cold), "kimi-linear: P2 broken (prefix-cache hit vs a cold prompt)"


def test_p3_decode_equals_prefill(runs):
    assert check_p3(runs[1], "kimi-linear") > 0


def test_p4_trainer_equals_server(runs):
    assert check_p4(runs[0], "kimi-linear", runs[1]) >= 64  # 3 prompts and the prefix-hit one, 16 tokens each


def test_sharded_rl_steps_at_a_logprob_gap_of_zero(runs):
    """Two on-policy steps of an FSDP2 trainer in two processes, a weight push after each (verified by the weight
    digest): every sampled token's trainer logprob equals the server's, and the server ends with the pushed weights
    (the shards gathered whole)."""
    rows, (served, pushed) = runs[2], runs[4]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["trainer/world_size"] == 2, r
        assert r["bit_wise/logprob_diff/max"] == 0.0 and r["bit_wise/frac_tokens_different"] == 0.0, r
        assert r["tokens/completion"] > 0
    assert served == pushed
