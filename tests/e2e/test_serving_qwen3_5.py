"""P1-P3 over HTTP with `vllm serve` on small random Qwen3.5 (dense) and Qwen3.5-MoE text models, CPU.

Per family, two BI servers run once each: max_num_batched_tokens 32 with prefix caching, and 2048 without. The
Qwen3.5-MoE runs are in the extended tier (`-m extended`, outside CI's time budget): CI serves that model in
test_tensor_parallel.py (P1, P4 and the RL trainer at TP=2), test_moe_triton_served.py and the RL loop's weight-sync
test; its GDN and attention layers are the dense model's, and its experts act on each token alone. The
negative controls for the stock path are in test_serving_qwen3_next.py: vLLM 0.32's own Qwen3.5 model cannot be
imported on the CPU build (see vllm_bi/model_executor/models/qwen3_5_text.py)."""

import pytest
from parity_suite import check_multiturn, check_p1, check_p2, check_p3, hf_reference_check
from scenarios import GREEDY, SEEDED, make_prompts, run_multiturn, run_scenarios

from vllm_bi.launcher import VllmServer

pytestmark = pytest.mark.server

SMALL = ["--max-num-batched-tokens", "32", "--max-num-seqs", "16", "--enable-prefix-caching"]
LARGE = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "16", "--no-enable-prefix-caching"]
MODES = {"greedy": GREEDY, "seeded": SEEDED}


@pytest.fixture(scope="module", params=["qwen3.5", pytest.param("qwen3.5-moe", marks=pytest.mark.extended)])
def runs(request, tiny_model_path):
    model = tiny_model_path(request.param)
    prompts = make_prompts(seed=1, batches=4)
    out = {"family": request.param, "model": model}
    with VllmServer(model, args=SMALL) as srv:
        out["bi_small"] = run_scenarios(srv, prompts, MODES)
        out["multiturn"] = run_multiturn(srv, model)
    with VllmServer(model, args=LARGE) as srv:
        out["bi_large"] = run_scenarios(srv, prompts, MODES, busy=False)
    return out


def test_p1_batch_invariance(runs):
    assert check_p1(runs["bi_small"], f"{runs['family']} BI mnbt=32") == 8


def test_p2_split_and_prefix_cache_invariance(runs):
    assert runs["bi_small"].prefix_hits > 0, "the shared-prefix request did not hit the prefix cache"
    assert check_p2(runs["bi_small"], runs["bi_large"], f"{runs['family']} mnbt=32+prefix vs 2048") == 8


def test_p3_decode_equals_prefill(runs):
    assert check_p3(runs["bi_small"], runs["family"]) > 0
    assert check_p3(runs["bi_large"], runs["family"]) > 0


def test_served_model_matches_transformers(runs):
    hf_reference_check(runs["model"], runs["bi_large"], runs["family"])


def test_p4_trainer_equals_server(runs):
    from parity_suite import check_p4

    assert check_p4(runs["model"], runs["family"], runs["bi_small"], runs["bi_large"]) >= 100


def test_p4_transformers_adapter_equals_server(runs):
    from parity_suite import check_p4_hf

    assert check_p4_hf(runs["model"], runs["family"], runs["bi_small"]) >= 100


def test_multiturn_trajectory_parity_with_prefix_hits(runs):
    """Three model turns with tool outputs between them, each turn a new request on the conversation's token ids
    (prefix-cache hits): the trainer's one forward over the trajectory equals every model token's served logprob."""
    assert check_multiturn(runs["model"], f"{runs['family']} recurrent", runs["multiturn"]) == 48
