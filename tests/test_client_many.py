"""``VllmClient.complete_many`` against a local HTTP server that answers /v1/completions (real sockets, no vLLM):
results come back in request order, the first failing request's error is raised, and Ctrl-C (a KeyboardInterrupt
in the caller's thread) returns within 2 s while requests are still in flight (the server holds them 30 s)."""

import _thread
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_bi.client import ServerError, VllmClient


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        if n == 99:  # a request the server refuses
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad request"}')
            return
        if n == 77:  # a request the server holds
            time.sleep(30)
        out = {"choices": [{"token_ids": [n] * n, "logprobs": {"token_logprobs": [-0.5] * n},
                            "finish_reason": "length"}]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield VllmClient(f"http://127.0.0.1:{srv.server_address[1]}", "m", api_key="")
    srv.shutdown()


def test_results_in_request_order(server):
    out = server.complete_many([{"prompt_ids": [1], "max_tokens": n} for n in (3, 1, 2)])
    assert [c.token_ids for c in out] == [[3] * 3, [1], [2, 2]]


def test_first_error_is_raised(server):
    with pytest.raises(ServerError, match="400"):
        server.complete_many([{"prompt_ids": [1], "max_tokens": n} for n in (2, 99, 1)])


def test_ctrl_c_returns_without_waiting_for_requests_in_flight(server):
    # Python's own SIGINT handler, as under a terminal (a shell's background job, as CI's shards, inherits SIGINT
    # ignored, and interrupt_main then does nothing)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, _thread.interrupt_main).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            server.complete_many([{"prompt_ids": [1], "max_tokens": 77} for _ in range(4)])
        assert time.monotonic() - t0 < 2.0
    finally:
        signal.signal(signal.SIGINT, previous)
