"""Every user mistake is one line on stderr naming the problem and the fix, with the exit status of its kind
(``vllm_bi.errors``: 2 usage, 3 server or environment, 130 Ctrl-C), and no traceback; each runs in a subprocess
and fails before a server would start (none is needed). A bug keeps its traceback."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from vllm_bi.errors import ENVIRONMENT, INTERRUPTED, USAGE

CLI = [sys.executable, "-m", "vllm_bi.cli"]
TRAINER = [sys.executable, "-m", "vllm_bi.trainer"]
GDN_CONFIG = '{"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}'


def _env(extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BI_")}
    return dict(env, **(extra or {}))


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def inputs(tmp_path):
    """The files the cases name: model directories (valid, corrupt, another architecture), run directories,
    prompt files, an output directory holding another model; and a closed port's URL."""

    def write(rel, text):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("gdn/config.json", GDN_CONFIG)
    write("corrupt/config.json", '{"architectures": ["Qwen3Next')
    write("llama/config.json", '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    write("kimi/config.json", '{"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear"}')
    write("noconfig/weights.txt", "")
    write("other/notes.txt", "not a model")
    write("run/metrics.jsonl", '{"step": 0, "reward/mean": 0.5}\n{"step": 1, "rew\n')
    (tmp_path / "emptyrun").mkdir()
    write("garbage.jsonl", '{"prompt": "one"}\nnot json\n')
    write("blank.jsonl", "\n\n")
    write("emptyprompt.jsonl", '{"prompt": "one"}\n{"prompt": "  "}\n')
    write("taken/vllm_bi_tiny.json", '{"family": "qwen3.5", "seed": 99, "spec": {}}')
    return {"tmp": str(tmp_path), "closed": f"http://127.0.0.1:{_closed_port()}"}


# id, argv (formatted with the `inputs` fixture), extra environment, exit status, the line (a regex, searched)
CASES = [
    ("parity-unreachable-server", CLI + ["parity", "--model", "{tmp}/gdn", "--server", "{closed}"], {}, ENVIRONMENT,
     r"^vllm-bi parity: error: vLLM server at http://127\.0\.0\.1:\d+ unreachable .*Connection refused.*; check that a "
     r"server runs at --server http://127\.0\.0\.1:\d+"),
    ("parity-corrupt-config", CLI + ["parity", "--model", "{tmp}/corrupt"], {}, USAGE,
     r"^vllm-bi parity: error: \S+/corrupt/config\.json: not valid JSON \(line 1, column \d+.*restore the checkpoint's "
     r"config\.json$"),
    ("parity-no-model-dir", CLI + ["parity", "--model", "{tmp}/nope"], {}, USAGE,
     r"^vllm-bi parity: error: --model \S+/nope: no such directory; give a local Hugging Face checkpoint directory"),
    ("parity-no-config-json", CLI + ["parity", "--model", "{tmp}/noconfig"], {}, USAGE,
     r"--model \S+/noconfig: no config\.json in it; give the directory of a Hugging Face checkpoint"),
    ("parity-not-a-gdn-model", CLI + ["parity", "--model", "{tmp}/llama"], {}, USAGE,
     r"--model \S+/llama: architecture LlamaForCausalLM is not a GDN hybrid vllm_bi supports; give a checkpoint of "
     r"Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, KimiLinearForCausalLM$"),
    ("parity-trainer-model-not-gdn", CLI + ["parity", "--model", "{tmp}/gdn", "--trainer-model", "{tmp}/llama"], {},
     USAGE, r"--trainer-model \S+/llama: architecture LlamaForCausalLM is not a GDN hybrid"),
    ("parity-n-0", CLI + ["parity", "--model", "{tmp}/gdn", "--n", "0"], {}, USAGE,
     r"^vllm-bi parity: error: argument --n: must be >= 1, got 0 \(see vllm-bi parity --help\)$"),
    ("parity-max-tokens-0", CLI + ["parity", "--model", "{tmp}/gdn", "--max-tokens", "0"], {}, USAGE,
     r"argument --max-tokens: must be >= 1, got 0"),
    ("parity-max-tokens-not-int", CLI + ["parity", "--model", "{tmp}/gdn", "--max-tokens", "4.5"], {}, USAGE,
     r"argument --max-tokens: '4\.5' is not an integer"),
    ("parity-negative-temperature", CLI + ["parity", "--model", "{tmp}/gdn", "--temperature", "-1"], {}, USAGE,
     r"argument --temperature: must be a finite number >= 0, got -1"),
    ("parity-batched-tokens-0", CLI + ["parity", "--model", "{tmp}/gdn", "--max-num-batched-tokens", "0"], {}, USAGE,
     r"argument --max-num-batched-tokens: must be >= 1, got 0"),
    ("parity-server-not-a-url", CLI + ["parity", "--model", "{tmp}/gdn", "--server", "localhost:8000"], {}, USAGE,
     r"argument --server: 'localhost:8000' is not a server URL; give one like http://127\.0\.0\.1:8000"),
    ("parity-server-args-unbalanced", CLI + ["parity", "--model", "{tmp}/gdn", "--server-args", '"--x'], {}, USAGE,
     r"argument --server-args: .* cannot be split like a shell line \(No closing quotation\)"),
    ("parity-prompts-bad-line", CLI + ["parity", "--model", "{tmp}/gdn", "--prompts", "{tmp}/garbage.jsonl"], {}, USAGE,
     r"error: \S+/garbage\.jsonl:2: not JSON .*expected one \{\"prompt\": \.\.\.\} per line$"),
    ("parity-prompts-none", CLI + ["parity", "--model", "{tmp}/gdn", "--prompts", "{tmp}/blank.jsonl"], {}, USAGE,
     r"error: \S+/blank\.jsonl: no examples; give one \{\"prompt\": \.\.\.\} per line$"),
    ("parity-prompt-empty", CLI + ["parity", "--model", "{tmp}/gdn", "--prompts", "{tmp}/emptyprompt.jsonl"], {},
     USAGE, r"error: \S+/emptyprompt\.jsonl:2: the prompt is empty; give each line some text"),
    ("parity-prompts-missing", CLI + ["parity", "--model", "{tmp}/gdn", "--prompts", "{tmp}/none.jsonl"], {}, USAGE,
     r"error: --prompts \S+/none\.jsonl: no such file; give a JSONL file"),
    ("parity-bad-setting", CLI + ["parity", "--model", "{tmp}/gdn"], {"VLLM_BI_GDN_MODE": "fast"}, USAGE,
     r"^vllm-bi parity: error: VLLM_BI_GDN_MODE='fast' is not a setting; use one of auto, recurrent, chunk"),
    ("parity-no-model-flag", CLI + ["parity"], {}, USAGE,
     r"^vllm-bi parity: error: the following arguments are required: --model \(see vllm-bi parity --help\)$"),
    ("unknown-command", CLI + ["pairty"], {}, USAGE, r"^vllm-bi: error: argument cmd: invalid choice: 'pairty'"),
    ("diag-no-model-dir", CLI + ["diag", "--model", "/nonexistent"], {}, USAGE,
     r"^vllm-bi diag: error: --model /nonexistent: no such directory"),
    ("diag-corrupt-config", CLI + ["diag", "--model", "{tmp}/corrupt"], {}, USAGE,
     r"^vllm-bi diag: error: \S+/corrupt/config\.json: not valid JSON"),
    ("diag-prompt-len-0", CLI + ["diag", "--model", "{tmp}/gdn", "--prompt-len", "0"], {}, USAGE,
     r"argument --prompt-len: must be between 1 and 511, got 0"),
    ("demo-no-model-dir", CLI + ["demo", "--model", "/nonexistent"], {}, USAGE,
     r"^vllm-bi demo: error: --model /nonexistent: no such directory"),
    ("demo-kimi-linear", CLI + ["demo", "--model", "{tmp}/kimi"], {}, USAGE,
     r"^vllm-bi demo: error: --model \S+/kimi: vllm-bi demo does not run KimiLinearForCausalLM yet \(`vllm serve`, "
     r"`vllm-bi parity` and the RL trainer do\); give a checkpoint of Qwen3NextForCausalLM"),
    ("parity-kimi-linear-hf", CLI + ["parity", "--model", "{tmp}/kimi", "--trainer", "hf"], {}, USAGE,
     r"--trainer hf: transformers has no KimiLinearForCausalLM class .*; use --trainer vllm_bi$"),
    ("demo-not-a-gdn-model", CLI + ["demo", "--model", "{tmp}/llama"], {}, USAGE,
     r"^vllm-bi demo: error: --model \S+/llama: architecture LlamaForCausalLM is not a GDN hybrid"),
    ("demo-busy-0", CLI + ["demo", "--busy", "0"], {}, USAGE, r"argument --busy: must be between 1 and 64, got 0"),
    ("plot-garbage-line", CLI + ["plot", "{tmp}/run"], {}, USAGE,
     r"^vllm-bi plot: error: \S+/run/metrics\.jsonl:2: not a JSON line .*; delete or repair that line"),
    ("plot-no-metrics", CLI + ["plot", "{tmp}/emptyrun"], {}, USAGE,
     r"^vllm-bi plot: error: \S+/emptyrun: no metrics\.jsonl with any step"),
    ("plot-no-run-dir", CLI + ["plot", "{tmp}/norun"], {}, USAGE,
     r"^vllm-bi plot: error: \S+/norun: no such directory; give a trainer run directory"),
    ("make-model-taken", CLI + ["make-model", "qwen3-next", "{tmp}/taken"], {}, USAGE,
     r"^vllm-bi make-model: error: \S+/taken holds a different tiny model; pass --overwrite to replace it, or give "
     r"another directory$"),
    ("make-model-not-a-model-dir", CLI + ["make-model", "qwen3-next", "{tmp}/other"], {}, USAGE,
     r"^vllm-bi make-model: error: \S+/other exists and holds no tiny model; pass --overwrite to replace it"),
    ("make-checkpoint-entropy-0", CLI + ["make-checkpoint", "qwen3.5-9b", "{tmp}/ck", "--entropy", "0"], {}, USAGE,
     r"argument --entropy: must be a finite number > 0, got 0"),
    ("trainer-corrupt-config", TRAINER + ["--model", "{tmp}/corrupt", "--run-dir", "{tmp}/r"], {}, USAGE,
     r"^error: \S+/corrupt/config\.json: not valid JSON .*restore the checkpoint's config\.json$"),
    ("trainer-kimi-linear-stock", TRAINER + ["--model", "{tmp}/kimi", "--arithmetic", "stock", "--run-dir",
                                              "{tmp}/r"], {}, USAGE,
     r"^error: --arithmetic: stock runs transformers' model, which has no KimiLinearForCausalLM class"),
    ("trainer-not-a-gdn-model", TRAINER + ["--model", "{tmp}/llama", "--run-dir", "{tmp}/r"], {}, USAGE,
     r"^error: --model \S+/llama: architecture LlamaForCausalLM is not a GDN hybrid"),
    ("trainer-server-down", TRAINER + ["--model", "{tmp}/gdn", "--server-url", "{closed}", "--run-dir", "{tmp}/r"],
     {}, ENVIRONMENT,
     r"^error: no healthy vLLM server answers at --server-url http://127\.0\.0\.1:\d+ \(GET /health\); start it "
     r"\(VLLM_BATCH_INVARIANT=1 VLLM_SERVER_DEV_MODE=1 vllm serve \S+/gdn\) or fix the URL, or leave --server-url "
     r"empty to let the trainer start one\. Nothing was run\.$"),
    ("trainer-server-not-a-url", TRAINER + ["--model", "{tmp}/gdn", "--server-url", "127.0.0.1:8000"], {}, USAGE,
     r"^error: --server-url: '127\.0\.0\.1:8000' is not a server URL"),
    ("trainer-steps-0", TRAINER + ["--steps", "0"], {}, USAGE, r"^error: --steps: must be >= 1, got 0$"),
    ("trainer-unknown-option", TRAINER + ["--stepz", "3"], {}, USAGE,
     r"^python -m vllm_bi\.trainer: error: unrecognized arguments: --stepz 3 "
     r"\(see python -m vllm_bi\.trainer --help\)$"),
    ("trainer-task-missing", TRAINER + ["--model", "{tmp}/gdn", "--task", "{tmp}/none.jsonl", "--server-url",
                                        "{closed}"], {}, USAGE,
     r"^error: --task '\S+/none\.jsonl': no such file; give a JSONL file or a built-in task"),
    ("trainer-bad-setting", TRAINER + ["--steps", "1"], {"VLLM_BI_GEMM": "fast"}, USAGE,
     r"^error: VLLM_BI_GEMM='fast' is not a setting; use one of"),
]


@pytest.mark.parametrize("argv, env, code, line", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_with_its_exit_status(inputs, argv, env, code, line):
    argv = [a.format(**inputs) for a in argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env(env), cwd=inputs["tmp"])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert "Traceback" not in r.stdout + r.stderr
    assert re.search(line, lines[0]), lines[0]


def test_the_make_model_refusal_speaks_the_flag_and_leaves_the_directory(inputs):
    """The command line names --overwrite, not the Python parameter; the directory it refused is untouched."""
    taken = os.path.join(inputs["tmp"], "taken")
    r = subprocess.run(CLI + ["make-model", "qwen3-next", taken], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == USAGE and "overwrite=True" not in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert os.listdir(taken) == ["vllm_bi_tiny.json"]
    assert not [n for n in os.listdir(inputs["tmp"]) if n.startswith("taken.building")]


def _silent_server():
    """A socket that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(60)
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("argv, line", [
    (CLI + ["parity", "--model", "{tmp}/gdn", "--server", "{url}"], "vllm-bi parity: interrupted"),
    (TRAINER + ["--model", "{tmp}/gdn", "--run-dir", "{tmp}/r", "--server-url", "{url}"], "interrupted"),
], ids=["parity", "trainer"])
def test_ctrl_c_is_one_line_and_status_130(inputs, argv, line):
    """SIGINT while the command waits for a server that accepted the connection but does not answer."""
    srv, url = _silent_server()
    with srv:
        # SIGINT as a terminal delivers it: a shell's background job (CI's shards) inherits it ignored, and Python
        # then installs no KeyboardInterrupt handler
        p = subprocess.Popen([a.format(url=url, **inputs) for a in argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            conn, _ = srv.accept()  # the command is now blocked reading the reply
            time.sleep(0.2)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=60)
            conn.close()
        finally:
            if p.poll() is None:
                p.kill()
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == INTERRUPTED and lines == [line], (p.returncode, out, err)


def test_a_fresh_run_that_loses_its_server_says_it_starts_from_step_0(tiny_model_path, tmp_path):
    """A run that never wrote a checkpoint has nothing to continue from: the error says a rerun starts at step 0
    and what to do about the server, status 3."""
    from vllm_bi.trainer.config import TrainerConfig
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.loop import train

    url = f"http://127.0.0.1:{_closed_port()}"
    cfg = TrainerConfig(model=tiny_model_path("qwen3-next"), server_url=url, run_dir=str(tmp_path), steps=1,
                        prompts_per_step=2, group_size=2, progress=False, tensorboard=False)
    with pytest.raises(TrainerError) as e:
        train(cfg, log=lambda *a, **k: None)
    msg = str(e.value)
    assert e.value.exit_code == ENVIRONMENT and "\n" not in msg
    assert f"vLLM server at {url} unreachable" in msg and "fix --server-url" in msg
    assert "No checkpoint was written: rerunning the same command starts the run from step 0." in msg
    assert "step -1" not in msg and "continue from" not in msg


def test_every_help_lists_the_exit_statuses():
    """Each command's --help ends with its exit statuses, in the shared meanings."""
    for argv in ([], ["demo"], ["parity"], ["diag"], ["make-model"], ["make-checkpoint"], ["plot"], ["info"]):
        r = subprocess.run(CLI + argv + ["--help"], capture_output=True, text=True, timeout=60, env=_env())
        text = " ".join(r.stdout.split())
        assert r.returncode == 0 and "Exit status: 0 " in text, (argv, r.stdout)
        assert "; 2 usage error (" in text and "; 130 interrupted (Ctrl-C)" in text, (argv, text)
    r = subprocess.run(CLI + ["parity", "--help"], capture_output=True, text=True, timeout=60, env=_env())
    text = " ".join(r.stdout.split())
    for status in ("0 every token bitwise equal", "1 some differ", "2 usage error", "3 server or environment error",
                   "4 the server's vllm_bi settings differ"):
        assert status in text, text
    r = subprocess.run(TRAINER + ["--help"], capture_output=True, text=True, timeout=60, env=_env())
    text = " ".join(r.stdout.split())
    for status in ("0 the run reached --steps", "1 a check of the run's own numbers failed", "2 usage error",
                   "3 server or environment error", "4 the vllm_bi settings that decide the bits differ"):
        assert status in text, text


def test_a_bug_keeps_its_traceback_and_a_user_error_does_not(capsys):
    """run_command turns only known errors into a line: an unexpected exception propagates unchanged."""
    from vllm_bi.errors import UsageError, run_command

    def bug():
        raise KeyError("internal")

    with pytest.raises(KeyError, match="internal"):
        run_command("prog", bug)
    with pytest.raises(RuntimeError, match="not known"):
        run_command("prog", lambda: (_ for _ in ()).throw(RuntimeError("not known")), lambda e: None)

    def mistake():
        raise UsageError("--x: bad\n  fix: use y")

    assert run_command("prog", mistake) == USAGE
    assert capsys.readouterr().err == "prog: error: --x: bad fix: use y\n"
