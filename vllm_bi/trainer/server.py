"""The server the trainer samples from. :func:`connect` returns the run's server and a client for it: the user's
(``--server-url``, with ``--api-key`` or ``VLLM_API_KEY``) or the trainer's own. :func:`start_server` starts the
trainer's own batch-invariant ``vllm serve`` of the run's model (admin routes on, loopback, an API key made for the
run, outside the trainer's torchrun process group, dying with the trainer; log in ``RUN_DIR/server.log``, pid in
``RUN_DIR/server.pid``) and returns once it is ready; a server of an earlier trainer of the same run dir that is
still alive is waited for (it stops within seconds of its trainer) and, if it stays, refused: never two servers for
one run. The rollout client waits out a paused server (503) instead of failing. :func:`check_server` returns
only for a server whose logprobs and weights the trainer can match (admin routes, the vllm_bi plugin, the same
batch-invariance settings as this process, and, when weights are verified, one worker) and otherwise raises a
:class:`TrainerError` that says how to fix it.
"""

from __future__ import annotations

import logging
import os
import shlex
import time

from vllm_bi.client import ServerAuthError, VllmClient
from vllm_bi.errors import MISMATCH, USAGE
from vllm_bi.parity import SettingsMismatch, adopt_server_tiles, settings_mismatch
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.errors import TrainerError

PAUSED_WAIT_S = 600.0  # how long a rollout request waits out a paused server before the run fails

__all__ = ["connect", "start_server", "check_server", "tiles_dir", "share_server_tiles"]

logger = logging.getLogger("vllm_bi.trainer")


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def connect(cfg: TrainerConfig, model_dir: str):
    """``(server or None, client)``: the trainer's own server when ``--server-url`` is empty, else a client of the
    user's; both checked by :func:`check_server`."""
    server = start_server(cfg, model_dir) if not cfg.server_url else None
    client = server or VllmClient(cfg.server_url, model_dir, api_key=cfg.api_key or None)
    client.paused_wait = PAUSED_WAIT_S
    try:
        if cfg.arithmetic == "stock":
            check_admin_routes(client)  # a stock server: no vllm_bi RPCs to ask, no parity to check
        else:
            check_server(client, cfg.verify_weights, tiles_dir(cfg.run_dir))
    except BaseException:
        if server is not None:
            server.stop()
        raise
    return server, client


def _alive_server(pid_file: str) -> int | None:
    """The pid in ``pid_file`` when that process is alive and a vLLM server, else None."""
    try:
        pid = int(open(pid_file).read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError):
        return None
    return pid if b"vllm" in cmd and state != "Z" else None


def start_server(cfg: TrainerConfig, model_dir: str):
    from vllm_bi.launcher import VllmServer, cpu_env

    pid_file = os.path.join(cfg.run_dir, "server.pid")
    old = _alive_server(pid_file)
    if old is not None:  # an earlier trainer's server: it ends itself within seconds of its trainer's death
        deadline = time.time() + 30
        while time.time() < deadline and _alive_server(pid_file) is not None:
            time.sleep(0.5)
        if _alive_server(pid_file) is not None:
            raise TrainerError(f"a vLLM server of this run dir is still running (pid {old}, {pid_file}): is another "
                               f"trainer using {cfg.run_dir}? Stop it (kill {old}) or use another --run-dir")
    log = os.path.join(cfg.run_dir, "server.log")
    bi = cfg.arithmetic != "stock"
    logger.info("starting VLLM_BATCH_INVARIANT=%d vllm serve %s (log: %s)", int(bi), model_dir, log)
    extra_env, args = {"VLLM_SERVER_DEV_MODE": "1"}, shlex.split(cfg.server_args)
    if cfg.weight_push == "ipc":  # vLLM's weight-transfer engine, CUDA IPC backend (its handles travel pickled)
        extra_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        args += ["--weight-transfer-config", '{"backend": "ipc"}']
    env = cpu_env(bi, extra_env)
    for k in [k for k in env if k in _TORCHRUN_ENV or k.startswith("TORCHELASTIC_")]:
        del env[k]  # the server is not part of the trainer's process group
    srv = VllmServer(model_dir, env=env, args=args, log_path=log, api_key=cfg.api_key or None)
    t0 = time.perf_counter()
    srv.start()
    logger.info("server ready in %.0f s", time.perf_counter() - t0)
    with open(pid_file, "w") as f:
        f.write(str(srv.proc.pid))
    return srv


def tiles_dir(run_dir: str) -> str:
    """Where a run keeps its copies of its server's tuned GEMM tile tables (``<digest>.json``)."""
    return os.path.join(run_dir, "gemm_tiles")


def share_server_tiles(dist, run_dir: str) -> None:
    """Every trainer rank takes the tuned tile table the first rank took from the server (``check_server``), if
    any: the same text, written to the run's folder and installed (``VLLM_BI_GEMM_CONFIGS=tune``)."""
    from vllm_bi.ops.gemm_tune import adopt_table
    from vllm_bi.settings import tuned_table

    text = None
    if dist.main and tuned_table() is not None:
        with open(tuned_table()[0], newline="") as f:
            text = f.read()
    text = dist.broadcast(text)
    if text is not None and not dist.main:
        adopt_table(text, tiles_dir(run_dir))


def check_admin_routes(client: VllmClient) -> None:
    """The server answers, with this key, and has the admin routes the weight push uses (``VLLM_SERVER_DEV_MODE``)."""
    try:
        client.weight_version()
    except ServerAuthError as e:
        raise TrainerError(f"{e} (--api-key)") from None
    except RuntimeError as e:
        raise TrainerError(f"{e}; start the server with VLLM_SERVER_DEV_MODE=1 (the trainer swaps weights through "
                           "its admin routes)") from None


def check_server(client: VllmClient, verify_weights: bool = True, tiles: str | None = None) -> None:
    check_admin_routes(client)
    infos = client.collective_rpc("vllm_bi_info")  # one entry per worker
    workers = len(infos)
    if workers == 0 or not isinstance(infos[0], dict):
        raise TrainerError(f"the server at {client.url} does not answer vllm_bi's RPCs; start it with "
                           "VLLM_BATCH_INVARIANT=1 and vllm_bi installed (`vllm-bi info`).")
    if tiles is not None:
        try:
            adopt_server_tiles(infos[0], tiles)  # VLLM_BI_GEMM_CONFIGS=tune: the server's table, not one of ours
        except SettingsMismatch as e:
            raise TrainerError(str(e), exit_code=MISMATCH) from None
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
