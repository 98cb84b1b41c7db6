"""``python -m vllm_bi.trainer [--config trainer/RECIPE.toml] [--option value ...]`` (``--help`` lists all)."""

from __future__ import annotations

import logging
import os
import sys

from vllm_bi.trainer.config import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.loop import train

    try:
        rows = train(cfg)
    except (TrainerError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rows and os.environ.get("RANK", "0") == "0":
        first, last = rows[0], rows[-1]
        print(f"done: steps {first['step']}..{last['step']}, reward/mean {first['reward/mean']:.3f} -> "
              f"{last['reward/mean']:.3f}, max |trainer - server logprob| over the run "
              f"{max(r['bit_wise/logprob_diff/max'] for r in rows):.3g}; metrics in {cfg.run_dir}/metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
