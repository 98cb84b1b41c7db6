"""Multi-turn rollouts without a server (``vllm_bi.trajectories``, ``vllm_bi.trainer.multiturn``): a fake client
records every request, so the tests see what each turn sends (token in: the trajectory's ids so far, the tool's output
tokenised alone), how the trajectory is stored (ids, the model-token mask, one server logprob per model token), where
it ends, and the one-line errors for a bad environment; and the trainer's side: one forward over the whole trajectory,
the loss and the logprob check on the model's tokens only (compared with ``torch.equal`` to the unmasked forward's
positions)."""

import pytest
import torch
from transformers import AutoTokenizer

from vllm_bi.errors import UsageError
from vllm_bi.trainer.multiturn import get_env, tool_digits_env
from vllm_bi.trajectories import rollout_trajectories, turn_seed
from vllm_bi.trainer.rewards import get_reward
from vllm_bi.trainer.rollout import Sample


class Out:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class FakeClient:
    """Answers each request with three tokens derived from its seed and prompt length; records the requests."""

    def __init__(self):
        self.sent: list[list[dict]] = []

    def complete_many(self, reqs):
        self.sent.append([dict(r) for r in reqs])
        return [Out([5 + r["seed"] % 7, 9, 5 + len(r["prompt_ids"]) % 11], [-0.5, -0.25, -0.125]) for r in reqs]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path("qwen3.5"))


def _req(seed, prompt=(3, 4, 5)):
    return dict(prompt_ids=list(prompt), max_tokens=3, temperature=1.0, seed=seed)


def test_each_turn_sends_the_trajectory_so_far_as_token_ids(tok):
    replies = iter([" tool one", [40, 41]])
    client = FakeClient()
    (t,) = rollout_trajectories(client, tok, [_req(1)], [{}], lambda ex, turns: next(replies), max_turns=3)
    assert len(client.sent) == 3 and [len(s) for s in client.sent] == [1, 1, 1]
    tool1 = tok(" tool one", add_special_tokens=False)["input_ids"]
    m1, m2, m3 = (c["ids"] for c in t.turns if c["role"] == "model")
    assert client.sent[1][0]["prompt_ids"] == [3, 4, 5] + m1 + tool1
    assert client.sent[2][0]["prompt_ids"] == [3, 4, 5] + m1 + tool1 + m2 + [40, 41]
    assert t.token_ids == m1 + tool1 + m2 + [40, 41] + m3
    assert t.mask == [True] * 3 + [False] * len(tool1) + [True] * 3 + [False] * 2 + [True] * 3
    assert len(t.logprobs) == sum(t.mask) == 9 and t.model_turns == 3
    assert [s[0]["seed"] for s in client.sent] == [turn_seed(1, k) for k in range(3)]
    assert len({turn_seed(1, k) for k in range(3)}) == 3  # each turn its own seed, fixed by the sample's
    assert t.turns[1] == {"role": "tool", "text": " tool one", "ids": tool1}


def test_a_trajectory_ends_when_the_environment_says_so_and_the_rest_go_on(tok):
    client = FakeClient()

    def env(ex, turns):
        return None if ex["stop"] else " more"

    a, b = rollout_trajectories(client, tok, [_req(1), _req(2)], [{"stop": True}, {"stop": False}], env, 2)
    assert [len(s) for s in client.sent] == [2, 1]  # the ended one is not sent again
    assert a.model_turns == 1 and b.model_turns == 2 and a.mask == [True] * 3


def test_the_environment_sees_a_copy_of_the_turns(tok):
    def env(ex, turns):
        turns[0]["ids"].append(999)
        turns.clear()
        return " ok"

    (t,) = rollout_trajectories(FakeClient(), tok, [_req(3)], [{}], env, 2)
    assert 999 not in t.token_ids and len(t.turns) == 3


@pytest.mark.parametrize("reply, what", [(3.5, "return the tool's output as a string or a list of token ids"),
                                         ([1, -2], "list"), ("", "empty tool output"), ([], "empty tool output")])
def test_a_bad_tool_output_is_one_line_naming_the_fix(tok, reply, what):
    with pytest.raises(UsageError) as e:
        rollout_trajectories(FakeClient(), tok, [_req(1)], [{}], lambda ex, turns: reply, 2)
    assert what in str(e.value) and "\n" not in str(e.value) and "environment" in str(e.value)


def test_an_environment_that_raises_is_named(tok):
    def broken_env(ex, turns):
        raise KeyError("answer")

    with pytest.raises(UsageError, match=r"environment broken_env raised KeyError: 'answer'; fix the --env"):
        rollout_trajectories(FakeClient(), tok, [_req(1)], [{}], broken_env, 2)


def test_env_specs_and_the_builtin_task():
    assert get_env("tool_digits") is tool_digits_env
    with pytest.raises(UsageError, match="--env 'nope': not a built-in"):
        get_env("nope")
    with pytest.raises(UsageError, match="--env 'no_such_mod:f': cannot import"):
        get_env("no_such_mod:f")
    m = lambda text: {"role": "model", "text": text, "ids": [1]}  # noqa: E731
    tool = {"role": "tool", "text": " x", "ids": [2]}
    assert tool_digits_env({}, [m("ab 12")]) == " result: ok. next:"
    assert tool_digits_env({}, [m("ab")]) == " error: call with digits:"
    assert tool_digits_env({}, [m("1"), tool, m("2"), tool, m("3")]) is None  # three model turns: the end
    reward = get_reward("tool_digits")
    assert reward("p", "", {"turns": [m("12"), tool, m("ab"), tool, m("1a")]}) == pytest.approx((1 + 0 + 0.5) / 3)
    with pytest.raises(KeyError):
        reward("p", "12", {})


def test_the_trainer_scores_the_model_tokens_of_one_forward(tiny_model_path):
    """``policy.completion_logprobs`` on a masked trajectory: the unmasked forward's logprobs at the model's
    positions (torch.equal), the entropy over those positions only; and packing it with a single-turn sample
    changes no bit of either."""
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.trainer.policy import completion_logprobs

    model = QwenGDNForCausalLM.from_pretrained(tiny_model_path("qwen3.5"))
    prompt, rest = [11, 12, 13, 14], [21, 22, 23, 31, 32, 24, 25]
    mask = [True, True, True, False, False, True, True]
    multi = Sample(0, "p", prompt, rest, [0.0] * 5, "", mask=mask, turns=2)
    single = Sample(0, "p", [7, 8], [9, 10, 11], [0.0] * 3, "")
    assert multi.model_tokens == 5 and single.model_tokens == 3
    with torch.no_grad():
        full, _ = model.completion_logprobs([(prompt, rest)], entropy=False)
        (got,), ent = completion_logprobs(model, [multi], entropy=True)
        both, ent2 = completion_logprobs(model, [multi, single], entropy=True)
        (one,), ent1 = completion_logprobs(model, [single], entropy=True)
        _, ent_all = model.completion_logprobs([(prompt, rest)], entropy=True)
    assert torch.equal(got, full[0][torch.tensor(mask)])
    assert torch.equal(both[0], got) and torch.equal(both[1], one)
    assert ent2 == pytest.approx(ent + ent1, rel=1e-6)
    assert ent < ent_all  # the two tool positions' entropy is left out


def test_one_rl_step_on_multiturn_rollouts(tiny_model_path, tok):
    """The loop's pieces on the ``tool_digits`` task without a server: ``generate_batch`` with the task's environment
    (three model turns per sample, the reward over the turns), then ``train_on_batch``: it counts and checks the
    model's tokens only. The fake server's logprobs are not the model's, so the step's logprob gap is nonzero: what
    it measures is the number of tokens compared."""
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.trainer.config import TrainerConfig
    from vllm_bi.trainer.data import make_source
    from vllm_bi.trainer.distributed import Dist
    from vllm_bi.trainer.policy import Policy, train_on_batch
    from vllm_bi.trainer.rollout import generate_batch

    class Versioned(FakeClient):
        def weight_version(self):
            return "0"

    cfg = TrainerConfig(task="tool_digits", prompts_per_step=2, group_size=2, max_tokens=3, max_turns=3)
    source = make_source(cfg.task, cfg.seed)
    client = Versioned()
    batch = generate_batch(client, tok, source, get_reward(source.default_reward), cfg, 0, 0,
                           get_env(source.env))
    assert len(client.sent) == 3 and all(len(s) == 4 for s in client.sent)
    assert all(s.turns == 3 and s.model_tokens == 9 and len(s.logprobs) == 9 for s in batch.samples)
    assert all(len(s.completion_ids) > 9 for s in batch.samples)  # the tool's tokens are in the trajectory
    assert batch.completion_tokens == 36
    model = QwenGDNForCausalLM.from_pretrained(tiny_model_path("qwen3.5"))
    row = train_on_batch(Policy(model, cfg, Dist()), batch, cfg)
    assert row["tokens/completion"] == 36 and row["turns/mean"] == 3
    assert row["bit_wise/logprob_diff/max"] > 0 and 0 < row["bit_wise/frac_tokens_different"] <= 1
