"""Prompts for rollouts: the built-in procedural ``digits`` task (and ``tool_digits``, its multi-turn form), or a
JSONL dataset.

A source is indexable by a global *position*: batch ``b`` of ``P`` prompts is
positions ``[b*P, (b+1)*P)``. The same position always gives the same example
(JSONL: each pass over the file is shuffled with ``seed`` and the pass number),
so a checkpoint only stores the position and a resumed run sees exactly the
examples it would have seen.
"""

from __future__ import annotations

import os
import random

from vllm_bi.errors import UsageError
from vllm_bi.prompts import read_jsonl

__all__ = ["PromptSource", "make_source", "read_jsonl", "DIGIT_WORDS", "TASKS"]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_FILLER = ("the", "red", "cat", "river", "stone", "page", "road", "moon", "sum", "count", "number", "answer")


class PromptSource:
    name = "base"
    default_reward = "exact_match"
    env = ""  # a multi-turn task's environment (``--env`` name); empty: one turn

    def __len__(self) -> int:  # examples per pass (inf for procedural tasks)
        raise NotImplementedError

    def example(self, position: int) -> dict:
        raise NotImplementedError

    def batch(self, start: int, n: int) -> list[dict]:
        return [self.example(start + i) for i in range(n)]


class DigitsTask(PromptSource):
    """Procedural prompts ("<a few words> <number word> in digits:"); reward: the share of digit
    characters in the completion. A random-init model writes mostly word pieces, so the reward
    starts low (about 0.1 with the built-in tokenizer) and RL raises it within minutes on CPU."""

    name = "digits"
    default_reward = "digits"

    def __init__(self, seed: int):
        self.seed = seed

    def __len__(self) -> int:
        return 1 << 62

    def example(self, position: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + position)
        words = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(2, 5)))
        k = rng.randrange(len(DIGIT_WORDS))
        return {"prompt": f"{words} {DIGIT_WORDS[k]} in digits:", "answer": str(k), "position": position}


class ToolDigitsTask(DigitsTask):
    """The digits prompts as a multi-turn task: the model answers, a tool replies, three model turns per
    trajectory (:func:`vllm_bi.trainer.multiturn.tool_digits_env`); reward: the mean share of digits over the
    model's turns."""

    name = "tool_digits"
    default_reward = "tool_digits"
    env = "tool_digits"


class JsonlDataset(PromptSource):
    """One JSON object per line with a string ``prompt`` (other fields reach the reward function)."""

    name = "jsonl"

    def __init__(self, path: str, seed: int):
        self.path, self.seed = path, seed
        self.rows = read_jsonl(path)
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def example(self, position: int) -> dict:
        epoch, i = divmod(position, len(self.rows))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return dict(self.rows[order[i]], position=position)


TASKS = {"digits": DigitsTask, "tool_digits": ToolDigitsTask}


def make_source(task: str, seed: int) -> PromptSource:
    if task in TASKS:
        return TASKS[task](seed)
    if task.endswith(".jsonl") or os.path.isfile(task):
        if not os.path.isfile(task):
            raise UsageError(f"--task {task!r}: no such file; give a JSONL file or a built-in task "
                             f"({', '.join(TASKS)})")
        return JsonlDataset(task, seed)
    raise UsageError(f"--task {task!r}: not a built-in task ({', '.join(TASKS)}) nor a JSONL file")
