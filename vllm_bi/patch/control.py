"""The API server's control plane under ``VLLM_BATCH_INVARIANT=1``: every route behind the API key, an allow-list
for ``/collective_rpc``, and 503 instead of a hang while generation is paused.

vLLM 0.32's ``--api-key`` (or ``VLLM_API_KEY``) guards ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only; with
``VLLM_SERVER_DEV_MODE=1`` its control routes (``/pause``, ``/resume``, ``/update_weight_version``,
``/reset_prefix_cache``, ``/sleep``, ...) stay open to anyone who can reach the port, and ``/collective_rpc`` calls
any worker method by name (``__dir__`` answers, and a method whose result cannot be serialised kills the engine's
output thread while ``/health`` still says 200). :func:`guard_build_app` wraps vLLM's ``build_app`` so that the app it
builds has :class:`ControlGuard` outermost:

* with a key set, every HTTP route (``/health`` and ``/metrics`` included; CORS preflights excepted) answers 401
  without ``Authorization: Bearer <key>``;
* ``/collective_rpc`` runs only the methods of :data:`ALLOWED_RPC` (vllm_bi's own, the in-place reload the weight
  push uses, and the worker calls of vLLM's weight-transfer engine); any other method is refused with 403 and one
  log line, before the engine sees it;
* from a ``/pause`` request until a successful ``/resume``, generation routes answer 503 with ``Retry-After``
  instead of waiting in the engine's queue (a client that waits and retries is served on the version the push
  labels; none hangs on a server a failed push left paused).

The pause state is kept in the API server process: with ``--api-server-count`` > 1 each process knows only the
pauses it forwarded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets

__all__ = ["ALLOWED_RPC", "ControlGuard", "guard_build_app", "api_tokens", "route_table"]

logger = logging.getLogger("vllm_bi")

# Worker methods /collective_rpc may call. vllm_bi's own (patch.worker_rpc), the in-place reload of a checkpoint
# (the trainer's weight push on CPU), vLLM's weight check, and the worker side of vLLM's weight-transfer engine.
ALLOWED_RPC = frozenset({
    "vllm_bi_info", "vllm_bi_weight_digest", "vllm_bi_model_layout",
    "reload_weights", "compute_weight_checksums",
    "init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
    "start_draft_weight_update", "update_weights", "finish_weight_update",
})
# routes that generate (closed while paused); /v1/models and the other /v1 reads stay open
GENERATE_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/score",
                     "/v1/rerank", "/v1/audio", "/v1/generate", "/v2", "/inference", "/generate", "/pooling",
                     "/classify", "/score", "/rerank", "/tokenize", "/detokenize", "/v1/messages", "/invocations",
                     "/generative_scoring")
RETRY_AFTER_S = 1
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def api_tokens(args) -> list[str]:
    """The API keys this server accepts: ``--api-key`` (which takes precedence), else ``VLLM_API_KEY``."""
    keys = list(getattr(args, "api_key", None) or [])
    if not keys and os.environ.get("VLLM_API_KEY"):
        keys = [os.environ["VLLM_API_KEY"]]
    return [k for k in keys if k]


def route_table(app) -> list[str]:
    """``"METHODS /path"`` for every route of ``app``, sorted (what ``docs/security.md`` lists)."""
    out = []
    for r in app.routes:
        path = getattr(r, "path", None)
        if path is None:
            continue
        methods = sorted(getattr(r, "methods", None) or ["*"])
        out.append(f"{','.join(methods)} {path}")
    return sorted(out)


async def _json(send, status: int, message: str, headers: tuple = ()) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ControlGuard:
    """Pure ASGI middleware (see the module doc). ``tokens``: the accepted API keys (none: no authentication)."""

    def __init__(self, app, tokens: list[str], allowed_rpc=ALLOWED_RPC):
        self.app = app
        self._hashes = [hashlib.sha256(t.encode()).digest() for t in tokens]
        self.allowed_rpc = frozenset(allowed_rpc)
        self.paused = False

    def _authorized(self, scope) -> bool:
        if not self._hashes:
            return True
        value = ""
        for k, v in scope.get("headers") or []:
            if k.lower() == b"authorization":
                value = v.decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for h in self._hashes:
            ok |= secrets.compare_digest(digest, h)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            logger.warning("vllm_bi: refused %s %s without a valid API key", scope.get("method"), path)
            return await _json(send, 401, "unauthorized: this server needs its API key (header "
                                          "'Authorization: Bearer <key>'; vllm_bi's tools take --api-key or "
                                          "VLLM_API_KEY)", ((b"www-authenticate", b"Bearer"),))
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if path == "/collective_rpc":
            return await self._rpc(scope, receive, send)
        if path == "/pause":
            return await self._pause(scope, receive, send)
        if path == "/resume":
            return await self._resume(scope, receive, send)
        if self.paused and path.startswith(GENERATE_PREFIXES):
            return await _json(send, 503, f"paused (a weight update is in progress or did not finish); retry after "
                                          f"{RETRY_AFTER_S} s", ((b"retry-after", str(RETRY_AFTER_S).encode()),))
        return await self.app(scope, receive, send)

    async def _rpc(self, scope, receive, send):
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            method = json.loads(body or b"{}").get("method")
        except (ValueError, AttributeError):
            method = None  # not a JSON object: vLLM's handler answers 400
        if method is not None and method not in self.allowed_rpc:
            logger.warning("vllm_bi: refused /collective_rpc method %r (allowed: %s)", method,
                           ", ".join(sorted(self.allowed_rpc)))
            return await _json(send, 403, f"/collective_rpc method {str(method)[:100]!r} is not allowed under "
                                          f"VLLM_BATCH_INVARIANT=1; allowed: {', '.join(sorted(self.allowed_rpc))}")
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _pause(self, scope, receive, send):
        before, self.paused = self.paused, True  # close at once: nothing new enters while the engine drains
        status = await self._forward(scope, receive, send)
        if status != 200:
            self.paused = before

    async def _resume(self, scope, receive, send):
        if await self._forward(scope, receive, send) == 200:
            self.paused = False

    async def _forward(self, scope, receive, send) -> int:
        status = 0

        async def watch(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        await self.app(scope, receive, watch)
        return status


def guard_build_app(original):
    """vLLM's ``build_app`` whose app has :class:`ControlGuard` outermost (see the module doc)."""

    import functools

    @functools.wraps(original)
    def build_app(args, *a, **kw):
        app = original(args, *a, **kw)
        tokens = api_tokens(args)
        if getattr(app, "middleware_stack", None) is None:
            app.add_middleware(ControlGuard, tokens=tokens)
        else:  # vLLM's SageMaker bootstrap built the stack already: the guard goes around it
            app.middleware_stack = ControlGuard(app.middleware_stack, tokens=tokens)
        host = getattr(args, "host", None)
        if tokens:
            logger.info("vllm_bi: every route needs the API key; /collective_rpc allows only %s",
                        ", ".join(sorted(ALLOWED_RPC)))
        elif host not in LOOPBACK:
            control = [r for r in route_table(app) if not r.split(" ", 1)[1].startswith("/v1")]
            logger.warning("vllm_bi: serving on %s without an API key: anyone who reaches the port may call %d "
                           "routes besides /v1, among them %s. Set --api-key or VLLM_API_KEY, or bind 127.0.0.1.",
                           host or "all interfaces", len(control), "; ".join(control[:12]))
        return app

    return build_app
