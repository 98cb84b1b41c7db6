"""A failed ``vllm serve`` start names its root cause: the engine process's traceback, which vLLM prints long
before the API server's own (which only says the engine failed); a start whose chosen port was taken meanwhile is
retried on another."""

import socket
import sys

import pytest

from vllm_bi.launcher import ServerStartError, VllmServer, log_excerpt


def test_excerpt_shows_the_engine_traceback_before_the_tail(tmp_path):
    engine = [
        "(EngineCore pid=7) ERROR 11-30 11:36:49 [core.py:1100] EngineCore failed to start.",
        "(EngineCore pid=7) ERROR 11-30 11:36:49 [core.py:1100] Traceback (most recent call last):",
        '(EngineCore pid=7) ERROR 11-30 11:36:49 [core.py:1100]   File "/x/rotary.py", line 53, in apply_rotary',
        "(EngineCore pid=7) ERROR 11-30 11:36:49 [core.py:1100]     cos_sin_cache = cos_sin_cache.to(positions.device)",
        "(EngineCore pid=7) RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        "(EngineCore pid=7) after the error line",
    ]
    api = ["Traceback (most recent call last):", '  File "/x/utils.py", line 1431', "RuntimeError: Engine core "
           "initialization failed. See root cause above."]
    log = tmp_path / "server.log"
    log.write_text("\n".join(["starting"] * 5 + engine + [f"noise {i}" for i in range(80)] + api) + "\n")
    text = log_excerpt(str(log), n=20)
    assert "first error in the log:" in text and "rotary.py" in text and "Cannot copy between CPU and CUDA" in text
    assert "after the error line" not in text  # the cause stops at its error line
    assert text.index("Cannot copy") < text.index("log tail:") < text.index("See root cause above")
    assert "noise 59" not in text and "noise 79" in text and str(log) in text


def test_excerpt_is_the_tail_when_the_error_is_in_it(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("a\nTraceback (most recent call last):\nValueError: bad model\n")
    text = log_excerpt(str(log))
    assert "first error" not in text and "ValueError: bad model" in text
    assert log_excerpt(str(tmp_path / "missing.log")).startswith("no log at")


FAKE_SERVE = r"""
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()  # OSError "Address already in use" if taken
"""


class _FakeServe(VllmServer):
    """The launcher around a stand-in for ``vllm serve``: an HTTP server with ``/health`` on the given port."""

    def command(self):
        return [sys.executable, "-c", FAKE_SERVE, *self.args]


def test_a_chosen_port_taken_before_the_server_binds_it_is_replaced(tmp_path):
    """Two servers started at once can race for a port between ``free_port`` and the server's own bind (seen in CI:
    ``OSError: [Errno 98] Address already in use``): a port the launcher chose is replaced and the start retried.
    Control: a port the caller gave is not replaced, and the start fails naming the cause."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        srv = _FakeServe("m", log_path=str(tmp_path / "a.log"), startup_timeout=30)
        srv._move_to(busy)  # as if another process had bound the chosen port first
        with srv:
            assert srv.port != busy and srv.url.endswith(f":{srv.port}") and srv.args[srv.args.index("--port") + 1] \
                == str(srv.port)
        with pytest.raises(ServerStartError, match="Address already in use"):
            _FakeServe("m", port=busy, log_path=str(tmp_path / "b.log"), startup_timeout=30).start()


def test_a_flag_the_caller_gives_is_passed_once():
    """The launcher's own `vllm serve` defaults give way to the caller's flags (in either spelling), so vLLM never
    sees a flag twice; the defaults the caller leaves out are still passed."""
    srv = VllmServer("/m", args=["--max-model-len", "4096", "--gpu-memory-utilization=0.5"])
    a = srv.args
    assert a.count("--max-model-len") == 1 and a[a.index("--max-model-len") + 1] == "4096"
    assert not any(x == "--gpu-memory-utilization" or x == "--gpu-memory-utilization=0.2" for x in a)
    assert "--gpu-memory-utilization=0.5" in a
    assert a[a.index("--dtype") + 1] == "bfloat16" and a[a.index("--max-logprobs") + 1] == "5"
    plain = VllmServer("/m").args
    assert plain[plain.index("--max-model-len") + 1] == "2048"


def test_a_stock_server_of_a_model_it_cannot_import_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Stock vLLM's Qwen3.5 module imports torchvision (its vision tower): without torchvision a stock server of a
    Qwen3.5 checkpoint is refused at once, by name and with the fix, and no process is started. Controls: the same
    checkpoint under VLLM_BATCH_INVARIANT=1 (vllm_bi's text-only classes), a Qwen3-Next checkpoint, and an
    environment with torchvision all go on to start the server."""
    import importlib.util
    import json

    from vllm_bi import launcher

    real_find_spec = importlib.util.find_spec
    have_torchvision = {"yes": False}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if have_torchvision["yes"] else None)
                        if name == "torchvision" else real_find_spec(name, *a))

    class Started(Exception):
        pass

    monkeypatch.setattr(VllmServer, "_start_once", lambda self: (_ for _ in ()).throw(Started()))

    def model(arch):
        d = tmp_path / arch
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
        return str(d)

    with pytest.raises(ServerStartError, match=r"stock vLLM cannot load Qwen3_5ForCausalLM here: .*torchvision.*"
                                               r"Qwen3-Next"):
        VllmServer(model("Qwen3_5ForCausalLM"), batch_invariant=False).start()
    with pytest.raises(Started):
        VllmServer(model("Qwen3_5ForCausalLM"), batch_invariant=True).start()
    with pytest.raises(Started):
        VllmServer(model("Qwen3NextForCausalLM"), batch_invariant=False).start()
    have_torchvision["yes"] = True
    with pytest.raises(Started):
        VllmServer(model("Qwen3_5MoeForCausalLM"), batch_invariant=False).start()
    assert launcher.stock_unservable(str(tmp_path / "no-such-dir"), {"VLLM_BATCH_INVARIANT": "0"}) is None
