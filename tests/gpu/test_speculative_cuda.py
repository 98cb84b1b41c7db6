"""Speculative decoding on CUDA under batch invariance (a CUDA feature, ``settings.CUDA_FEATURES``): Qwen3.5's MTP
drafter, drafts verified by exact match in vLLM's Model Runner V2 (``patch.sampling.verify_drafts_v2``), eager steps.

The criterion: a request's tokens and logprobs with speculation on equal those with speculation off, bit for bit,
greedy or seeded at temperature 1, alone or in a busy batch, and equal the trainer's recompute on the GPU. Both BI
servers run Model Runner V2, whose sampler keys its noise by (seed, position). The model is the tiny Qwen3.5 with one
random MTP layer and an LM head narrowed to two tokens (``tiny_models.add_mtp_layer``), so drafts are kept in runs of
different lengths. One-token prompts beside running decodes are checked too (the ``speculative-one-token`` CUDA
feature; one more server). Negative control (last, and the slowest: two stock starts): stock vLLM with and without
the same drafter serves other logprob bits.

On the device, in two calls (the BI tests took 120 s on an H100, the stock control needs about 450 s):
`VLLM_BI_PYTEST_TIMEOUT=400 bash scripts/gpu_run.sh pytest tests/gpu/test_speculative_cuda.py -k "not stock" ;`, then
`VLLM_BI_PYTEST_TIMEOUT=540 ... -k stock ;`.
"""

import pytest
from gpu_env import require_cuda_vllm_fla

pytestmark = [pytest.mark.gpu, pytest.mark.server]

require_cuda_vllm_fla()

from speculation import PROMPTS, SPEC, greedy, one_token_prompts, plain_run, speculative_run  # noqa: E402

from vllm_bi.launcher import VllmServer, cpu_env  # noqa: E402

ARGS = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "16", "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.25"]
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from vllm_bi.tiny_models import add_mtp_layer, build_tiny_model

    root = tmp_path_factory.mktemp("spec")
    return add_mtp_layer(build_tiny_model("qwen3.5", str(root / "qwen3.5")), str(root / "qwen3.5-mtp"))


def _differences(a, b) -> list[str]:
    """Which requests of two runs differ, and where first (empty: bit for bit the same)."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token_ids != y.token_ids or x.logprobs != y.logprobs:
            at = next((j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), None)
            lp = next((j for j, (p, q) in enumerate(zip(x.logprobs, y.logprobs)) if p != q), None)
            out.append(f"request {i}: first token difference at {at}, first logprob difference at {lp}")
    return out


@pytest.fixture(scope="module")
def served(mtp_model):
    env = cpu_env(True, DEV_MODE)
    with VllmServer(mtp_model, env=env, args=ARGS) as srv:
        out = plain_run(srv)
    with VllmServer(mtp_model, env=env, args=ARGS + SPEC) as srv:
        out.update(speculative_run(srv))
    print(f"drafted {out['drafted']}, accepted {out['accepted']}")
    return out


def test_greedy_speculation_changes_no_bit_and_drafts_are_kept(served):
    assert served["drafted"] > 0 and 0 < served["accepted"] < served["drafted"], served
    assert _differences(served["plain"], served["spec"]) == []


def test_seeded_speculation_at_temperature_one_changes_no_bit(served):
    assert _differences(served["plain_sampled"], served["spec_sampled"]) == []
    assert [c.token_ids for c in served["spec_sampled"]] != [c.token_ids for c in served["spec"]]  # sampling


def test_speculation_batch_invariant(served):
    assert _differences(served["alone"], served["spec"]) == []
    assert _differences(served["alone_sampled"], served["spec_sampled"][:1]) == []


def test_trainer_on_the_gpu_equals_the_speculative_server(served, mtp_model):
    from vllm_bi.models import from_pretrained
    from vllm_bi.parity import trainer_logprobs

    model = from_pretrained(mtp_model).to("cuda")
    done = served["spec"] + served["spec_sampled"]
    got = trainer_logprobs(model, done)
    bad = [i for i, (t, c) in enumerate(zip(got, done)) if t != c.logprobs]
    assert bad == [], f"{len(bad)} of {len(done)} completions differ from the trainer"


def test_one_token_prompts_beside_running_decodes(mtp_model):
    """One-token prompts beside running decodes (padded by vLLM's scheduler into speculative rows whose slots held
    earlier requests' states, zeroed by the glue) equal the same prompts alone and the trainer on the GPU. This is
    the GPU check of the ``speculative-one-token`` CUDA feature (in ``settings.CUDA_FEATURES``): the server serves
    such prompts by default, with no ``VLLM_BI_CUDA_PREVIEW`` set."""
    from vllm_bi import settings
    from vllm_bi.models import from_pretrained
    from vllm_bi.parity import trainer_logprobs

    assert "speculative-one-token" in settings.CUDA_FEATURES
    env = {k: v for k, v in cpu_env(True, DEV_MODE).items() if k != "VLLM_BI_CUDA_PREVIEW"}
    with VllmServer(mtp_model, env=env, args=ARGS + SPEC) as srv:
        greedy(srv, PROMPTS)  # earlier requests leave their states in the slots
        among, alone = one_token_prompts(srv)
    assert _differences(among, alone) == []
    model = from_pretrained(mtp_model).to("cuda")
    assert trainer_logprobs(model, among) == [c.logprobs for c in among]


def test_stock_speculation_changes_logprob_bits(mtp_model):
    """Negative control: without batch invariance the same drafter changes the served logprobs' bits."""
    env = cpu_env(False)
    stock = ARGS + ["--enforce-eager", "--gdn-prefill-backend", "triton"]
    with VllmServer(mtp_model, batch_invariant=False, env=env, args=stock) as srv:
        plain = greedy(srv, PROMPTS)
    with VllmServer(mtp_model, batch_invariant=False, env=env, args=stock + SPEC) as srv:
        spec = greedy(srv, PROMPTS)
    assert _differences(plain, spec) != []
