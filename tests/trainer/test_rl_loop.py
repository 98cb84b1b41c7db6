"""The RL loop against a real BI ``vllm serve`` (CPU, small Qwen3-Next).

One server for the module (dev mode, for the weight-swap routes); each run pushes its own
initial weights first, so runs do not see each other's updates.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
from vllm_bi.launcher import VllmServer, cpu_env, free_port
from vllm_bi.trainer import policy as policy_mod
from vllm_bi.trainer import sync as sync_mod
from vllm_bi.trainer.checkpoint import read_checkpoint
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.errors import TrainerError
from vllm_bi.trainer.loop import train
from vllm_bi.trainer.metrics import read_metrics
from vllm_bi.weights import weight_digest

pytestmark = pytest.mark.server

SMALL = dict(prompts_per_step=4, group_size=4, max_tokens=8, lr=5e-3, progress=False, tensorboard=False)


def test_plot_needs_a_run_dir(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vllm_bi.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr


@pytest.fixture(scope="module")
def model_dir(tiny_model_path):
    return tiny_model_path("qwen3-next")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    log = str(tmp_path_factory.mktemp("srv") / "server.log")
    with VllmServer(model_dir, env=env, args=["--max-num-batched-tokens", "128", "--max-num-seqs", "16"],
                    log_path=log) as srv:
        yield srv


def cfg(server, model_dir, run_dir, **kw):
    return TrainerConfig(model=model_dir, server_url=server.url, run_dir=str(run_dir), **(SMALL | kw))


def test_on_policy_logprob_diff_is_exactly_zero_every_step(server, model_dir, tmp_path):
    rows = train(cfg(server, model_dir, tmp_path, steps=10, max_staleness=0, tensorboard=True))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    assert [r["step"] for r in rows] == list(range(10))
    assert all(r["staleness"] == 0 for r in rows)
    for r in rows:  # exact equality, every token of every step
        assert r["bit_wise/logprob_diff/max"] == 0.0, r
        assert r["bit_wise/frac_tokens_different"] == 0.0, r
        assert r["tokens/completion"] > 0
        assert "memory/peak_allocated_gib" not in r  # GPU memory: written by CUDA trainers only
    assert read_metrics(str(tmp_path)) == json.loads(json.dumps(rows))
    # one settings dict: the server's (vllm_bi_info), the run's first metrics row and its checkpoint agree
    info = server.collective_rpc("vllm_bi_info")[0]
    first = rows[0]["settings"]
    assert first == {k: info[k] for k in first} and "settings" not in rows[1]
    assert "gemm_table" not in info  # a tuned table's text travels under VLLM_BI_GEMM_CONFIGS=tune on CUDA only
    assert json.load(open(tmp_path / "checkpoint" / "meta.json"))["settings"] == first
    r = subprocess.run([sys.executable, "-m", "vllm_bi.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name in ("reward.png", "logprob_diff.png", "throughput.png"):
        with open(tmp_path / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert server.weight_version() == "10"
    # the server holds what the trainer trained: the final checkpoint's bf16 weights
    final = QwenGDNForCausalLM.from_pretrained(str(tmp_path / "weights" / "v000010"))
    assert server.weight_digest() == weight_digest(final.hf_state_dict().items())
    assert server.weight_digest() != weight_digest(QwenGDNForCausalLM.from_pretrained(model_dir).hf_state_dict().items())


def test_the_pushed_weight_copies_are_gone_before_each_update(server, model_dir, tmp_path, monkeypatch):
    """The op library's model gives its weights for a push as copies (2 bytes a parameter): no push's copy may still
    be alive when the optimizer updates the weights (held through the run, the initial push's copy put 4.6 GiB on a
    2.5 B-parameter trainer's first AdamW update). Checked by weak references, without a garbage collection."""
    import weakref

    copies, alive = [], []
    own_state_dict, own_step = QwenGDNForCausalLM.hf_state_dict, policy_mod.Policy.step

    def tracked(self):
        out = own_state_dict(self)
        copies.append([weakref.ref(t) for t in out.values()])
        return out

    def step(self):
        alive.append(sum(ref() is not None for refs in copies for ref in refs))
        return own_step(self)

    monkeypatch.setattr(QwenGDNForCausalLM, "hf_state_dict", tracked)
    monkeypatch.setattr(policy_mod.Policy, "step", step)
    rows = train(cfg(server, model_dir, tmp_path, steps=2, prompts_per_step=2, group_size=2, max_tokens=4))
    assert len(rows) == 2 and len(copies) >= 2 and alive == [0, 0], (len(copies), alive)


def test_stock_baseline_runs_the_same_loop_with_a_nonzero_gap(server, model_dir, tmp_path):
    """``--arithmetic stock`` (transformers' own model, vllm_bi's checks off) through the same loop, here against the
    module's server: every step's time split into its parts, the pushed weights the ones the server then holds
    (its digest equals the last saved checkpoint's), and the gap not zero (the control: other arithmetic)."""
    rows = train(cfg(server, model_dir, tmp_path, steps=2, arithmetic="stock", prompts_per_step=2, group_size=2,
                     max_tokens=4))
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["time/forward_backward_s"] > 0 and r["time/optimizer_s"] > 0 and r["time/generate_s"] > 0
        assert r["time/train_s"] == pytest.approx(r["time/forward_backward_s"] + r["time/optimizer_s"])
    assert max(r["bit_wise/logprob_diff/max"] for r in rows) > 0
    assert server.weight_version() == "2"
    final = QwenGDNForCausalLM.from_pretrained(str(tmp_path / "weights" / "v000002"))
    assert server.weight_digest() == weight_digest(final.hf_state_dict().items())


def test_async_gap_is_staleness_only(server, model_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        rows = train(cfg(server, model_dir, tmp_path, steps=5, max_staleness=1, recompute_at_sample_version=True))
    # without a progress bar each step is logged with its time split
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split(":")[0] for m in steps] == [f"step {i}/5" for i in range(1, 6)], steps
    assert all("train " in m and "weight push " in m for m in steps), steps
    assert rows[0]["staleness"] == 0 and rows[0]["bit_wise/logprob_diff/max"] == 0.0
    stale = [r for r in rows if r["staleness"] == 1]
    assert stale, "the rollout thread never ran ahead"
    assert all(r["staleness"] <= 1 for r in rows)
    assert all(r["bit_wise/logprob_diff/max"] > 0.0 for r in stale), "stale batches must show a gap"
    # ... and the gap is staleness only: under the weights each batch was sampled with, exactly 0
    assert all(r["bit_wise/logprob_diff_at_sample_version/max"] == 0.0 for r in rows), rows


def _trainer_cmd(server, model_dir, run_dir, steps):
    return [sys.executable, "-m", "vllm_bi.trainer", "--server-url", server.url, "--model", model_dir,
            "--run-dir", str(run_dir), "--steps", str(steps), "--prompts-per-step", "4", "--group-size", "4",
            "--max-tokens", "8", "--progress", "false", "--tensorboard", "false"]


def _wait_for_checkpoint(run_dir, step, proc, timeout=300):
    meta = os.path.join(run_dir, "checkpoint", "meta.json")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early: {proc.communicate()}")
        if os.path.exists(meta):
            with open(meta) as f:
                if json.load(f)["step"] >= step:
                    return
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def test_kill_and_resume_loses_no_step_and_repeats_none(server, model_dir, tmp_path):
    proc = subprocess.Popen(_trainer_cmd(server, model_dir, tmp_path, 6), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_checkpoint(tmp_path, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.load(open(tmp_path / "checkpoint" / "meta.json"))["step"]
    assert 2 <= killed_at < 6
    r = subprocess.run(_trainer_cmd(server, model_dir, tmp_path, 6), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming at step {killed_at}/6" in r.stdout
    steps = [m["step"] for m in read_metrics(str(tmp_path))]
    assert steps == list(range(6))
    meta = json.load(open(tmp_path / "checkpoint" / "meta.json"))
    assert (meta["step"], meta["data_position"]) == (6, 24)
    assert all(m["bit_wise/logprob_diff/max"] == 0.0 for m in read_metrics(str(tmp_path)))
    # data positions continue across the kill: each step consumed the next 4 prompts
    assert [m["data_position"] for m in read_metrics(str(tmp_path))] == [4 * (s + 1) for s in range(6)]


def test_fsdp2_two_processes_keep_exact_parity_and_resume(server, model_dir, tmp_path):
    """torchrun, 2 CPU processes (gloo), FSDP2-sharded trainer: still exactly 0 at every step; a resumed
    sharded run reloads its shards."""
    def run(steps):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "vllm_bi.trainer", *_trainer_cmd(server, model_dir, tmp_path, steps)[3:]]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return r

    run(3)
    r = run(4)
    assert "resuming at step 3/4" in r.stdout
    rows = read_metrics(str(tmp_path))
    assert [m["step"] for m in rows] == [0, 1, 2, 3]
    assert all(m["trainer/world_size"] == 2 for m in rows)
    assert all(m["bit_wise/logprob_diff/max"] == 0.0 and m["bit_wise/frac_tokens_different"] == 0.0 for m in rows)
    final = QwenGDNForCausalLM.from_pretrained(str(tmp_path / "weights" / "v000004"))
    assert server.weight_digest() == weight_digest(final.hf_state_dict().items())


def test_weight_mismatch_refuses_and_resumes(server, model_dir, tmp_path, monkeypatch):
    orig = sync_mod.WeightSync.save

    def corrupt_from_v2(self, model, version, state=None):
        path = orig(self, model, version, state)
        if version >= 2:  # a transfer that silently lost one value
            from safetensors.torch import load_file, save_file

            f = os.path.join(path, "model.safetensors")
            t = load_file(f)
            t["model.layers.1.mlp.experts.0.down_proj.weight"][0, 0] += 1.0
            save_file(t, f, metadata={"format": "pt"})
        return path

    monkeypatch.setattr(sync_mod.WeightSync, "save", corrupt_from_v2)
    with pytest.raises(TrainerError, match=r"(?s)version 2.*differ.*layer001.*Refusing.*continue from step 1"):
        train(cfg(server, model_dir, tmp_path, steps=4))
    monkeypatch.setattr(sync_mod.WeightSync, "save", orig)
    rows = train(cfg(server, model_dir, tmp_path, steps=4))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [m["step"] for m in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    assert all(r["bit_wise/logprob_diff/max"] == 0.0 for r in rows)


class _FailAfter:
    """The server's client, except that the call of ``method`` number ``n`` raises after it reached the server."""

    def __init__(self, client, method, n):
        self._c, self._m, self._n = client, method, n

    def __getattr__(self, name):
        real = getattr(self._c, name)
        if name != self._m:
            return real

        def call(*a, **k):
            out = real(*a, **k)
            self._n -= 1
            if self._n == 0:
                from vllm_bi.client import ServerError

                raise ServerError(f"injected: the connection dropped after {name}")
            return out

        return call


def test_a_push_failing_after_any_step_leaves_one_consistent_version(server, model_dir, tmp_path):
    """Against the real server: version 1 pushed, then version 2 fails after each step of the swap in turn; the
    server ends on version 1 every time (its label, its weights' digest, serving, not paused)."""
    from vllm_bi.client import VllmClient

    model = QwenGDNForCausalLM.from_pretrained(model_dir)
    good = model.hf_state_dict()
    bad = {k: (v + 0.01 if k.endswith("norm.weight") else v) for k, v in good.items()}
    sync = sync_mod.WeightSync(server, str(tmp_path), model_dir, keep=2)
    sync.push(model, 1, good)
    # (method, which call of it): pause, the label, reload, the cache reset, the version, resume
    for method, n in (("pause", 1), ("set_weight_version", 1), ("reload_weights", 1), ("reset_prefix_cache", 1),
                      ("set_weight_version", 2), ("resume", 1)):
        sync.client = _FailAfter(server, method, n)
        with pytest.raises(sync_mod.PushFailed, match="back on version 1"):
            sync.push(model, 2, bad)
        assert server.weight_version() == "1", method
        assert server.weight_digest() == weight_digest(good.items()), method
        assert len(VllmClient(server.url, model_dir).complete([3, 4, 5], max_tokens=2).token_ids) == 2, method
    sync.client = server
    sync.push(model, 3, bad)  # and a good push afterwards lands
    assert server.weight_version() == "3" and server.weight_digest() == weight_digest(bad.items())


def test_a_trainer_of_another_model_is_refused_before_its_first_push(server, tiny_model_path, tmp_path):
    other = tiny_model_path("qwen3.5")  # the server serves the qwen3-next model
    before = server.weight_digest()
    with pytest.raises(TrainerError, match=r"serves \['Qwen3NextForCausalLM'\].*start the server with the trainer's"):
        train(cfg(server, other, tmp_path, steps=1))
    assert server.weight_digest() == before and len(server.complete([3, 4], max_tokens=2).token_ids) == 2


def test_nan_loss_stops_cleanly_with_a_resumable_checkpoint(server, model_dir, tmp_path, monkeypatch):
    orig = policy_mod.clipped_surrogate
    calls = {"n": 0}

    def nan_on_third_micro_batch(*a, **k):
        calls["n"] += 1
        loss, st = orig(*a, **k)
        return (loss * float("nan") if calls["n"] == 3 else loss), st

    monkeypatch.setattr(policy_mod, "clipped_surrogate", nan_on_third_micro_batch)
    c = cfg(server, model_dir, tmp_path, steps=4, micro_batch_seqs=8)  # 2 micro-batches per step
    with pytest.raises(TrainerError, match=r"loss is nan.*not applied.*continue from step 1"):
        train(c)
    state = read_checkpoint(str(tmp_path))
    assert state["meta"]["step"] == 1
    assert all(torch.isfinite(t).all() for t in state["masters"].values())


def test_server_unreachable_ends_with_clear_error_and_checkpoint(model_dir, tmp_path):
    """The trainer starts its own server here; we kill that server mid-run."""
    cmd = [sys.executable, "-m", "vllm_bi.trainer", "--model", model_dir, "--run-dir", str(tmp_path),
           "--steps", "50", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
           "--progress", "false", "--tensorboard", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_checkpoint(tmp_path, 1, proc, timeout=400)
    os.killpg(int(open(tmp_path / "server.pid").read()), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]  # server or environment
    last = err.strip().splitlines()[-1]
    # the kill lands while the trainer samples ("error: vLLM server at ... unreachable") or while it pushes weights
    # ("error: weight push of version N failed at '<stage>' (vLLM server at ... unreachable ...)"): both name it
    assert last.startswith("error: ") and "vLLM server at http://127.0.0.1:" in last and "unreachable" in last, last
    assert last.replace(str(tmp_path), "").count("unreachable") == 1, last  # said once, not once per failed call
    assert "rerun the same command to continue from step" in last
    meta = json.load(open(tmp_path / "checkpoint" / "meta.json"))
    assert meta["step"] >= 1 and f"from step {meta['step']}" in last


def test_killed_trainer_takes_its_server_with_it(model_dir, tmp_path):
    """kill -9 of a trainer that started its own server: no process of that server (API server, engine core,
    worker) is left after 30 s."""
    from procs import alive, descendants

    cmd = [sys.executable, "-m", "vllm_bi.trainer", "--model", model_dir, "--run-dir", str(tmp_path),
           "--steps", "50", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
           "--progress", "false", "--tensorboard", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file, tree, deadline = tmp_path / "server.pid", set(), time.time() + 400
    while time.time() < deadline and len(tree) < 2:  # the API server and its engine core
        assert proc.poll() is None, "the trainer exited early"
        if pid_file.exists():
            api = int(pid_file.read_text())
            tree = {api} | descendants(api)
        time.sleep(0.5)
    assert len(tree) >= 2, "the trainer's server did not come up"
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in tree):
        time.sleep(0.5)
    assert [p for p in tree if alive(p)] == [], "processes of the killed trainer's server still running after 30 s"


def test_moe_model_weight_sync_keeps_parity(tiny_model_path, tmp_path):
    """Qwen3.5-MoE: the server stacks the experts (w13/w2), the trainer holds them per expert in HF
    names; after each push the layout-independent digest must match and the diff stay exactly 0.
    The trainer starts its own server here."""
    c = TrainerConfig(model=tiny_model_path("qwen3.5-moe"), run_dir=str(tmp_path), steps=3, **SMALL)
    rows = train(c)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["bit_wise/logprob_diff/max"] == 0.0 for r in rows)
    assert rows[-1]["grad_norm"] > 0.0
