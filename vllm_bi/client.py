"""A small client for the OpenAI-compatible and admin HTTP API of a running ``vllm serve``.

Used by ``vllm-bi parity``, the trainer (rollouts, weight sync) and the tests.
The admin routes (``/collective_rpc``, ``/pause``, ``/resume``,
``/reset_prefix_cache``, ``/update_weight_version``, ``/weight_info``) need the
server to run with ``VLLM_SERVER_DEV_MODE=1``.

Every request carries ``Authorization: Bearer <key>`` when the client has a key (``api_key=``, else the
``VLLM_API_KEY`` environment variable): under ``VLLM_BATCH_INVARIANT=1`` every route of the server needs it when the
server has one (:mod:`vllm_bi.patch.control`). A 401 raises :class:`ServerAuthError`; a 503 (the server is paused
for a weight update) raises :class:`ServerPaused`, which :meth:`VllmClient.complete` waits out and retries for up to
``paused_wait`` seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["VllmClient", "Completion", "ServerError", "ServerUnreachable", "ServerAuthError", "ServerPaused"]


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None] | None
    finish_reason: str | None


class ServerUnreachable(ConnectionError):
    """The server did not answer (down, wrong URL, or crashed)."""


class ServerError(RuntimeError):
    """The server failed a request: an HTTP error (``status``: its code) or a reply missing what was asked for
    (``status`` None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerAuthError(ServerError):
    """HTTP 401: the server needs an API key this client does not have (or has another)."""


class ServerPaused(ServerError):
    """HTTP 503 from a paused server (a weight update in progress or left unfinished); ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message, 503)
        self.retry_after = retry_after


_DEV_ROUTES = ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/update_weight_version")


class VllmClient:
    """HTTP client for one served model: ``VllmClient("http://127.0.0.1:8000", model="/path/or/name")``."""

    def __init__(self, url: str, model: str, api_key: str | None = None, paused_wait: float = 0.0):
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else (os.environ.get("VLLM_API_KEY") or None)
        self.paused_wait = paused_wait

    def _headers(self, extra: dict | None = None) -> dict:
        h = dict(extra or {})
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, path: str, data: bytes | None, timeout: float, headers: dict | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, data=data, headers=self._headers(headers))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            route = path.split("?")[0]
            if e.code == 401:
                raise ServerAuthError(
                    f"{self.url}{route} -> HTTP 401: the server needs an API key "
                    f"({'the one given was refused' if self.api_key else 'none was given'}); pass --api-key or set "
                    "VLLM_API_KEY to the server's key", 401) from None
            if e.code == 503:
                try:
                    wait = float(e.headers.get("Retry-After") or 1)
                except ValueError:
                    wait = 1.0
                raise ServerPaused(f"{self.url}{route} -> HTTP 503: {detail}", wait) from None
            if e.code == 404 and route in _DEV_ROUTES:
                detail += " (admin routes need the server started with VLLM_SERVER_DEV_MODE=1)"
            raise ServerError(f"{self.url}{route} -> HTTP {e.code}: {detail}", e.code) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ServerUnreachable(f"vLLM server at {self.url} unreachable ({path.split('?')[0]}): {e}") from None

    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        raw = self._open(path, json.dumps(body).encode(), timeout, {"Content-Type": "application/json"})
        return json.loads(raw) if raw.strip() else {}

    def _get(self, path: str, timeout: float = 30.0) -> dict:
        raw = self._open(path, None, timeout)
        return json.loads(raw) if raw.strip() else {}

    def healthy(self) -> bool:
        try:
            self._get("/health", timeout=5)
            return True
        except (ServerUnreachable, RuntimeError):
            return False

    # ------------------------------------------------------------------ RL admin (VLLM_SERVER_DEV_MODE=1)
    def pause(self, mode: str = "wait") -> None:
        """Stop scheduling: ``wait`` drains in-flight requests first (new ones get HTTP 503 until resume)."""
        self._post(f"/pause?mode={mode}&clear_cache=true", {})

    def resume(self) -> None:
        self._post("/resume", {})

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block (KV made with old weights); raises if the server refuses."""
        r = self._post("/reset_prefix_cache", {})
        if isinstance(r, dict) and r.get("success") is False:
            raise ServerError(f"{self.url}: /reset_prefix_cache refused (blocks still held): {r}")

    def set_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})

    def weight_version(self) -> str | None:
        return self._get("/weight_info").get("weight_version")

    def collective_rpc(self, method: str, kwargs: dict | None = None, timeout: float = 600.0) -> list:
        body = {"method": method, "kwargs": kwargs or {}, "timeout": timeout}
        r = self._post("/collective_rpc", body, timeout=timeout)
        return r.get("results", []) if isinstance(r, dict) else r

    def weight_digest(self) -> dict[str, str]:
        """The served weights' :func:`vllm_bi.weights.weight_digest` (one worker: TP/PP = 1)."""
        results = self.collective_rpc("vllm_bi_weight_digest")
        if len(results) != 1 or not isinstance(results[0], dict):
            raise ServerError(f"{self.url}: expected one worker's weight digest, got {str(results)[:300]} "
                               "(is the vllm_bi plugin active, VLLM_BATCH_INVARIANT=1, TP=1?)")
        return results[0]

    def server_info(self) -> dict:
        """The plugin's ``vllm_bi_info`` from the first worker: what a trainer must agree with (GDN mode, ...).
        Needs ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``)."""
        results = self.collective_rpc("vllm_bi_info")
        if not results or not isinstance(results[0], dict):
            raise ServerError(f"{self.url}: no vllm_bi_info from the server (got {str(results)[:300]}); is the "
                               "vllm_bi plugin active with VLLM_BATCH_INVARIANT=1?")
        return results[0]

    def reload_weights(self, weights_path: str, timeout: float = 600.0) -> None:
        """Load the checkpoint at ``weights_path`` into the running engine in place (no restart).

        Uses vLLM's ``/collective_rpc`` -> worker ``reload_weights``; the server must run with
        ``VLLM_SERVER_DEV_MODE=1``. Under batch invariance vllm_bi keeps weights unpacked, so the
        reloaded tensors are used as they are.
        """
        self.collective_rpc("reload_weights", {"weights_path": weights_path}, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Prometheus counters/gauges as ``{name{labels}: value}``."""
        text = self._open("/metrics", None, 10).decode()
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
        cache_salt: str | None = None,
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
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if prompt_logprobs:
            body["prompt_logprobs"] = 0
        deadline = time.monotonic() + self.paused_wait
        while True:
            try:
                ch = self._post("/v1/completions", body)["choices"][0]
                break
            except ServerPaused as e:  # a weight update: wait for the resume, up to paused_wait seconds
                if time.monotonic() + e.retry_after > deadline:
                    raise
                time.sleep(e.retry_after)
        if isinstance(prompt_ids, str):
            prompt_ids = list(ch.get("prompt_token_ids") or [])
            if not prompt_ids:
                raise ServerError("server did not return prompt_token_ids (needs return_token_ids support)")
        token_ids = list(ch["token_ids"])
        lps = [float(x) for x in ch["logprobs"]["token_logprobs"]]
        if len(lps) != len(token_ids):
            raise ServerError(f"server returned {len(lps)} logprobs for {len(token_ids)} tokens")
        plp = None
        if prompt_logprobs:
            plp = []
            raw = ch.get("prompt_logprobs")
            if raw is None:
                raise ServerError("server returned no prompt_logprobs")
            for pos, entry in enumerate(raw):
                if entry is None:
                    plp.append(None)
                    continue
                tok = prompt_ids[pos]
                item = entry.get(str(tok)) or entry.get(tok)
                if item is None:
                    raise ServerError(f"prompt_logprobs at {pos} lacks the prompt token {tok}")
                plp.append(float(item["logprob"]))
        return Completion(prompt_ids, token_ids, lps, plp, ch.get("finish_reason"))

    def complete_many(self, requests: list[dict]) -> list[Completion]:
        """Send ``requests`` (kwargs of :meth:`complete`) concurrently, so the engine batches them; the first error
        (in request order) is raised once all have ended.

        One daemon thread per request: Ctrl-C returns at once instead of waiting for the requests in flight, and
        their connections close with the process, so the server aborts them."""
        barrier = threading.Barrier(len(requests)) if requests else None
        results: list = [None] * len(requests)
        errors: list = [None] * len(requests)

        def run(i, kw):
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                pass
            try:
                results[i] = self.complete(**kw)
            except BaseException as e:  # re-raised in the caller's thread
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i, kw), daemon=True, name=f"vllm-bi-request-{i}")
                   for i, kw in enumerate(requests)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short waits: a Ctrl-C is seen within 0.2 s, whichever thread the signal reached
        for e in errors:
            if e is not None:
                raise e
        return results
