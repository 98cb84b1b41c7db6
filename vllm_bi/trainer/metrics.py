"""Per-step metrics: ``RUN_DIR/metrics.jsonl`` (one object per step) and TensorBoard (``RUN_DIR/tb``)."""

from __future__ import annotations

import json
import logging
import os

from vllm_bi.errors import UsageError

__all__ = ["MetricsWriter", "read_metrics"]

logger = logging.getLogger("vllm_bi.trainer")


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (none without the file). A line that is not a JSON object with a
    ``step`` raises :class:`~vllm_bi.errors.UsageError` naming the file and the line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i}: not a JSON line ({e.msg} at column {e.colno}); delete or repair that "
                                 "line (every line is one step's metrics object)") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise UsageError(f"{path}:{i}: not a step's metrics (an object with an integer \"step\"); delete "
                                 "or repair that line")
            rows.append(row)
    return rows


class MetricsWriter:
    def __init__(self, run_dir: str, first_step: int, tensorboard: bool = True, settings: dict | None = None):
        self.settings = settings  # recorded in this run's first row (vllm_bi.settings' arithmetic dict)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        # A resumed run redoes the steps after its checkpoint: drop their old lines so every step appears once.
        kept = [r for r in read_metrics(run_dir) if r["step"] < first_step]
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(self.path + ".tmp", self.path)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=first_step)
            except ImportError:
                logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only "
                               "(pip install tensorboard, or install vllm_bi with its [trainer] extra)")

    def write(self, row: dict) -> None:
        if self.settings is not None:  # the run's first row (the caller's row too: what it returns is what is written)
            row["settings"], self.settings = self.settings, None
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
