"""Multi-turn rollouts over a server client: a trajectory is the model's turns interleaved with a tool's output,
from an environment (the RL trainer's environments: :mod:`vllm_bi.trainer.multiturn`; ``vllm-bi parity``'s: a
prompts file's fixed tool outputs).

Token in, token out. Every turn is a new request on the same conversation: its prompt is the trajectory's token ids
so far (the prompt, then every model and tool token), so the server's prefix cache holds the conversation and
nothing is ever re-tokenised through a chat template. A tool's output is tokenised alone and appended as ids. The
trainer recomputes the whole trajectory in one forward and trains on the model's tokens only (``Sample.mask``),
each against the logprob the server returned for it.

An environment is a callable ``env(example, turns) -> str | list[int] | None``. ``turns`` is the conversation after
the prompt, ``[{"role": "model" | "tool", "text": str, "ids": list[int]}, ...]``, ending in a model turn (a copy:
changing it changes nothing). It returns the tool's output (text, or token ids) or None to end the trajectory,
which also ends after ``max_turns`` model turns. The reward function then sees the turns in ``example["turns"]``.

The GDN modes' arithmetic (recurrent, chunk) does not depend on where a request's prompt ends, so the model's tokens
of every turn get the trainer's bits from its single forward over the trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_bi.errors import UsageError

__all__ = ["Trajectory", "rollout_trajectories", "turn_seed"]


@dataclass
class Trajectory:
    """One conversation: ``prompt_ids``, then ``token_ids`` (every token after the prompt, the name a single-turn
    completion has), ``mask`` (True: the model's), the server's ``logprobs`` of the model's tokens, and the
    ``turns`` as the environment saw them."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)

    def add(self, role: str, ids: list[int], text: str, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.mask += [role == "model"] * len(ids)
        self.logprobs += logprobs or []
        self.turns.append({"role": role, "text": text, "ids": list(ids)})

    @property
    def text(self) -> str:
        """The trajectory after the prompt as text: each turn's text in order."""
        return "".join(t["text"] for t in self.turns)

    @property
    def model_turns(self) -> int:
        return sum(t["role"] == "model" for t in self.turns)


def turn_seed(seed: int, turn: int) -> int:
    """A sample's server-side seed for its ``turn``-th model turn (turn 0: the sample's own seed)."""
    return seed if turn == 0 else (seed * 1_000_033 + turn * 7_919) & 0x7FFF_FFFF_FFFF


def rollout_trajectories(client, tokenizer, requests: list[dict], examples: list[dict], env, max_turns: int
                         ) -> list[Trajectory]:
    """Sample each of ``requests`` (as for ``client.complete_many``: ``prompt_ids``, sampling options, ``seed``) as a
    trajectory of up to ``max_turns`` model turns, the environment answering each turn of ``examples[i]``. Each turn
    of every unfinished trajectory goes to the server at once."""
    if max_turns < 1:
        raise UsageError(f"--max-turns must be >= 1, got {max_turns}")
    trajs = [Trajectory(list(r["prompt_ids"])) for r in requests]
    active = list(range(len(requests)))
    name = getattr(env, "__name__", repr(env))
    for turn in range(max_turns):
        sent = [dict(requests[i], prompt_ids=trajs[i].prompt_ids + trajs[i].token_ids,
                     seed=turn_seed(requests[i]["seed"], turn)) for i in active]
        outs = client.complete_many(sent)
        going = []
        for i, c in zip(active, outs):
            t = trajs[i]
            t.add("model", list(c.token_ids), tokenizer.decode(c.token_ids, skip_special_tokens=True), c.logprobs)
            if turn + 1 == max_turns:
                continue
            try:
                reply = env(examples[i], [dict(x, ids=list(x["ids"])) for x in t.turns])
            except Exception as e:  # noqa: BLE001 - the user's callback: named in one line
                raise UsageError(f"environment {name} raised {type(e).__name__}: {e}; fix the --env "
                                 "function") from None
            if reply is None:
                continue
            ids = _tool_ids(reply, tokenizer, name)
            t.add("tool", ids, reply if isinstance(reply, str) else tokenizer.decode(ids), None)
            going.append(i)
        active = going
        if not active:
            break
    return trajs


def _tool_ids(reply, tokenizer, name: str) -> list[int]:
    if isinstance(reply, str):
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    elif isinstance(reply, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in reply):
        ids = list(reply)
    else:
        raise UsageError(f"environment {name} returned {type(reply).__name__} {str(reply)[:60]!r}: return the tool's "
                         "output as a string or a list of token ids, or None to end the trajectory")
    if not ids:
        raise UsageError(f"environment {name} returned an empty tool output; return None to end the trajectory")
    return ids

