"""Sampling that does not depend on how a prompt was chunked or batched, and exact-match verification of drafts.

CPU generators have no offset, so vLLM cannot rewind one when a step's sample is discarded (a chunked prompt), and
a seeded request whose prompt is chunked killed the engine. Each seeded request gets a :class:`BIGenerator` whose
draw ``i`` is keyed by ``(seed, i)``.

Speculative decoding keeps a draft exactly when it equals the token decoding without drafts would sample at its
position: :func:`verify_drafts` in vLLM's V1 model runner (CPU), :func:`verify_drafts_v2` in Model Runner V2
(CUDA), whose sampler already keys its noise by (seed, position).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["BIGenerator", "random_sample", "sampler_forward_cpu", "wrap_update_states", "verify_drafts",
           "keep_matching_drafts", "verify_drafts_v2", "wrap_validate_params"]


class BIGenerator(torch.Generator):
    """A per-request CPU generator whose draws are keyed by (seed, draw index).

    vLLM rewinds a request's generator with ``set_offset(get_offset() - 4)``
    when a step's sample is discarded (partial prefill). CPU generators have no
    offset; this one counts draws instead (4 offset units per draw, as on
    CUDA), and :func:`random_sample` seeds a fresh generator from
    ``(seed, index)`` for each draw, so the noise for output token i is the
    same however the prompt was chunked or batched.
    """

    def __new__(cls, seed: int):
        return super().__new__(cls, "cpu")

    def __init__(self, seed: int):
        self.manual_seed(seed)
        self.bi_seed = int(seed)
        self.bi_draws = 0

    def get_offset(self) -> int:
        return 4 * self.bi_draws

    def set_offset(self, offset: int) -> None:
        self.bi_draws = int(offset) // 4

    def next_draw_generator(self) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed((self.bi_seed * 1_000_003 + self.bi_draws) % (2**63))
        self.bi_draws += 1
        return g


def random_sample(probs, generators, use_fp64_gumbel: bool = False):
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    q = tts.empty_exponential_noise_like(probs, use_fp64_gumbel)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, gen in generators.items():
        if isinstance(gen, BIGenerator):
            q[i].exponential_(generator=gen.next_draw_generator())
        else:
            q[i].exponential_(generator=gen)
    return tts.sample_with_exponential_noise(probs, q)


def _draw_seed(gen: torch.Generator) -> int:
    g = gen.next_draw_generator() if isinstance(gen, BIGenerator) else gen
    return int(torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long).item())


def sampler_forward_cpu(self, logits, generators, k, p):
    """vLLM's CPU Gumbel-max sampler, with each seeded request's noise seed drawn by (seed, draw index)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if self.use_fp64_gumbel:
        raise NotImplementedError("vllm_bi: --use-fp64-gumbel is not supported under batch invariance on CPU")
    logits = apply_top_k_top_p(logits, k, p)
    to_return = None
    if self.logprobs_mode == "processed_logits":
        to_return = logits
    elif self.logprobs_mode == "processed_logprobs":
        from vllm_bi.ops.softmax import log_softmax

        to_return = log_softmax(logits, dim=-1, dtype=torch.float32)
    seeds = torch.randint(0, 2**31, (logits.shape[0],), dtype=torch.long)
    for i, gen in generators.items():
        seeds[i] = _draw_seed(gen)
    return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32), seeds), to_return


def wrap_update_states(orig):
    @functools.wraps(orig)
    def _update_states(self, scheduler_output):
        result = orig(self, scheduler_output)
        for idx, gen in list(self.input_batch.generators.items()):
            if isinstance(gen, BIGenerator):
                continue
            req_id = self.input_batch.req_ids[idx]
            state = self.requests.get(req_id)
            seed = getattr(getattr(state, "sampling_params", None), "seed", None)
            if seed is None:
                continue
            bi = BIGenerator(seed)
            self.input_batch.generators[idx] = bi
            state.generator = bi
        return result

    _update_states._vllm_bi = True
    return _update_states


def verify_drafts(self, metadata, draft_probs, logits, sampling_metadata):
    """``RejectionSampler.forward`` under batch invariance: exact-match verification.

    Position ``j`` of every request (its ``j``-th draft's row, or its bonus row past its drafts) is sampled by the
    sampler itself, the call a step without drafts makes, with a seeded request's draw keyed to its output token
    index (:class:`BIGenerator`); a draft is kept while it equals that sample, the first sample that differs (or the
    bonus row's, when every draft is kept) ends the step. So a request's tokens are those decoding without drafts
    gives, at any temperature, and its logprobs come from the same raw logits rows. ``draft_probs`` is not used:
    the drafter decides how many tokens a step keeps, never which."""
    from dataclasses import replace

    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    n = [int(x) for x in metadata.num_draft_tokens]
    starts = [0]
    for x in n:
        starts.append(starts[-1] + x)
    target, bonus = metadata.target_logits_indices.tolist(), metadata.bonus_logits_indices.tolist()
    drafts = metadata.draft_token_ids.tolist()
    gens = {i: g for i, g in sampling_metadata.generators.items() if isinstance(g, BIGenerator)}
    first = {i: g.bi_draws for i, g in gens.items()}
    plain = replace(sampling_metadata, max_num_logprobs=None, logprob_token_ids=None)
    picks = []
    for j in range(max(n, default=0) + 1):
        rows = [target[starts[i] + j] if j < n[i] else bonus[i] for i in range(len(n))]
        for i, g in gens.items():
            g.bi_draws = first[i] + j
        picks.append(self.sampler(logits[rows], plain).sampled_token_ids[:, 0].tolist())
    out = torch.full((len(n), metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=logits.device)
    for i in range(len(n)):
        kept = 0
        while kept < n[i] and picks[kept][i] == drafts[starts[i] + kept]:
            kept += 1
        tokens = drafts[starts[i] : starts[i] + kept] + [picks[kept][i]]
        out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        if i in gens:
            gens[i].bi_draws = first[i] + len(tokens)
    logprobs = None
    if sampling_metadata.max_num_logprobs is not None:
        raw = logits[metadata.target_logits_indices].to(torch.float32)
        logprobs = self._get_logprobs_tensors(sampling_metadata.max_num_logprobs, metadata, logits, raw,
                                              logits[metadata.bonus_logits_indices].to(torch.float32), out)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


def keep_matching_drafts(sampled: torch.Tensor, drafts: torch.Tensor, cu_num_logits: torch.Tensor,
                         local_pos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact-match rule on the device, with no host read. A verify step's logits rows are packed by request
    (request ``i``: rows ``cu_num_logits[i] .. cu_num_logits[i + 1] - 1``, ``local_pos`` each row's index in its
    request); row ``j`` of a request was fed its ``j``-th draft (row 0 the last sampled token) in ``drafts`` and
    sampled ``sampled``. Draft ``j + 1`` is kept while it equals row ``j``'s sample, so a request keeps the samples
    of rows ``0 .. a`` where ``a`` is the number of leading rows whose sample equals the next row's draft (a draft
    of ``-1`` never does). Returns ``(tokens [R, width], num_sampled [R] int32)``: row ``i`` of ``tokens`` holds the
    request's samples from its first row on (entries past ``num_sampled[i]`` are unused)."""
    n_rows = sampled.shape[0]
    n_reqs = cu_num_logits.shape[0] - 1
    dev = sampled.device
    rows = torch.arange(n_rows, device=dev, dtype=cu_num_logits.dtype)
    req = torch.searchsorted(cu_num_logits[1:].contiguous(), rows, right=True)
    pos = local_pos.long()
    n_drafts = (cu_num_logits[1:] - cu_num_logits[:-1] - 1).long()
    following = torch.cat([drafts[1:], drafts.new_full((1,), -1)]).long()
    match = (pos < n_drafts[req]) & (sampled.long() == following)
    tokens = torch.zeros((n_reqs, width), dtype=sampled.dtype, device=dev)
    tokens[req, pos] = sampled
    kept = torch.zeros((n_reqs, width), dtype=torch.int32, device=dev)
    kept[req, pos] = match.to(torch.int32)
    num_sampled = torch.cumprod(kept, dim=1).sum(dim=1).to(torch.int32) + 1
    return tokens, num_sampled


def verify_drafts_v2(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
    """Model Runner V2's ``RejectionSampler.__call__`` under batch invariance: exact-match verification.

    Every logits row of the step is sampled by V2's own sampler, the call a step without drafts makes; its noise is
    keyed by the request's seed and the row's position, so row ``j`` draws what decoding without drafts draws for
    that position. :func:`keep_matching_drafts` keeps a draft while it equals the sample of the row before it; the
    logprobs are the raw logits rows' (the rows one-token decodes give). ``draft_logits`` is not used: the drafter
    decides how many tokens a step keeps, never which. A draft grammar-invalid for the request (``invalid_drafts``)
    is never kept."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler
    from vllm.v1.worker.gpu.sample.output import SamplerOutput, SamplingMaskTensors
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs

    sampler = self.sampler
    if self.watermark_key is not None or getattr(sampler, "trace_replay_state", None) is not None:
        raise NotImplementedError("vllm_bi: exact-match verification does not replay watermarks or traces; serve "
                                  "without them or without --speculative-config")
    num_nans = v2_sampler.get_num_nans(logits) if sampler.compute_nans else None  # the non-finite guard's count
    drafts, pos = rs.gather_draft_sampled(input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
                                          input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
                                          sampler.req_states.prefill_len.gpu)
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
    sampled, processed = sampler.sample(logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
                                        input_batch.idx_mapping_np, pos, drafts, input_batch.expanded_local_pos,
                                        input_batch.seq_lens_cpu_upper_bound.numpy(),
                                        return_logprobs=max_num_logprobs != NO_LOGPROBS)
    verify = drafts if invalid_drafts is None else drafts.masked_fill(invalid_drafts, -1)
    width = self.num_speculative_steps + 1
    tokens, num_sampled = keep_matching_drafts(sampled, verify, input_batch.cu_num_logits,
                                               input_batch.expanded_local_pos, width)
    tokens = tokens.to(drafts.dtype)
    logprobs = self._get_logprobs_tensors(tokens, num_sampled, logits, input_batch.cu_num_logits,
                                          input_batch.cu_num_logits_np, max_num_logprobs)
    mask = None
    if sampler.return_sampling_mask:
        import numpy as np

        max_kept = int(np.max(sampler.sampling_states.top_k.np[input_batch.idx_mapping_np]))
        mask = SamplingMaskTensors.from_logits(processed, input_batch.cu_num_logits, num_sampled, max_kept, width)
    num_sampled, num_rejected = get_num_sampled_and_rejected(num_sampled, input_batch.seq_lens,
                                                             input_batch.cu_num_logits, input_batch.idx_mapping,
                                                             sampler.req_states.prefill_len.gpu)
    return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=logprobs, num_nans=num_nans,
                         num_sampled=num_sampled, num_rejected=num_rejected, sampling_mask_tensors=mask)


def wrap_validate_params(orig):
    """A server with speculative decoding refuses (400, naming the fix) what makes a position's sample depend on the
    tokens before it in a way the verification cannot replay: penalties, ``min_tokens`` and bad words. Temperature,
    top-k, top-p, min-p, logit bias, allowed tokens and seeds are per-row and taken as they are."""

    @functools.wraps(orig)
    def _validate_params(self, params, supported_tasks):
        out = orig(self, params, supported_tasks)
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        if getattr(self, "speculative_config", None) is None or not isinstance(params, SamplingParams):
            return out
        bad = [name for name, on in (("presence_penalty", params.presence_penalty != 0),
                                     ("frequency_penalty", params.frequency_penalty != 0),
                                     ("repetition_penalty", params.repetition_penalty != 1),
                                     ("min_tokens", params.min_tokens > 0), ("bad_words", bool(params.bad_words)))
               if on]
        if bad:
            raise VLLMValidationError(
                f"vllm_bi: this batch-invariant server decodes speculatively, and {bad[0]} makes a token's sample "
                "depend on the draft tokens before it; drop it, or serve without --speculative-config",
                parameter=bad[0], value=getattr(params, bad[0]))
        return out

    return _validate_params
