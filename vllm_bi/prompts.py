"""Prompt files: JSONL with one ``{"prompt": ...}`` object per line (``vllm-bi parity --prompts``, the trainer's
``--task jsonl:PATH``)."""

from __future__ import annotations

import json

from vllm_bi.errors import UsageError

__all__ = ["read_jsonl"]


def read_jsonl(path: str) -> list[dict]:
    """Objects of a JSONL file, each with a non-empty string ``prompt``; a bad line raises
    :class:`~vllm_bi.errors.UsageError` (a ``ValueError``) naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text ({e.reason}); expected one {{\"prompt\": ...}} per line") from None
    rows = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{i}: not JSON ({e}); expected one {{\"prompt\": ...}} per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"{path}:{i}: expected an object with a string \"prompt\" field")
        if not obj["prompt"].strip():
            raise UsageError(f"{path}:{i}: the prompt is empty; give each line some text to complete")
        rows.append(obj)
    if not rows:
        raise UsageError(f"{path}: no examples; give one {{\"prompt\": ...}} per line")
    return rows
