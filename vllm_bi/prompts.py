"""Prompt files: JSONL with one ``{"prompt": ...}`` object per line (``vllm-bi parity --prompts``, the trainer's
``--task jsonl:PATH``)."""

from __future__ import annotations

import json

__all__ = ["read_jsonl"]


def read_jsonl(path: str) -> list[dict]:
    """Objects of a JSONL file, each with a string ``prompt``; errors name the file and line."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e}); expected one {{\"prompt\": ...}} per line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{i}: expected an object with a string \"prompt\" field")
            rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows
