"""Request scenarios for the serving parity tests: run once per server, compare across servers.

Every prompt is a list of token ids drawn from a fixed seed, so two servers
(or a BI and a stock server) receive exactly the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm_bi.launcher import Completion, VllmServer

MAX_TOKENS = 16
SEEDED = {"temperature": 1.0, "seed": 4242}
GREEDY = {"temperature": 0.0}
SEEDED_T07 = {"temperature": 0.7, "seed": 777}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@dataclass
class Prompts:
    targets: dict[str, list[int]]
    shared_prefix_a: list[int]
    shared_prefix_b: list[int]
    others: list[list[list[int]]]  # per busy batch: the other prompts


def make_prompts(vocab: int = 1024, seed: int = 0, prefix_len: int = 800, batches: int = 6) -> Prompts:
    """Three target prompts (23, 97 and 301 tokens), two prompts sharing an ``prefix_len``-token prefix, and
    ``batches`` busy batches of 1-15 other prompts each (a smaller ``batches`` keeps the first ones)."""
    rng = random.Random(seed)
    targets = {"short": _ids(rng, 23, vocab), "medium": _ids(rng, 97, vocab), "long": _ids(rng, 301, vocab)}
    prefix = _ids(rng, prefix_len, vocab)
    a = prefix + _ids(rng, 17, vocab)
    b = prefix + _ids(rng, 29, vocab)
    others = []
    for _ in range(batches):
        k = rng.randint(1, 15)
        others.append([_ids(rng, rng.randint(5, 260), vocab) for _ in range(k)])
    return Prompts(targets, a, b, others)


@dataclass
class Results:
    alone: dict = field(default_factory=dict)  # (target, mode) -> Completion
    busy: dict = field(default_factory=dict)  # (target, mode, batch index) -> Completion
    prefix_b: dict = field(default_factory=dict)  # mode -> Completion of prompt b after a warmed the cache
    prefix_hits: float = 0.0
    rescored: dict = field(default_factory=dict)  # (target, mode) -> Completion with prompt_logprobs


def run_scenarios(srv: VllmServer, prompts: Prompts, modes: dict[str, dict], busy: bool = True,
                  prefix: bool = True, rescore: bool = True) -> Results:
    res = Results()
    for mode, kw in modes.items():
        for name, ids in prompts.targets.items():
            res.alone[(name, mode)] = srv.complete(ids, max_tokens=MAX_TOKENS, **kw)
    if busy:
        names = list(prompts.targets)
        for bi, others in enumerate(prompts.others):
            name = names[bi % len(names)]
            for mode, kw in modes.items():
                reqs = [dict(prompt_ids=prompts.targets[name], max_tokens=MAX_TOKENS, **kw)]
                reqs += [dict(prompt_ids=o, max_tokens=MAX_TOKENS, **kw) for o in others]
                res.busy[(name, mode, bi)] = srv.complete_many(reqs)[0]
    if prefix:
        hits0 = srv.metric_sum("vllm:prefix_cache_hits_total")
        for mode, kw in modes.items():
            srv.complete(prompts.shared_prefix_a, max_tokens=MAX_TOKENS, **kw)
            res.prefix_b[mode] = srv.complete(prompts.shared_prefix_b, max_tokens=MAX_TOKENS, **kw)
        res.prefix_hits = srv.metric_sum("vllm:prefix_cache_hits_total") - hits0
    if rescore:
        for (name, mode), c in res.alone.items():
            res.rescored[(name, mode)] = srv.complete(c.prompt_ids + c.token_ids, max_tokens=1, prompt_logprobs=True)
    return res


# the server of the corpus scenario: prompts prefilled in 32-token steps, 16 sequences, prefix caching on
CORPUS_SERVER_ARGS = ("--max-num-batched-tokens", "32", "--max-num-seqs", "16", "--enable-prefix-caching")


def corpus_busy_and_alone(srv: VllmServer, model_path: str, seed: int, corpus_seed: int, max_tokens: int,
                          sample_seed: int) -> tuple[list[list[int]], list[Completion], list[Completion]]:
    """Four prompts of 70-260 tokens of the tiny models' corpus (6, 9, 14 and 22 of its lines, cut at 260 tokens), each
    sampled three times in one busy batch of 12 (mixed prefills and decodes), then each alone: ``(prompts, busy,
    alone)``, ``busy[i::4]`` being prompt ``i``'s three."""
    from transformers import AutoTokenizer

    from vllm_bi.tiny_models import corpus

    tok = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(seed)
    lines = corpus(400, seed=corpus_seed)
    prompts = [tok(" ".join(rng.choice(lines) for _ in range(n)))["input_ids"][:260] for n in (6, 9, 14, 22)]
    reqs = [dict(prompt_ids=p, max_tokens=max_tokens, temperature=1.0, seed=sample_seed + i)
            for i, p in enumerate(prompts)]
    busy = srv.complete_many(reqs * 3)
    alone = [srv.complete(**r) for r in reqs]
    return prompts, busy, alone


def check_alone_equals_busy(busy: list[Completion], alone: list[Completion]) -> None:
    """P1 on :func:`corpus_busy_and_alone`'s result: each prompt's three busy samples == its sample alone (tokens and
    logprobs, exact)."""
    for i, a in enumerate(alone):
        for b in busy[i::len(alone)]:
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, f"prompt {i}: busy != alone"


def check_decode_equals_prompt_logprobs(srv: VllmServer, completions: list[Completion]) -> None:
    """P3: each completion's decode logprobs == the ``prompt_logprobs`` of prompt + completion sent back."""
    for c in completions:
        n = len(c.prompt_ids)
        r = srv.complete(prompt_ids=c.prompt_ids + c.token_ids, max_tokens=1, prompt_logprobs=True)
        assert r.prompt_logprobs[n : n + len(c.token_ids)] == c.logprobs


def same(a: Completion, b: Completion) -> bool:
    """Identical token ids and bit-identical logprobs (Python floats from JSON are the fp32 values)."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def p3_pairs(res: Results):
    """(decode logprobs, prompt_logprobs of the same tokens) per rescored request."""
    for key, c in res.alone.items():
        r = res.rescored[key]
        n = len(c.prompt_ids)
        yield key, c.logprobs, r.prompt_logprobs[n : n + len(c.token_ids)]


def describe_diff(a: Completion, b: Completion) -> str:
    n = min(len(a.logprobs), len(b.logprobs))
    eq = sum(x == y for x, y in zip(a.logprobs[:n], b.logprobs[:n]))
    first = next((i for i in range(n) if a.logprobs[i] != b.logprobs[i] or a.token_ids[i] != b.token_ids[i]), None)
    md = max((abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])), default=0.0)
    return f"{eq}/{n} logprobs equal, first mismatch at {first}, max |diff| {md:.3g}, tokens same: {a.token_ids == b.token_ids}"


@dataclass
class MultiTurn:
    trajectory: object  # vllm_bi.trajectories.Trajectory
    hits: list[float]  # prefix-cache hits counted during each turn's request


def run_multiturn(srv: VllmServer, model_path: str, turns: int = 3, prefix_len: int = 700, vocab: int = 1024,
                  seed: int = 0) -> MultiTurn:
    """One trajectory of ``turns`` model turns through the trainer's multi-turn rollout: a ``prefix_len``-token
    prompt, 16 sampled tokens per turn, a tool output of 23 token ids after each turn but the last; the prefix-cache
    hits of each turn's request (a later turn's prompt is the conversation so far, so it should hit)."""
    from transformers import AutoTokenizer

    from vllm_bi.trajectories import rollout_trajectories

    rng = random.Random(seed)
    prompt, tools = _ids(rng, prefix_len, vocab), [_ids(rng, 23, vocab) for _ in range(turns - 1)]
    hits: list[float] = []

    class Counting:  # the server, counting each turn's prefix-cache hits
        def complete_many(self, reqs):
            h0 = srv.metric_sum("vllm:prefix_cache_hits_total")
            out = srv.complete_many(reqs)
            hits.append(srv.metric_sum("vllm:prefix_cache_hits_total") - h0)
            return out

    def env(example, so_far):
        return tools[sum(t["role"] == "model" for t in so_far) - 1]

    req = dict(prompt_ids=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + 77, ignore_eos=True)
    (traj,) = rollout_trajectories(Counting(), AutoTokenizer.from_pretrained(model_path), [req], [{}], env, turns)
    return MultiTurn(traj, hits)
