"""A small client for the OpenAI-compatible and admin HTTP API of a running ``vllm serve``.

Used by ``vllm-bi parity``, the trainer (rollouts, weight sync) and the tests.
The admin routes (``/collective_rpc``, ``/pause``, ``/resume``,
``/reset_prefix_cache``, ``/update_weight_version``, ``/weight_info``) need the
server to run with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["VllmClient", "Completion", "ServerError", "ServerUnreachable"]


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


_DEV_ROUTES = ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/update_weight_version")


class VllmClient:
    """HTTP client for one served model: ``VllmClient("http://127.0.0.1:8000", model="/path/or/name")``."""

    def __init__(self, url: str, model: str):
        self.url = url.rstrip("/")
        self.model = model

    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code == 404 and path in _DEV_ROUTES:
                detail += " (admin routes need the server started with VLLM_SERVER_DEV_MODE=1)"
            raise ServerError(f"{self.url}{path} -> HTTP {e.code}: {detail}", e.code) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ServerUnreachable(f"vLLM server at {self.url} unreachable ({path}): {e}") from None

    def _get(self, path: str, timeout: float = 30.0) -> dict:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                body = r.read()
                return json.loads(body) if body.strip() else {}
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.url}{path} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}",
                              e.code) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ServerUnreachable(f"vLLM server at {self.url} unreachable ({path}): {e}") from None

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
        ch = self._post("/v1/completions", body)["choices"][0]
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
