"""``python -m vllm_bi.trainer [--config trainer/RECIPE.toml] [--option value ...]`` (``--help`` lists all, and the
exit statuses: :mod:`vllm_bi.errors`' meanings)."""

from __future__ import annotations

import logging
import os
import sys

from vllm_bi.errors import ENVIRONMENT, OK, UserError, run_command
from vllm_bi.trainer.config import TrainerConfig, parse_args


def _check_server_url(cfg: TrainerConfig) -> None:
    """A server given by --server-url must answer before the model is loaded (minutes for a large one)."""
    from vllm_bi.client import VllmClient
    from vllm_bi.trainer.errors import TrainerError

    if cfg.server_url and not VllmClient(cfg.server_url, cfg.model).healthy():
        raise TrainerError(f"no healthy vLLM server answers at --server-url {cfg.server_url} (GET /health); start "
                           f"it (VLLM_BATCH_INVARIANT=1 VLLM_SERVER_DEV_MODE=1 vllm serve {cfg.model}) or fix the "
                           "URL, or leave --server-url empty to let the trainer start one. Nothing was run.",
                           exit_code=ENVIRONMENT)


def _check_inputs(cfg: TrainerConfig) -> None:
    """What the run needs from the user, before a model is built or a server started: the ``VLLM_BI_*`` settings,
    --task (a missing file, a bad line), --reward and --env (one that does not import)."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.data import make_source
    from vllm_bi.trainer.rewards import get_reward

    Settings.from_env()  # the recipe's [settings] were checked when it was read
    source = make_source(cfg.task, cfg.seed)
    get_reward(cfg.reward or source.default_reward)
    if cfg.env or source.env:  # multi-turn: an --env that does not import is refused here too
        from vllm_bi.trainer.multiturn import get_env

        get_env(cfg.env or source.env)


def _explain(e: BaseException) -> UserError | None:
    from vllm_bi.known_errors import explain

    return explain(e, "check --server-url, or leave it empty to let the trainer start a server",
                   "use another --run-dir, or the --model-family and --seed the run was started with")


def _run(argv: list[str] | None) -> int:
    cfg = parse_args(argv)
    _check_inputs(cfg)
    _check_server_url(cfg)
    from vllm_bi.trainer.loop import train

    rows = train(cfg)
    if rows and os.environ.get("RANK", "0") == "0":
        first, last = rows[0], rows[-1]
        print(f"done: steps {first['step']}..{last['step']}, reward/mean {first['reward/mean']:.3f} -> "
              f"{last['reward/mean']:.3f}, max |trainer - server logprob| over the run "
              f"{max(r['bit_wise/logprob_diff/max'] for r in rows):.3g}; metrics in {cfg.run_dir}/metrics.jsonl")
    return OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_command(None, lambda: _run(argv), _explain)


if __name__ == "__main__":
    sys.exit(main())
