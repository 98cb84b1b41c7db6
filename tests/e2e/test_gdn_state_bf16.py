"""The bf16 GDN state (``VLLM_BI_GDN_STATE=bf16``) end to end on CPU, one real server: a bf16 state cache, prompts
of 70-260 tokens prefilled in 32-token steps (so a prompt's state is stored and reloaded at arbitrary positions), all
in one busy batch with prefix caching on.

* the server reports the setting among its arithmetic (its GDN glue refuses a state cache in another dtype, so every
  served token below came through a bf16 cache);
* P1: a request alone == the same request inside the busy batch (tokens and logprobs, exact);
* P3: each decode logprob (one token per step, the state stored after every one) == its ``prompt_logprobs`` entry
  (the whole sequence prefilled in 32-token steps);
* P4: the trainer with the same setting recomputes every sampled token's logprob bit for bit;
* negative control: the trainer with the fp32 state does not (the setting changes the bits), and the trainer's
  server check refuses that mismatch by name.
"""

import pytest
from scenarios import (CORPUS_SERVER_ARGS, check_alone_equals_busy, check_decode_equals_prompt_logprobs,
                       corpus_busy_and_alone)

pytestmark = pytest.mark.server

STATE = {"VLLM_BI_GDN_STATE": "bf16"}


@pytest.fixture(scope="module")
def served(tiny_model_path, bi_server):
    model = tiny_model_path("qwen3.5")
    with bi_server("qwen3.5", STATE, CORPUS_SERVER_ARGS) as srv:
        _, busy, alone = corpus_busy_and_alone(srv, model, seed=1, corpus_seed=5, max_tokens=16, sample_seed=200)
        yield model, srv, busy, alone


def test_server_reports_the_bf16_state(served):
    _, srv, busy, _ = served
    assert srv.server_info()["gdn_state"] == "bf16"
    assert all(len(c.prompt_ids) > 64 for c in busy)


def test_p1_alone_equals_busy(served):
    _, _, busy, alone = served
    check_alone_equals_busy(busy, alone)


def test_p3_decode_equals_prompt_logprobs(served):
    _, srv, _, alone = served
    check_decode_equals_prompt_logprobs(srv, alone[:2])


def test_p4_trainer_with_the_bf16_state_is_bit_exact(served, monkeypatch):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, _, busy, _ = served
    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    got = trainer_logprobs(QwenGDNForCausalLM.from_pretrained(model), busy, pack=8)
    for c, lp in zip(busy, got):
        assert lp == c.logprobs, "trainer != server"


def test_negative_control_fp32_trainer_differs_and_is_refused(served, monkeypatch):
    from vllm_bi.client import VllmClient
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.server import check_server

    model, srv, busy, _ = served
    monkeypatch.delenv("VLLM_BI_GDN_STATE", raising=False)
    got = trainer_logprobs(QwenGDNForCausalLM.from_pretrained(model), busy[:4], pack=4)
    same = sum(a == b for c, lp in zip(busy[:4], got) for a, b in zip(c.logprobs, lp))
    assert same < sum(len(c.logprobs) for c in busy[:4]), "the fp32 trainer reproduced the bf16-state server"
    with pytest.raises(TrainerError) as e:
        check_server(VllmClient(srv.url, model), verify_weights=False)
    assert "\n" not in str(e.value) and "VLLM_BI_GDN_STATE" in str(e.value)
