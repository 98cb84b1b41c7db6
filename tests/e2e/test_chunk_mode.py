"""The chunk-aligned GDN mode (``VLLM_BI_GDN_MODE=chunk``) end to end on CPU, one real server:
prompts of 70-260 tokens prefilled in 32-token steps (splits at positions that are not multiples of the
64-token block, so every split resumes from its last block boundary), decodes that recompute their partial
block, all in one busy batch.

* P1: a request alone == the same request inside the busy batch (tokens and logprobs, exact);
* P3: each decode logprob == its ``prompt_logprobs`` entry when prompt + completion is sent back;
* P4: the trainer model in chunk mode recomputes every sampled token's logprob bit for bit, packed 1 or 8
  sequences per forward;
* negative control: the trainer in the recurrent mode does not (same math, other bits), and the server
  reports its mode, so the RL trainer refuses a mismatch.
"""

import random

import pytest
from parity_suite import check_multiturn
from scenarios import (CORPUS_SERVER_ARGS, check_alone_equals_busy, check_decode_equals_prompt_logprobs,
                       corpus_busy_and_alone, run_multiturn)

from vllm_bi.tiny_models import corpus

pytestmark = pytest.mark.server

MODE = {"VLLM_BI_GDN_MODE": "chunk"}


@pytest.fixture(scope="module")
def served(tiny_model_path, bi_server):
    model = tiny_model_path("qwen3.5")
    with bi_server("qwen3.5", MODE, CORPUS_SERVER_ARGS) as srv:
        prompts, busy, alone = corpus_busy_and_alone(srv, model, seed=0, corpus_seed=3, max_tokens=20, sample_seed=100)
        yield model, srv, prompts, busy, alone


def test_prompts_cross_block_boundaries(served):
    _, _, prompts, _, _ = served
    assert all(len(p) > 64 for p in prompts) and max(len(p) for p in prompts) > 192


def test_p1_alone_equals_busy(served):
    _, _, _, busy, alone = served
    check_alone_equals_busy(busy, alone)


def test_p3_decode_equals_prompt_logprobs(served):
    _, srv, _, _, alone = served
    check_decode_equals_prompt_logprobs(srv, alone[:2])


def test_p4_trainer_in_chunk_mode_is_bit_exact(served, monkeypatch):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, _, _, busy, _ = served
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    tm = QwenGDNForCausalLM.from_pretrained(model)
    for pack in (1, 8):
        got = trainer_logprobs(tm, busy, pack=pack)
        for c, lp in zip(busy, got):
            assert lp == c.logprobs, f"pack {pack}: trainer != server"


def test_negative_control_recurrent_trainer_and_mode_report(served, monkeypatch):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, srv, _, busy, _ = served
    info = srv.server_info()
    assert info["gdn_mode"] == "chunk" and info["cuda_graphs"] == "NONE"
    monkeypatch.delenv("VLLM_BI_GDN_MODE", raising=False)
    got = trainer_logprobs(QwenGDNForCausalLM.from_pretrained(model), busy[:4], pack=4)
    same = sum(a == b for c, lp in zip(busy[:4], got) for a, b in zip(c.logprobs, lp))
    total = sum(len(c.logprobs) for c in busy[:4])
    assert same < total, "the recurrent trainer reproduced the chunk-mode server: the mode made no difference"


def test_parity_cli_refuses_a_mode_mismatch(served):
    """`vllm-bi parity` reads the server's settings first: a recurrent-mode trainer against this chunk-mode
    server stops with exit status 2 and says which variable to set, instead of a FAIL table."""
    import os
    import subprocess
    import sys

    model, srv, _, _, _ = served
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BI_GDN_MODE"}
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-bi")
    r = subprocess.run([exe, "parity", "--model", model, "--server", srv.url, "--n", "1", "--max-tokens", "4"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 4, r.stdout + r.stderr[-2000:]  # settings differ
    assert "GDN mode is 'chunk', this trainer's 'recurrent'" in r.stderr and "VLLM_BI_GDN_MODE" in r.stderr


def test_the_trainer_refuses_this_server_in_another_mode(served, monkeypatch):
    """The RL trainer's server check (real HTTP to this chunk-mode server) with one setting changed: a one-line
    refusal naming the setting and both values; with the same setting it passes (control)."""
    from vllm_bi.client import VllmClient
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.server import check_server

    model, srv, _, _, _ = served
    client = VllmClient(srv.url, model)
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "recurrent")
    with pytest.raises(TrainerError) as e:
        check_server(client, verify_weights=False)
    msg = str(e.value)
    assert "\n" not in msg and "GDN mode is 'chunk', this trainer's 'recurrent'" in msg and "VLLM_BI_GDN_MODE" in msg
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    check_server(client, verify_weights=False)


def test_prefix_cache_hit_keeps_trainer_parity(served, monkeypatch):
    """A request whose 700-token prefix is served from the prefix cache (a restored chunk-mode state: the
    boundary state and the raw inputs after it) still gives the trainer's bits."""
    from transformers import AutoTokenizer

    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, srv, _, _, _ = served
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(7)
    lines = corpus(400, seed=5)
    prefix = tok(" ".join(rng.choice(lines) for _ in range(80)))["input_ids"][:700]
    assert len(prefix) == 700
    srv.complete(prompt_ids=prefix + [11, 12, 13], max_tokens=4, temperature=1.0, seed=1)
    hits0 = srv.metric_sum("vllm:prefix_cache_hits_total")
    b = srv.complete(prompt_ids=prefix + [21, 22, 23, 24, 25], max_tokens=16, temperature=1.0, seed=2)
    assert srv.metric_sum("vllm:prefix_cache_hits_total") > hits0, "no prefix-cache hit"
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    (got,) = trainer_logprobs(QwenGDNForCausalLM.from_pretrained(model), [b], pack=1)
    assert got == b.logprobs


def test_multiturn_trajectory_parity_with_prefix_hits(served, monkeypatch):
    """Three model turns with tool outputs between them on the chunk-mode server (prefix-cache hits restore a
    boundary state and the raw rows after it): the trainer in the chunk mode equals every model token's logprob."""
    model, srv, _, _, _ = served
    run = run_multiturn(srv, model, seed=5)
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    assert check_multiturn(model, "qwen3.5 chunk", run) == 48
