"""A failed ``vllm serve`` start names its root cause: the engine process's traceback, which vLLM prints long
before the API server's own (which only says the engine failed)."""

from vllm_bi.launcher import log_excerpt


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
