"""The hybrid GDN mode (``VLLM_BI_GDN_MODE=hybrid``) end to end on CPU, one real server: a prompt's whole
64-token blocks in the chunk-aligned arithmetic, its tail and every generated token in the recurrence from
the exact state at the prompt's last block boundary. Prompts of 17-260 tokens are prefilled in 48-token steps,
so steps start off the block grid (resumed from the last boundary) and some cross the switch point inside a
step; decodes run the recurrent path from each slot's full state.

* P1: a request alone == the same request inside a busy batch (tokens and logprobs, exact);
* P4: the trainer model in hybrid mode, given each sequence's prompt length, recomputes every sampled token's
  logprob bit for bit, packed 1 or 8 sequences per forward;
* negative control: the chunk-mode trainer does not reproduce it (the switch matters);
* P3 where it holds in this mode: prompt + completion sent back as a prompt gives the decode's logprobs when it
  reaches no new block boundary (past one, the completion's tokens are prompt tokens in the chunk arithmetic,
  which may give other bits: this mode does not promise P3);
* the server reports the mode, has prefix caching off, and refuses ``--enable-prefix-caching``.
"""

import random

import pytest

from vllm_bi.launcher import VllmServer, cpu_env
from vllm_bi.tiny_models import corpus

pytestmark = pytest.mark.server

MODE = {"VLLM_BI_GDN_MODE": "hybrid"}


@pytest.fixture(scope="module")
def served(tiny_model_path):
    model = tiny_model_path("qwen3.5")
    args = ["--max-num-batched-tokens", "48", "--max-num-seqs", "16"]
    with VllmServer(model, env=cpu_env(True, dict(MODE, VLLM_SERVER_DEV_MODE="1")), args=args) as srv:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        rng = random.Random(0)
        lines = corpus(400, seed=3)
        prompts = []
        for n_lines in (1, 6, 9, 14, 22):
            ids = tok(" ".join(rng.choice(lines) for _ in range(n_lines)))["input_ids"]
            prompts.append(ids[:260])
        reqs = [dict(prompt_ids=p, max_tokens=20, temperature=1.0, seed=100 + i) for i, p in enumerate(prompts)]
        busy = srv.complete_many(reqs * 3)  # 15 in flight: each prompt 3 times, mixed prefills and decodes
        alone = [srv.complete(**r) for r in reqs]
        yield model, srv, prompts, busy, alone


def test_prompts_cover_the_switch_cases(served):
    """A prompt shorter than a block (all recurrent), and prompts whose last boundary is 64, 128 or 192 with a
    tail after it; in 48-token steps, some step crosses the switch point."""
    _, _, prompts, _, _ = served
    lens = sorted(len(p) for p in prompts)
    assert lens[0] < 64 and lens[-1] > 192 and any(len(p) % 64 for p in prompts if len(p) > 64)
    assert any((p // 64 * 64) % 48 for p in lens if p >= 64), "no prompt's switch point falls inside a step"


def test_p1_alone_equals_busy(served):
    _, _, _, busy, alone = served
    for i, a in enumerate(alone):
        for b in busy[i::5]:
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_p4_trainer_in_hybrid_mode_is_bit_exact(served, monkeypatch):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, _, _, busy, _ = served
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "hybrid")
    tm = QwenGDNForCausalLM.from_pretrained(model)
    for pack in (1, 8):
        got = trainer_logprobs(tm, busy, pack=pack)
        for c, lp in zip(busy, got):
            assert lp == c.logprobs, f"pack {pack}: trainer != server"


def test_negative_control_chunk_trainer_and_p3_within_a_block(served, monkeypatch):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.parity import trainer_logprobs

    model, srv, _, _, alone = served
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    got = trainer_logprobs(QwenGDNForCausalLM.from_pretrained(model), alone, pack=5)
    same = sum(a == b for c, lp in zip(alone, got) for a, b in zip(c.logprobs, lp))
    total = sum(len(c.logprobs) for c in alone)
    assert same < total, "the chunk-mode trainer reproduced the hybrid server: the switch made no difference"
    # P3 holds where the resent prompt adds no block boundary: its completion tokens then stay in the
    # recurrence from the same boundary state. (Past a new boundary they run in the chunk arithmetic; whether
    # that shows in the logprobs depends on bf16 rounding, so nothing is asserted there.)
    checked = 0
    for c in alone:
        full, n = c.prompt_ids + c.token_ids, len(c.prompt_ids)
        if len(full) // 64 == n // 64:
            r = srv.complete(prompt_ids=full, max_tokens=1, prompt_logprobs=True)
            assert r.prompt_logprobs[n:] == c.logprobs, f"prompt {n}: no new boundary, yet P3 broke"
            checked += 1
    assert checked >= 2


def test_mode_report_and_prefix_caching_off(served):
    _, srv, _, _, _ = served
    info = srv.server_info()
    assert info["gdn_mode"] == "hybrid" and info["cuda_graphs"] == "NONE"
    hits0 = srv.metric_sum("vllm:prefix_cache_hits_total")
    p = list(range(300, 500))
    srv.complete(prompt_ids=p + [11], max_tokens=2)
    srv.complete(prompt_ids=p + [12], max_tokens=2)
    assert srv.metric_sum("vllm:prefix_cache_hits_total") == hits0


def test_prefix_caching_is_refused_by_name(monkeypatch):
    from vllm_bi.patch.engine_config import BatchInvarianceConfigError, _hybrid_prefix_caching

    class Args:
        enable_prefix_caching = True

    monkeypatch.setenv("VLLM_BI_GDN_MODE", "hybrid")
    with pytest.raises(BatchInvarianceConfigError, match="drop --enable-prefix-caching"):
        _hybrid_prefix_caching(Args())
    Args.enable_prefix_caching = None
    _hybrid_prefix_caching(Args)
    assert Args.enable_prefix_caching is False
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    Args.enable_prefix_caching = True
    _hybrid_prefix_caching(Args)
    assert Args.enable_prefix_caching is True  # other modes keep it


def test_rl_trainer_on_policy_exact_and_backward_through_the_switch(served, tmp_path, monkeypatch):
    """Last in the module (it pushes new weights to the server): the RL trainer in hybrid mode, 3 on-policy
    steps on prompts of 100-200 tokens, so its loss backward crosses the switch (chunk rows, then recurrent
    rows from the boundary state). After each push the server's logprobs still equal the trainer's, every
    token."""
    import json

    from transformers import AutoTokenizer

    from vllm_bi.trainer.config import TrainerConfig
    from vllm_bi.trainer.loop import train

    model, srv, _, _, _ = served
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(11)
    lines = corpus(400, seed=7)
    task = tmp_path / "long.jsonl"
    with open(task, "w") as f:
        for _ in range(8):
            text = " ".join(rng.choice(lines) for _ in range(8))
            while len(tok(text)["input_ids"]) < 100:
                text += " " + rng.choice(lines)
            f.write(json.dumps({"prompt": " ".join(tok.decode(tok(text)["input_ids"][:200]).split()), "answer": "e"}) + "\n")
    lens = [len(tok(json.loads(ln)["prompt"])["input_ids"]) for ln in open(task)]
    assert min(lens) >= 64, lens
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "hybrid")
    rows = train(TrainerConfig(model=model, server_url=srv.url, run_dir=str(tmp_path / "run"), task=str(task),
                               reward="contains", steps=3, max_staleness=0, prompts_per_step=2, group_size=4,
                               max_tokens=8, lr=5e-3, progress=False, tensorboard=False))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["bit_wise/logprob_diff/max"] == 0.0 and r["bit_wise/frac_tokens_different"] == 0.0, r
        assert r["tokens/completion"] > 0
    assert any(r["grad_norm"] > 0 for r in rows), "no gradient: the backward was not exercised"
    assert srv.weight_version() == "3"


def test_hybrid_mode_is_refused_on_cuda(monkeypatch):
    """The GPU gate measured the hybrid mode inexact on CUDA: a CUDA engine refuses it by name; CPU and the other
    modes go on."""
    import types

    from vllm_bi.patch.engine_config import BatchInvarianceConfigError, _refuse_hybrid_on_cuda

    cuda, cpu = types.SimpleNamespace(is_cuda=lambda: True), types.SimpleNamespace(is_cuda=lambda: False)
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "hybrid")
    with pytest.raises(BatchInvarianceConfigError, match="hybrid is not exact on CUDA.*use VLLM_BI_GDN_MODE=chunk"):
        _refuse_hybrid_on_cuda(cuda)
    _refuse_hybrid_on_cuda(cpu)
    for mode in ("chunk", "recurrent"):
        monkeypatch.setenv("VLLM_BI_GDN_MODE", mode)
        _refuse_hybrid_on_cuda(cuda)
