"""The RL trainer's multi-turn environments: ``--env`` names one (a built-in, or ``package.module:function``), and
the built-in ``tool_digits`` task's tool. The rollout itself, its token-in/token-out contract and the environment's
signature: :mod:`vllm_bi.trajectories`."""

from __future__ import annotations

from vllm_bi.trainer.rewards import load_callable

__all__ = ["get_env", "tool_digits_env", "ENVS", "TOOL_TURNS"]


# ---- the built-in task's environment ------------------------------------------------------------------------------

TOOL_TURNS = 3  # model turns of a tool_digits trajectory


def tool_digits_env(example: dict, turns: list[dict]) -> str | None:
    """The ``tool_digits`` task's tool: a model turn is a call when it holds a digit; the tool answers each of the
    first ``TOOL_TURNS - 1`` turns (``" result: ok. next:"`` for a call, ``" error: call with digits:"`` otherwise)
    and ends the trajectory after the last. The reward (:func:`vllm_bi.trainer.rewards.tool_digits`) is the mean
    share of digits over the model's turns, so a model that learns the call format on every turn earns 1."""
    model = [t for t in turns if t["role"] == "model"]
    if len(model) >= TOOL_TURNS:
        return None
    return " result: ok. next:" if any(ch.isdigit() for ch in model[-1]["text"]) else " error: call with digits:"


ENVS = {"tool_digits": tool_digits_env}


def get_env(spec: str):
    """The environment callback named by ``--env``: a built-in (``tool_digits``) or ``package.module:function``."""
    return load_callable(spec, "--env", ENVS)
