"""Seeded sampling on CPU that does not depend on how a prompt was chunked or batched.

CPU generators have no offset, so vLLM cannot rewind one when a step's sample is discarded (a chunked prompt), and
a seeded request whose prompt is chunked killed the engine. Each seeded request gets a :class:`BIGenerator` whose
draw ``i`` is keyed by ``(seed, i)``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["BIGenerator", "random_sample", "sampler_forward_cpu", "wrap_update_states"]


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


def wrap_validate_params(orig):
    """A server with speculative decoding takes greedy requests only: vLLM's rejection sampler accepts a draft at a
    temperature by a probability test, so a request's tokens would depend on the drafts (the greedy test accepts a
    draft exactly when it is the token decoding without drafts picks). Refused with a 400 naming the fix."""

    @functools.wraps(orig)
    def _validate_params(self, params, supported_tasks):
        out = orig(self, params, supported_tasks)
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams, SamplingType

        if (getattr(self, "speculative_config", None) is not None and isinstance(params, SamplingParams)
                and params.sampling_type != SamplingType.GREEDY):
            raise VLLMValidationError(
                "vllm_bi: this batch-invariant server decodes speculatively and takes greedy requests only "
                "(temperature 0): a draft accepted by vLLM's probability test would change the tokens; send "
                "temperature 0, or serve without --speculative-config", parameter="temperature",
                value=params.temperature)
        return out

    return _validate_params
