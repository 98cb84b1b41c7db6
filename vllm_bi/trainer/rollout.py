"""Rollouts over the server's OpenAI-compatible HTTP API.

A batch is ``prompts_per_step`` prompts x ``group_size`` samples, all sent at
once (so the engine batches them however it likes: batch invariance makes that
irrelevant to the numbers). Each sample carries its token ids, the logprob the
server returned for every sampled token, and the weight version it was sampled
under. The trainer never swaps weights while a batch is being generated, and
the server's ``/weight_info`` is read before and after each batch to prove it.
Every sample has its own seed, derived from (run seed, batch index, prompt,
sample), so a resumed run re-samples exactly what was lost. :class:`RolloutThread`
samples the batches of a run in order in the background, batch ``b`` only once
the server's weight version ``v`` satisfies ``b - v <= max_staleness``, holding
``swap_lock`` while it samples; each batch, or the exception that stopped it,
goes to ``out``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from vllm_bi.trainer.rewards import checked_reward

__all__ = ["Sample", "RolloutBatch", "generate_batch", "VersionChanged", "RolloutThread"]


class VersionChanged(RuntimeError):
    """The server's weights changed while a batch was being sampled (someone else pushed weights)."""


@dataclass
class Sample:
    """One sample: its prompt, what followed it (``completion_ids``) and the server's logprob of each token the
    model sampled. Multi-turn (:mod:`vllm_bi.trajectories`): ``completion_ids`` is the whole trajectory after
    the prompt, model turns and tool outputs, and ``mask`` marks the model's tokens (``logprobs`` holds one per
    True); None: every token is the model's."""

    group: int
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    completion: str
    reward: float = 0.0
    mask: list[bool] | None = None
    turns: int = 1

    @property
    def model_tokens(self) -> int:
        """The tokens the model sampled (the ones trained on)."""
        return len(self.completion_ids) if self.mask is None else sum(self.mask)


@dataclass
class RolloutBatch:
    index: int  # the step this batch is for
    version: int  # weight version every token was sampled under
    data_start: int  # position of its first prompt
    samples: list[Sample] = field(default_factory=list)
    gen_seconds: float = 0.0

    @property
    def completion_tokens(self) -> int:
        """Tokens the model sampled in this batch (tool outputs not counted)."""
        return sum(s.model_tokens for s in self.samples)


def sample_seed(run_seed: int, batch: int, prompt: int, sample: int) -> int:
    return ((run_seed * 1_000_003 + batch) * 4099 + prompt) * 257 + sample & 0x7FFF_FFFF_FFFF


def generate_batch(client, tokenizer, source, reward_fn, cfg, index: int, version: int, env=None) -> RolloutBatch:
    """Batch ``index``: ``cfg.prompts_per_step`` prompts x ``cfg.group_size`` samples, all sampled under weight
    ``version``; with ``env`` (an environment callback) each sample is a multi-turn trajectory
    (:func:`vllm_bi.trajectories.rollout_trajectories`)."""
    start = index * cfg.prompts_per_step
    examples = source.batch(start, cfg.prompts_per_step)
    reqs, owners = [], []
    for j, ex in enumerate(examples):
        ids = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        for k in range(cfg.group_size):
            reqs.append(dict(prompt_ids=ids, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p, seed=sample_seed(cfg.seed, index, j, k), ignore_eos=False,
                             cache_salt=f"vllm_bi-v{version}"))
            owners.append(ex)
    before = client.weight_version()
    t0 = time.perf_counter()
    if env is None:
        outs = client.complete_many(reqs)
    else:
        from vllm_bi.trajectories import rollout_trajectories

        outs = rollout_trajectories(client, tokenizer, reqs, owners, env, cfg.max_turns)
    dt = time.perf_counter() - t0
    after = client.weight_version()
    if before != str(version) or after != str(version):
        raise VersionChanged(f"server weight version was {before!r} before and {after!r} after sampling batch "
                             f"{index}, expected {version}: another client changed the server's weights")
    batch = RolloutBatch(index=index, version=version, data_start=start, gen_seconds=dt)
    for i, c in enumerate(outs):
        ex = examples[i // cfg.group_size]
        if env is None:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            s = Sample(i // cfg.group_size, ex["prompt"], c.prompt_ids, c.token_ids, c.logprobs, text)
        else:  # a Trajectory; the reward sees its turns in the example's "turns"
            text, ex = c.text, dict(ex, turns=c.turns)
            s = Sample(i // cfg.group_size, ex["prompt"], c.prompt_ids, c.token_ids, c.logprobs, text, mask=c.mask,
                       turns=c.model_turns)
        s.reward = checked_reward(reward_fn, ex["prompt"], text, ex)
        batch.samples.append(s)
    return batch


class RolloutThread(threading.Thread):
    def __init__(self, generate, first: int, last: int, max_staleness: int, version: int):
        super().__init__(daemon=True, name="vllm_bi-rollouts")
        self.generate, self.first, self.last, self.max_staleness = generate, first, last, max_staleness
        self.version = version
        self.cond = threading.Condition()
        self.swap_lock = threading.Lock()  # held while sampling a batch and while pushing weights
        self.out: queue.Queue = queue.Queue()
        self.stopped = False

    def set_version(self, v: int) -> None:
        with self.cond:
            self.version = v
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def run(self) -> None:
        try:
            for b in range(self.first, self.last):
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or b - self.version <= self.max_staleness)
                    if self.stopped:
                        return
                with self.swap_lock:
                    self.out.put(self.generate(b, self.version))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.out.put(e)
