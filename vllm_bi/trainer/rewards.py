"""Reward functions: ``fn(prompt: str, completion: str, example: dict) -> float``.

Chosen by name (``digits``, ``exact_match``, ``contains``, ``tool_digits``) or by dotted path
(``package.module:function`` or ``package.module.function``).
"""

from __future__ import annotations

import importlib
import math

from vllm_bi.errors import UsageError

__all__ = ["REWARDS", "get_reward", "checked_reward", "load_callable"]


def digits(prompt: str, completion: str, example: dict) -> float:
    """Share of the completion's non-space characters that are digits (0 for an empty completion)."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def _answer(example: dict) -> str:
    if "answer" not in example:
        raise KeyError("this reward needs an \"answer\" field in every example")
    return str(example["answer"]).strip()


def exact_match(prompt: str, completion: str, example: dict) -> float:
    """1 if the stripped completion equals the example's ``answer``, else 0."""
    return float(completion.strip() == _answer(example))


def contains(prompt: str, completion: str, example: dict) -> float:
    """1 if the example's ``answer`` occurs in the completion, else 0."""
    return float(_answer(example) in completion)


def tool_digits(prompt: str, completion: str, example: dict) -> float:
    """Multi-turn (the ``tool_digits`` task): the mean over the model's turns (``example["turns"]``) of
    :func:`digits` of each turn's text."""
    turns = [t["text"] for t in example.get("turns", ()) if t["role"] == "model"]
    if not turns:
        raise KeyError("the tool_digits reward needs a multi-turn trajectory (example[\"turns\"]); use it with "
                       "--task tool_digits or an --env")
    return sum(digits(prompt, t, example) for t in turns) / len(turns)


REWARDS = {"digits": digits, "exact_match": exact_match, "contains": contains, "tool_digits": tool_digits}


def load_callable(spec: str, option: str, builtins: dict):
    """``spec``: a name in ``builtins`` or a dotted path ``package.module:function`` (or ``package.module.function``);
    the callable, or a one-line :class:`~vllm_bi.errors.UsageError` naming ``option``."""
    if spec in builtins:
        return builtins[spec]
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise UsageError(f"{option} {spec!r}: not a built-in ({', '.join(builtins)}) nor 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{option} {spec!r}: cannot import ({e})") from None
    if not callable(fn):
        raise UsageError(f"{option} {spec!r}: {attr} is not callable")
    return fn


def get_reward(spec: str):
    return load_callable(spec, "--reward", REWARDS)


def checked_reward(fn, prompt: str, completion: str, example: dict) -> float:
    """Call ``fn`` and insist on a finite number (a NaN reward would silently poison the advantages): anything else
    raises :class:`~vllm_bi.errors.UsageError`."""
    r = fn(prompt, completion, example)
    try:
        r = float(r)
    except (TypeError, ValueError):
        raise UsageError(f"reward {getattr(fn, '__name__', fn)} returned {r!r}, not a number; fix the --reward "
                         "function") from None
    if not math.isfinite(r):
        raise UsageError(f"reward {getattr(fn, '__name__', fn)} returned {r} for prompt {prompt[:60]!r}; fix the "
                         "--reward function")
    return r
