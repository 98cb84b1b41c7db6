"""Trainer checkpoints (``checkpoint.save_checkpoint`` / ``load_checkpoint``): every process writes its own shards
(torch.distributed.checkpoint), nothing is gathered on one rank, and a resumed policy holds exactly the saved
masters, bf16 parameters and AdamW state, also when a checkpoint written by 2 FSDP2 processes (gloo) is
resumed by 1. No server: the policy is stepped with made-up gradients."""
import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
from vllm_bi.launcher import free_port
from vllm_bi.trainer.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.distributed import Dist
from vllm_bi.trainer.errors import TrainerError
from vllm_bi.trainer.policy import Policy

# one script for both sides: `save N` steps a policy N times with seeded gradients and checkpoints it;
# `dump` resumes a fresh policy from the checkpoint and writes what it holds (whole tensors) to a file
SCRIPT = r"""
import sys, torch
import torch.distributed.tensor
from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
from vllm_bi.trainer.checkpoint import load_checkpoint, save_checkpoint
from vllm_bi.trainer.config import TrainerConfig
from vllm_bi.trainer.distributed import Dist
from vllm_bi.trainer.policy import Policy

model_dir, run_dir, what = sys.argv[1:4]
dist = Dist()
cfg = TrainerConfig(model=model_dir, run_dir=run_dir, lr=1e-3, grad_clip=0.0)  # no norm: its sum order varies
model = QwenGDNForCausalLM.from_pretrained(model_dir).to(dist.device)
dist.shard(model)
policy = Policy(model, cfg, dist)
if what == "save":
    g = torch.Generator().manual_seed(0)
    for _ in range(int(sys.argv[4])):
        for p in policy.params:  # the same whole gradient on every rank: this rank's shard of it, or, for
            # the replicated fp32 parameters whose gradients the ranks sum, an exact 1/world of it
            full = torch.randn(p.shape, generator=g).to(p.dtype) * 1e-2
            p.grad = (full / dist.world if type(p).__name__ != "DTensor"
                      else torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
        policy.accumulate()
        policy.step()
    save_checkpoint(run_dir, policy, 2, cfg)
else:
    step = load_checkpoint(run_dir, policy, cfg)
    full = lambda t: t.full_tensor() if type(t).__name__ == "DTensor" else t
    out = {"step": step, "masters": {n: full(m.detach()) for n, m in zip(policy.names, policy.masters)},
           "params": {n: full(p.detach()) for n, p in zip(policy.names, policy.params)},
           "optim": {n: {k: full(v) for k, v in policy.opt.state[m].items()} for n, m in zip(policy.names, policy.masters)}}
    if dist.main:
        torch.save(out, sys.argv[4])
dist.close()
"""


def _run(tmp_path, model_dir, run_dir, *args, procs=1):
    script = tmp_path / "ckpt_script.py"
    script.write_text(SCRIPT)
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
           str(free_port())] if procs > 1 else [sys.executable]
    r = subprocess.run([*pre, str(script), model_dir, str(run_dir), *map(str, args)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@pytest.fixture(scope="module")
def model_dir(tiny_model_path):
    return tiny_model_path("qwen3.5")


def test_resume_restores_masters_params_and_optimizer_exactly(model_dir, tmp_path):
    """One process: the saved policy (2 AdamW steps) and a fresh policy resumed from its checkpoint hold
    the same bits; a policy that was not resumed does not (the negative control)."""
    cfg = TrainerConfig(model=model_dir, run_dir=str(tmp_path), lr=1e-3)

    def policy():
        return Policy(QwenGDNForCausalLM.from_pretrained(model_dir), cfg, Dist())

    a = policy()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in a.params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        a.accumulate()
        a.step()
    save_checkpoint(str(tmp_path), a, 2, cfg)
    b, fresh = policy(), policy()
    assert load_checkpoint(str(tmp_path), b, cfg) == 2
    for n, ma, mb, mf, pa, pb in zip(a.names, a.masters, b.masters, fresh.masters, a.params, b.params):
        assert torch.equal(ma, mb) and torch.equal(pa, pb), n
        sa, sb = a.opt.state[ma], b.opt.state[mb]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(sa[k], sb[k]) for k in sa), n
    assert not all(torch.equal(ma, mf) for ma, mf in zip(a.masters, fresh.masters))
    # one folder of shards named by meta.json; a second save replaces it
    ck = tmp_path / "checkpoint"
    meta = json.loads((ck / "meta.json").read_text())
    assert (meta["step"], meta["optim"], meta["world_size"]) == (2, True, 1)
    assert [d for d in os.listdir(ck) if d.startswith("step")] == [meta["dir"]]
    save_checkpoint(str(tmp_path), a, 3, cfg)
    meta3 = json.loads((ck / "meta.json").read_text())
    assert [d for d in os.listdir(ck) if d.startswith("step")] == [meta3["dir"]] != [meta["dir"]]
    whole = read_checkpoint(str(tmp_path))
    assert whole["meta"]["step"] == 3 and torch.equal(whole["masters"][a.names[0]], a.masters[0])


def test_a_checkpoint_before_the_first_step_has_no_optimizer_state(model_dir, tmp_path):
    cfg = TrainerConfig(model=model_dir, run_dir=str(tmp_path))
    p = Policy(QwenGDNForCausalLM.from_pretrained(model_dir), cfg, Dist())
    save_checkpoint(str(tmp_path), p, 0, cfg)
    assert json.loads((tmp_path / "checkpoint" / "meta.json").read_text())["optim"] is False
    q = Policy(QwenGDNForCausalLM.from_pretrained(model_dir), cfg, Dist())
    assert load_checkpoint(str(tmp_path), q, cfg) == 0
    assert not q.has_optim_state()


def test_old_format_and_other_config_are_refused(model_dir, tmp_path):
    cfg = TrainerConfig(model=model_dir, run_dir=str(tmp_path))
    p = Policy(QwenGDNForCausalLM.from_pretrained(model_dir), cfg, Dist())
    save_checkpoint(str(tmp_path), p, 0, cfg)
    other = TrainerConfig(model=model_dir, run_dir=str(tmp_path), group_size=3)
    with pytest.raises(TrainerError, match="group_size=.*--resume false"):
        load_checkpoint(str(tmp_path), p, other)
    old = tmp_path / "old"
    (old / "checkpoint").mkdir(parents=True)
    (old / "checkpoint" / "state.pt").write_bytes(b"")
    with pytest.raises(TrainerError, match="older vllm_bi.*--resume false"):
        load_checkpoint(str(old), p, cfg)


def test_a_run_resumed_under_other_arithmetic_settings_is_refused(model_dir, tmp_path, monkeypatch):
    """The checkpoint records the settings' arithmetic dict (``vllm_bi.settings``); resuming with one setting changed
    is refused in one line naming it, both values and the fix; the same settings resume (control), and a checkpoint
    of an older vllm_bi without the record resumes too."""
    from vllm_bi.settings import current

    monkeypatch.delenv("VLLM_BI_GDN_MODE", raising=False)
    cfg = TrainerConfig(model=model_dir, run_dir=str(tmp_path))
    p = Policy(QwenGDNForCausalLM.from_pretrained(model_dir), cfg, Dist())
    save_checkpoint(str(tmp_path), p, 0, cfg)
    meta_path = tmp_path / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["settings"] == current().arithmetic("cpu") and meta["settings"]["gdn_mode"] == "recurrent"
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    with pytest.raises(TrainerError) as e:
        load_checkpoint(str(tmp_path), p, cfg)
    assert "\n" not in str(e.value)
    assert "gdn_mode='recurrent', this process runs 'chunk': set VLLM_BI_GDN_MODE" in str(e.value)
    assert "--resume false" in str(e.value)
    monkeypatch.delenv("VLLM_BI_GDN_MODE")
    assert load_checkpoint(str(tmp_path), p, cfg) == 0
    del meta["settings"]  # an older checkpoint: nothing to compare
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    assert load_checkpoint(str(tmp_path), p, cfg) == 0


def test_two_fsdp2_processes_save_shards_and_one_process_resumes_them(model_dir, tmp_path):
    """2 gloo processes (FSDP2) step and save their shards; 1 process and 2 processes resume them, and both
    hold the same whole tensors as a 1-process run of the same steps (FSDP2 on gloo sums the same
    gradients exactly, as tests/trainer/test_rl_loop.py shows for the logprobs)."""
    _run(tmp_path, model_dir, tmp_path / "fsdp", "save", 2, procs=2)
    _run(tmp_path, model_dir, tmp_path / "single", "save", 2)
    dumps = {}
    for name, run_dir, procs in (("fsdp->1", "fsdp", 1), ("fsdp->2", "fsdp", 2), ("single->1", "single", 1)):
        out = tmp_path / f"{name.replace('->', '_')}.pt"
        _run(tmp_path, model_dir, tmp_path / run_dir, "dump", out, procs=procs)
        dumps[name] = torch.load(out, weights_only=False)
    ref = dumps["single->1"]
    base = dict(QwenGDNForCausalLM.from_pretrained(model_dir).named_parameters())
    assert all(not torch.equal(ref["masters"][n], base[n].detach().float()) for n in ref["masters"])  # stepped
    for name, d in dumps.items():
        assert d["step"] == 2, name
        assert all(float(st["step"]) == 2.0 for st in d["optim"].values()), name  # AdamW's count, loaded
        for n in ref["masters"]:
            assert torch.equal(d["masters"][n], ref["masters"][n]), (name, n)
            assert torch.equal(d["params"][n], ref["params"][n]), (name, n)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(d["optim"][n][k], ref["optim"][n][k]), (name, n, k)
    meta = json.loads((tmp_path / "fsdp" / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == 2


def test_a_run_from_before_the_fast_cuda_default_is_refused_with_the_portable_fix(tmp_path):
    """A CUDA run checkpointed under the float64 GEMM (CUDA's default before the fast arithmetic) and resumed under
    the Triton one: refused in one line naming VLLM_BI_PRESET=portable and a fresh start; the portable settings
    resume it (control)."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.checkpoint import check_resume_settings

    old = Settings.from_env({"VLLM_BI_PRESET": "portable"}).arithmetic("cuda")
    now = Settings.from_env({"VLLM_BI_PRESET": "auto"}).arithmetic("cuda")
    with pytest.raises(TrainerError) as e:
        check_resume_settings(str(tmp_path), old, now)
    assert "\n" not in str(e.value) and "VLLM_BI_PRESET=portable" in str(e.value) and "--resume false" in str(e.value)
    check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_PRESET": "portable"}).arithmetic("cuda"))


def test_a_run_under_the_torch_logprobs_resumed_under_the_triton_ones_is_refused_with_the_fix(tmp_path):
    """A CUDA run checkpointed under the torch log-softmax and resumed under the Triton kernels (as when they become
    CUDA's default): refused in one line naming VLLM_BI_LOGPROBS=torch and a fresh start; the run's own setting
    resumes it (control)."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.checkpoint import check_resume_settings

    old = Settings.from_env({"VLLM_BI_LOGPROBS": "torch"}).arithmetic("cuda")
    now = Settings.from_env({"VLLM_BI_LOGPROBS": "triton"}).arithmetic("cuda")
    with pytest.raises(TrainerError) as e:
        check_resume_settings(str(tmp_path), old, now)
    msg = str(e.value)
    assert "\n" not in msg and "VLLM_BI_LOGPROBS=torch" in msg and "--resume false" in msg
    check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_LOGPROBS": "torch"}).arithmetic("cuda"))


def test_a_run_checkpointed_in_the_retired_hybrid_mode_is_refused_with_the_fix(tmp_path):
    """A run checkpointed under ``VLLM_BI_GDN_MODE=hybrid`` (a retired mode) and resumed now: refused in one line
    that names the retirement, the version that made it and a fresh start (not "set VLLM_BI_GDN_MODE as the run
    had it", which the settings would refuse)."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.checkpoint import check_resume_settings

    now = Settings.from_env({}).arithmetic("cpu")
    with pytest.raises(TrainerError) as e:
        check_resume_settings(str(tmp_path), dict(now, gdn_mode="hybrid"), now)
    msg = str(e.value)
    assert "\n" not in msg and "hybrid GDN mode" in msg and "retired" in msg and "--resume false" in msg
    assert "as the run had it" not in msg


def test_a_cuda_run_from_before_the_tile_setting_resumed_under_another_tile_is_refused(tmp_path):
    """A CUDA run checkpointed before ``VLLM_BI_GDN_TILE`` existed (its settings lack the key: fla-core's tile ran)
    and resumed under a tile of vllm_bi's own: refused in one line naming the setting and a fresh start; under the
    fla tile it resumes (control), and a CPU run (no tile) is not affected."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.checkpoint import check_resume_settings

    old = Settings.from_env({}).arithmetic("cuda")
    del old["gdn_tile"]
    with pytest.raises(TrainerError) as e:
        check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_GDN_TILE": "32x2x3"}).arithmetic("cuda"))
    msg = str(e.value)
    assert "\n" not in msg and "VLLM_BI_GDN_TILE" in msg and "'fla'" in msg and "--resume false" in msg
    with pytest.raises(TrainerError, match="VLLM_BI_GDN_TILE"):  # CUDA's default tile is one of vllm_bi's own
        check_resume_settings(str(tmp_path), old, Settings.from_env({}).arithmetic("cuda"))
    check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_GDN_TILE": "fla"}).arithmetic("cuda"))
    cpu_old = Settings.from_env({}).arithmetic("cpu")
    del cpu_old["gdn_tile"]
    check_resume_settings(str(tmp_path), cpu_old, Settings.from_env({}).arithmetic("cpu"))


def test_a_run_from_before_the_gates_setting_resumed_under_the_gates_kernel_is_refused(tmp_path):
    """A run checkpointed before ``VLLM_BI_GDN_GATES`` existed ran torch's gates: resumed under the Triton kernel it
    is refused in one line naming the setting; under torch's it resumes (control), on CUDA and CPU alike."""
    from vllm_bi.settings import Settings
    from vllm_bi.trainer.checkpoint import check_resume_settings

    for dev in ("cuda", "cpu"):
        old = Settings.from_env({"VLLM_BI_GDN_GATES": "torch"}).arithmetic(dev)
        del old["gdn_gates"]
        with pytest.raises(TrainerError) as e:
            check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_GDN_GATES": "triton"}).arithmetic(dev))
        assert "\n" not in str(e.value) and "VLLM_BI_GDN_GATES" in str(e.value)
        check_resume_settings(str(tmp_path), old, Settings.from_env({"VLLM_BI_GDN_GATES": "torch"}).arithmetic(dev))
    # CUDA's defaults run the kernel: a run with torch's gates resumed under them is refused
    old = Settings.from_env({"VLLM_BI_GDN_GATES": "torch"}).arithmetic("cuda")
    with pytest.raises(TrainerError, match="VLLM_BI_GDN_GATES"):
        check_resume_settings(str(tmp_path), old, Settings.from_env({}).arithmetic("cuda"))


def test_a_run_under_another_shipped_tile_table_is_refused_naming_it(tmp_path, monkeypatch):
    """A CUDA run checkpointed under one shipped GEMM tile table (the H200 table) and resumed under another (the H100
    table): refused in one line naming the run's table by its shipped name; that name resumes it (control)."""
    from vllm_bi import settings as S
    from vllm_bi.trainer.checkpoint import check_resume_settings

    old = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "h200-qwen3.5-9b"}).arithmetic("cuda")
    now = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "h100-qwen3.5-9b"}).arithmetic("cuda")
    assert old["gemm_configs"] != now["gemm_configs"]
    with pytest.raises(TrainerError) as e:
        check_resume_settings(str(tmp_path), old, now)
    msg = str(e.value)
    assert "\n" not in msg and "VLLM_BI_GEMM_CONFIGS=h200-qwen3.5-9b" in msg and "--resume false" in msg
    check_resume_settings(str(tmp_path), old,
                          S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "h200-qwen3.5-9b"}).arithmetic("cuda"))
    unknown = dict(old, gemm_configs="0123456789abcdef")  # a table that is not shipped: the generic fix
    with pytest.raises(TrainerError, match="as the run had it"):
        check_resume_settings(str(tmp_path), unknown, now)


def test_micro_batch_gradients_accumulate_in_place_in_fp32(model_dir, tmp_path):
    """``Policy.accumulate``: the masters' fp32 gradients are the sum of the micro-batches' bf16 gradients, each
    taken to fp32 (equal to ``float(g1) + float(g2)`` bit for bit), and after the first micro-batch they are added
    in place (the same storage: no fp32 copy of a 248K-vocabulary gradient per micro-batch)."""
    policy = Policy(QwenGDNForCausalLM.from_pretrained(model_dir), TrainerConfig(model=model_dir,
                                                                                 run_dir=str(tmp_path)), Dist())
    g = torch.Generator().manual_seed(0)
    grads = [[(torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype) for p in policy.params] for _ in range(3)]
    storage = None
    for mb in grads:
        for p, gp in zip(policy.params, mb):
            p.grad = gp.clone()
        policy.accumulate()
        assert all(p.grad is None for p in policy.params)
        now = [m.grad.data_ptr() for m in policy.masters]
        assert storage is None or now == storage
        storage = now
    for i, m in enumerate(policy.masters):
        want = grads[0][i].float() + grads[1][i].float() + grads[2][i].float()
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, want), policy.names[i]
