"""The server the trainer samples from. :func:`start_server` starts the trainer's own batch-invariant
``vllm serve`` of the run's model (admin routes on, outside the trainer's torchrun process group, log in
``RUN_DIR/server.log``, pid in ``RUN_DIR/server.pid``) and returns once it is ready; :func:`check_server` returns
only for a server whose logprobs and weights the trainer can match (admin routes, the vllm_bi plugin, the same
batch-invariance settings as this process, and, when weights are verified, one worker) and otherwise raises a
:class:`TrainerError` that says how to fix it.
"""

from __future__ import annotations

import logging
import os
import shlex
import time

from vllm_bi.client import VllmClient
from vllm_bi.errors import MISMATCH, USAGE
from vllm_bi.parity import settings_mismatch
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.errors import TrainerError

__all__ = ["start_server", "check_server"]

logger = logging.getLogger("vllm_bi.trainer")


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def start_server(cfg: TrainerConfig, model_dir: str):
    from vllm_bi.launcher import VllmServer, cpu_env

    log = os.path.join(cfg.run_dir, "server.log")
    logger.info("starting VLLM_BATCH_INVARIANT=1 vllm serve %s (log: %s)", model_dir, log)
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    for k in [k for k in env if k in _TORCHRUN_ENV or k.startswith("TORCHELASTIC_")]:
        del env[k]  # the server is not part of the trainer's process group
    srv = VllmServer(model_dir, env=env, args=shlex.split(cfg.server_args), log_path=log)
    t0 = time.perf_counter()
    srv.start()
    logger.info("server ready in %.0f s", time.perf_counter() - t0)
    with open(os.path.join(cfg.run_dir, "server.pid"), "w") as f:
        f.write(str(srv.proc.pid))
    return srv


def check_server(client: VllmClient, verify_weights: bool = True) -> None:
    try:
        client.weight_version()
    except RuntimeError as e:
        raise TrainerError(f"{e}\nStart the server with VLLM_SERVER_DEV_MODE=1 (the trainer swaps weights through "
                           "its admin routes).") from None
    infos = client.collective_rpc("vllm_bi_info")  # one entry per worker
    workers = len(infos)
    if workers == 0 or not isinstance(infos[0], dict):
        raise TrainerError(f"the server at {client.url} does not answer vllm_bi's RPCs; start it with "
                           "VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).")
    why = settings_mismatch(infos[0])
    if why:
        raise TrainerError(f"{why}: their logprobs cannot match.", exit_code=MISMATCH)
    if verify_weights and workers > 1:
        raise TrainerError(f"the server at {client.url} runs {workers} workers (tensor parallel): the weight digest "
                           "check compares one worker's full weights, so it needs a TP = 1 server. Pass "
                           "--verify-weights false (the on-policy logprob diff of 0.0 still shows the push landed).",
                           exit_code=USAGE)
    if verify_weights:
        try:
            client.weight_digest()
        except RuntimeError as e:
            raise TrainerError(f"the server at {client.url} does not answer vllm_bi's weight digest ({e}); start it "
                               "with VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).") from None
