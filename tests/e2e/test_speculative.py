"""Speculative decoding with the model's MTP drafter under batch invariance (CPU, recurrent GDN mode).

The criterion: a request's tokens and logprobs with speculation on equal those with speculation off, bit for bit,
greedy or seeded at a temperature, whatever its batch mates (P1), and equal the trainer's recompute (P4). The test model is the tiny Qwen3-Next with one
random MTP layer and an LM head narrowed to two tokens (rows ``v`` and ``-v``, every other row zero), so that target
and drafter agree often enough for drafts to be accepted, in runs of different lengths; the RL test's is the tiny
Qwen3.5 made the same way (Qwen3.5's own drafter class). Negative control: stock vLLM
(batch invariance off) on the same model and prompts gives other logprob bits with speculation on than off (its
multi-token verify is another kernel than its decode)."""

import json
import os

import pytest
import torch

from vllm_bi.client import ServerError
from vllm_bi.launcher import VllmServer, cpu_env
from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
from vllm_bi.parity import trainer_logprobs
from vllm_bi.tiny_models import add_mtp_layer
from speculation import ONE_TOKEN, PROMPTS, SPEC, greedy, one_token_prompts, plain_run, speculative_run

pytestmark = pytest.mark.server

ARGS = ["--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def mtp_model(tiny_model_path, tmp_path_factory):
    return add_mtp_layer(tiny_model_path("qwen3-next"), str(tmp_path_factory.mktemp("mtp") / "qwen3-next-mtp"))


@pytest.fixture(scope="module")
def served(mtp_model):
    """Greedy completions of every prompt from a batch-invariant server with and without speculation; with it, also
    each prompt alone, the server's acceptance counters and its answer to a request at a temperature."""
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(mtp_model, env=env, args=ARGS) as srv:
        out = plain_run(srv)
    with VllmServer(mtp_model, env=env, args=ARGS + SPEC) as srv:
        out.update(speculative_run(srv))
        with pytest.raises(ServerError) as refused:
            srv._post("/v1/completions", {"model": srv.model, "prompt": PROMPTS[0], "max_tokens": 4,
                                          "repetition_penalty": 1.3})
        out["refused"] = str(refused.value)
        out["one_token_busy"], out["one_token_alone"] = one_token_prompts(srv)
        out["after"] = greedy(srv, PROMPTS[:1])[0]
    return out


def test_speculation_changes_no_bit_and_drafts_are_accepted(served):
    assert served["drafted"] > 0 and 0 < served["accepted"] < served["drafted"], served  # some drafts kept, some not
    for plain, spec in zip(served["plain"], served["spec"]):
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == plain.logprobs  # the same floats: the same bits
    assert len({tuple(c.token_ids) for c in served["spec"]}) > 1  # the narrowed head still gives different runs


def test_speculation_at_a_temperature_changes_no_bit(served):
    """Seeded sampling at temperature 1: each position's sample is keyed to the request's seed and its token index,
    and a draft is kept only when it equals that sample."""
    for plain, spec in zip(served["plain_sampled"], served["spec_sampled"]):
        assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs
    greedy_ids = [c.token_ids for c in served["spec"]]
    assert [c.token_ids for c in served["spec_sampled"]] != greedy_ids  # sampling, not greedy decoding


def test_speculation_batch_invariant(served):
    for alone, busy in zip(served["alone"] + served["alone_sampled"], served["spec"] + served["spec_sampled"][:1]):
        assert alone.token_ids == busy.token_ids and alone.logprobs == busy.logprobs


def test_trainer_recompute_equals_speculative_server(served, mtp_model):
    model = QwenGDNForCausalLM.from_pretrained(mtp_model)
    done = served["spec"] + served["spec_sampled"] + served["one_token_busy"]
    assert trainer_logprobs(model, done) == [c.logprobs for c in done]


def test_one_token_prompts_beside_running_decodes(served):
    """A one-token prompt scheduled beside running decodes becomes a speculative row whose slots held an earlier
    request's state: the glue zeroes them (``new_spec_requests``), so it equals the same prompt alone (the glue test
    ``test_new_request_in_a_speculative_row_starts_from_zeros`` has the control)."""
    for busy, alone in zip(served["one_token_busy"], served["one_token_alone"]):
        assert busy.token_ids == alone.token_ids and busy.logprobs == alone.logprobs
    assert len({c.logprobs[0] for c in served["one_token_alone"]}) == len(ONE_TOKEN)  # four prompts, four answers


def test_penalty_refused_server_keeps_serving(served):
    assert "repetition_penalty makes a token's sample depend on the draft tokens" in served["refused"]
    assert served["after"].token_ids == served["spec"][0].token_ids


def test_stock_speculation_changes_logprob_bits(mtp_model):
    """Negative control: without batch invariance the same drafter changes the served logprobs' bits."""
    env, eager = cpu_env(False), ["--enforce-eager"]  # stock's kernels without its compile step (start-up time)
    with VllmServer(mtp_model, batch_invariant=False, env=env, args=ARGS + eager) as srv:
        plain = greedy(srv, PROMPTS)
    with VllmServer(mtp_model, batch_invariant=False, env=env, args=ARGS + eager + SPEC) as srv:
        spec = greedy(srv, PROMPTS)
    assert any(p.logprobs != s.logprobs for p, s in zip(plain, spec))


def test_rl_trainer_with_speculation_at_zero_gap(tiny_model_path, tmp_path):
    """Two RL steps (rollouts at temperature 1, weight pushes) against a server that decodes speculatively with
    Qwen3.5's own MTP drafter (vllm_bi's text-only ``Qwen3_5MTP``: vLLM's imports the vision tower): every sampled
    token's trainer logprob equals the server's, and drafts were made and accepted (the server's counters)."""
    import subprocess
    import sys

    mtp_model = add_mtp_layer(tiny_model_path("qwen3.5"), str(tmp_path / "qwen3.5-mtp"))
    run = tmp_path / "rl"
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(mtp_model, env=env, args=["--max-num-batched-tokens", "256", "--max-num-seqs", "32", *SPEC]) as srv:
        r = subprocess.run([sys.executable, "-m", "vllm_bi.trainer", "--model", mtp_model, "--steps", "2", "--run-dir",
                            str(run), "--progress", "false", "--server-url", srv.url],
                           capture_output=True, text=True, timeout=900, env=dict(os.environ, VLLM_API_KEY=srv.api_key))
        drafted = srv.metric_sum("vllm:spec_decode_num_draft_tokens_total")
        accepted = srv.metric_sum("vllm:spec_decode_num_accepted_tokens_total")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all(row["bit_wise/logprob_diff/max"] == 0.0 for row in rows), rows
    assert drafted > 0 and accepted > 0, (drafted, accepted)
