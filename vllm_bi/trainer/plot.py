"""``vllm-bi plot RUN_DIR``: PNG curves of a trainer run from its ``metrics.jsonl``."""

from __future__ import annotations

import os

from vllm_bi.errors import EnvironmentProblem, UsageError
from vllm_bi.trainer.metrics import read_metrics

__all__ = ["plot_run"]

PANELS = {
    "reward.png": ("reward", [("reward/mean", "mean reward"), ("reward/std", "reward std")], "linear"),
    "logprob_diff.png": ("|trainer - server| logprob of sampled tokens",
                         [("bit_wise/logprob_diff/max", "max"), ("bit_wise/logprob_diff/abs_mean", "mean"),
                          ("bit_wise/logprob_diff_at_sample_version/max", "max, recomputed at sample version")],
                         "symlog"),
    "throughput.png": ("tokens / s", [("generator/tokens_per_s", "generator (completion tokens)"),
                                      ("trainer/tokens_per_s", "trainer (forward+backward)")], "linear"),
}


def plot_run(run_dir: str) -> list[str]:
    """Write ``RUN_DIR/plots/{reward,logprob_diff,throughput}.png``; returns their paths. A missing run directory,
    an empty or corrupt ``metrics.jsonl`` raise :class:`~vllm_bi.errors.UsageError` naming the file (and line)."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: no such directory; give a trainer run directory (--run-dir of "
                         "python -m vllm_bi.trainer)")
    rows = read_metrics(run_dir)
    if not rows:
        raise UsageError(f"{run_dir}: no metrics.jsonl with any step (is it a trainer run directory?)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EnvironmentProblem("vllm-bi plot needs matplotlib: pip install matplotlib "
                                 "(or install vllm_bi with its [trainer] extra)") from None
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for fname, (title, series, scale) in PANELS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = 0
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
                drawn += 1
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.set_ylim(bottom=0.0, top=max(1.0, ax.get_ylim()[1]))
        ax.set_xlabel("step")
        ax.set_title(f"{title} — {os.path.basename(os.path.abspath(run_dir))}")
        if drawn:
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
