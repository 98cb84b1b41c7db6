"""The control plane of a batch-invariant server, closed: one keyed ``vllm serve`` (dev-mode routes on, as the trainer
starts it) over real HTTP.

- every route of the live app (enumerated from its OpenAPI document at test time, plus the mounts ``/metrics`` and
  the docs) answers 401 without the key and with a wrong one; the client with the key is served;
- ``/collective_rpc`` refuses a method outside the allow-list with 403 (``__dir__``, and ``get_kv_cache_spec``,
  whose result once killed the engine's output thread) and the engine keeps serving; an allowed one answers;
- from ``/pause`` to ``/resume`` a completion gets 503 with ``Retry-After``, and a client that waits is served after
  the resume;
- a non-loopback ``--host`` without a key is refused before anything starts;
- kill -9 of the API server takes its engine core and workers with it within 30 s (the lifeline).

The negative control of the 401s is the same request with the key (200), of the 403 an allowed method (200).
"""

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from vllm_bi.client import ServerAuthError, ServerPaused, VllmClient
from vllm_bi.launcher import ServerStartError, VllmServer, cpu_env
from procs import alive, descendants

pytestmark = pytest.mark.server

KEY = "test-key-" + "x" * 16


@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    srv = VllmServer(tiny_model_path("qwen3.5"), args=["--max-num-batched-tokens", "64", "--max-num-seqs", "8"],
                     env=cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"}), api_key=KEY)
    with srv:
        yield srv


def _status(url: str, method: str = "GET", key: str | None = None, body: dict | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else (b"{}" if method in ("POST", "PUT", "PATCH") else None)
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_every_route_needs_the_key(keyed):
    status, _, raw = _status(keyed.url + "/openapi.json", key=KEY)
    assert status == 200
    spec = json.loads(raw)
    routes = [(re.sub(r"\{[^}]+\}", "x", path), m.upper()) for path, ops in spec["paths"].items() for m in ops]
    routes += [("/metrics", "GET"), ("/docs", "GET"), ("/openapi.json", "GET")]
    assert len(routes) > 30 and ("/collective_rpc", "POST") in routes and ("/pause", "POST") in routes
    open_ = [(p, m) for p, m in routes for key in (None, "wrong") if _status(keyed.url + p, m, key)[0] != 401]
    assert open_ == [], f"answered without the key: {open_}"
    # the negative control: with the key, the same kind of request gets through
    assert _status(keyed.url + "/health", key=KEY)[0] == 200
    assert _status(keyed.url + "/v1/models", key=KEY)[0] == 200
    with pytest.raises(ServerAuthError, match="API key"):
        VllmClient(keyed.url, keyed.model, api_key="wrong").complete([5, 6, 7], max_tokens=2)
    assert len(keyed.complete([5, 6, 7], max_tokens=2).token_ids) == 2
    assert keyed.metric_sum("vllm:prompt_tokens_total") > 0


def test_collective_rpc_allows_only_listed_methods(keyed):
    for method in ("__dir__", "get_kv_cache_spec", "execute_model"):
        status, _, raw = _status(keyed.url + "/collective_rpc", "POST", KEY, {"method": method})
        assert status == 403, (method, status, raw[:300])
        assert b"not allowed" in raw
    info = keyed.server_info()  # allowed
    assert info["vllm_bi"] and "gdn_mode" in info
    assert len(keyed.complete([9, 8, 7, 6], max_tokens=3).token_ids) == 3  # the engine still serves
    assert keyed.healthy()


def test_paused_server_answers_503_until_resumed(keyed):
    keyed.pause("wait")
    try:
        status, headers, _ = _status(keyed.url + "/v1/completions", "POST", KEY,
                                     {"model": keyed.model, "prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After") == "1"
        with pytest.raises(ServerPaused):
            keyed.complete([1, 2, 3], max_tokens=2)
        assert _status(keyed.url + "/v1/models", key=KEY)[0] == 200  # reads stay open
        waiting = VllmClient(keyed.url, keyed.model, api_key=KEY, paused_wait=60)
        threading.Timer(2.0, keyed.resume).start()
        t0 = time.monotonic()
        out = waiting.complete([1, 2, 3], max_tokens=2)  # waits out the pause, then is served
        assert len(out.token_ids) == 2 and time.monotonic() - t0 >= 1.5
    finally:
        keyed.resume()
    assert len(keyed.complete([1, 2, 3], max_tokens=2).token_ids) == 2


def test_non_loopback_host_needs_a_key(tiny_model_path):
    env = {k: v for k, v in cpu_env(True).items() if k != "VLLM_API_KEY"}
    with pytest.raises(ServerStartError, match="--host 0.0.0.0 would expose"):
        VllmServer(tiny_model_path("qwen3.5"), args=["--host", "0.0.0.0"], env=env)


def test_killed_api_server_takes_its_engine_with_it(keyed):
    # last in the module: it ends the shared server
    api = keyed.proc.pid
    tree = descendants(api)
    assert tree, "the API server has no engine-core / worker processes"
    os.kill(api, signal.SIGKILL)
    keyed.proc.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in tree):
        time.sleep(0.5)
    left = [p for p in tree if alive(p)]
    assert left == [], f"processes of the killed server still running after 30 s: {left}"
