"""Trainer configuration, data, rewards and loss (no server)."""

import math
import subprocess
import sys

import pytest
import torch

from vllm_bi.trainer.config import FIELDS, ConfigError, load_recipe, parse_args
from vllm_bi.trainer.data import make_source
from vllm_bi.trainer.loss import clipped_surrogate, group_advantages
from vllm_bi.trainer.rewards import checked_reward, get_reward

REPO = __file__.rsplit("/tests/", 1)[0]


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "vllm_bi.trainer", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name, f in FIELDS.items():
        if f.metadata.get("flag") is not False:
            assert "--" + name.replace("_", "-") in out, name
    assert "--settings" not in out  # vllm_bi's settings come from a recipe's [settings] or the environment


@pytest.mark.parametrize("recipe", ["digits.toml", "digits_async.toml", "jsonl_contains.toml", "tool_digits.toml"])
def test_recipes_parse(recipe):
    values = load_recipe(f"{REPO}/trainer/{recipe}")
    assert values["steps"] >= 1


def test_precedence_and_errors(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('steps = 7\n[algorithm]\nalgo = "grpo"\n')
    cfg = parse_args(["--config", str(recipe), "--group-size", "3"])
    assert (cfg.steps, cfg.algo, cfg.group_size, cfg.clip_high) == (7, "grpo", 3, cfg.clip_low)
    assert parse_args(["--config", str(recipe), "--steps", "9"]).steps == 9
    recipe.write_text("stepz = 7\n")
    with pytest.raises(ConfigError, match="unknown option 'stepz'.*'steps'"):
        parse_args(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="--group-size: GRPO needs at least 2"):
        parse_args(["--group-size", "1"])
    with pytest.raises(ConfigError, match="not a valid int"):
        parse_args(["--steps", "ten"])
    with pytest.raises(ConfigError, match="--model: with --server-url"):
        parse_args(["--server-url", "http://x"])
    assert parse_args(["--save-every", "0"]).save_every == 0
    with pytest.raises(ConfigError, match="--save-every: must be >= 0"):
        parse_args(["--save-every", "-1"])
    r = subprocess.run([sys.executable, "-m", "vllm_bi.trainer", "--max-staleness", "-1"], capture_output=True, text=True)
    assert r.returncode == 2 and "--max-staleness: must be >= 0" in r.stderr


def test_sources_are_positional(tmp_path):
    s = make_source("digits", 3)
    assert s.batch(5, 3) == [s.example(5), s.example(6), s.example(7)]
    assert s.example(5) != make_source("digits", 4).example(5)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(f'{{"prompt": "p{i}", "answer": "{i}"}}' for i in range(5)) + "\n")
    j = make_source(str(data), 0)
    first_pass = sorted(j.example(i)["prompt"] for i in range(5))
    assert first_pass == [f"p{i}" for i in range(5)]  # each pass is a permutation
    assert j.example(7) == make_source(str(data), 0).example(7)
    data.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: expected an object with a string \"prompt\""):
        make_source(str(data), 0)


def test_rewards():
    assert get_reward("digits")("", "ab 12", {}) == 0.5
    assert get_reward("exact_match")("", " 7 ", {"answer": 7}) == 1.0
    assert get_reward("contains")("", "x7y", {"answer": "7"}) == 1.0
    assert get_reward("vllm_bi.trainer.rewards:digits") is get_reward("digits")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="returned nan"):
        checked_reward(lambda p, c, e: math.nan, "p", "c", {})


def test_group_advantages_and_clip():
    adv, spread = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    assert spread.tolist() == [True, True, False, False]
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0, 1.1]))
    a = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, st = clipped_surrogate(logp, old, a, 0.2, 0.28, denom=4)
    # min(r*A, clip(r)*A): 1.28, -0.8, 1.0, -1.1 -> mean 0.095, loss = -mean
    assert math.isclose(float(loss), -(1.28 - 0.8 + 1.0 - 1.1) / 4, rel_tol=1e-6)
    assert st["clipped"] == 2


def test_checkpoint_schedule():
    """--save-every N: at step 0, every N steps and at the end; 0: never (large models' full checkpoints)."""
    from vllm_bi.trainer.checkpoint import checkpoint_due

    assert [d for d in range(8) if checkpoint_due(3, d, 7)] == [0, 3, 6, 7]
    assert [d for d in range(5) if checkpoint_due(1, d, 4)] == [0, 1, 2, 3, 4]
    assert not any(checkpoint_due(0, d, 4) for d in range(5))


def test_a_recipe_settings_section_is_checked_and_applied_below_the_environment(tmp_path, monkeypatch):
    """A recipe's [settings] section: validated when the recipe is read, then applied as the process's settings
    (and its server's, through the environment it inherits); an explicit VLLM_BI_* variable wins over it, and it
    wins over a preset."""
    from vllm_bi import settings as S

    monkeypatch.setattr(S, "_FROM_CONFIG", {})
    recipe = tmp_path / "r.toml"
    recipe.write_text('steps = 2\n[settings]\ngdn_mode = "chunk"\nnonfinite_guard = false\n')
    cfg = parse_args(["--config", str(recipe)])
    assert cfg.settings == {"gdn_mode": "chunk", "nonfinite_guard": False} and cfg.steps == 2
    env = {}
    assert S.apply_section(cfg.settings, "r.toml [settings]", env) == []
    assert env == {"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_NONFINITE_GUARD": "0"}
    got = S.Settings.from_env(env)
    assert (got.gdn_mode, got.nonfinite_guard, got.source("gdn_mode")) == ("chunk", False, "config")
    env = {"VLLM_BI_GDN_MODE": "recurrent"}  # set explicitly: the environment wins
    assert S.apply_section(cfg.settings, "r.toml [settings]", env) == ["gdn_mode"]
    got = S.Settings.from_env(env)
    assert (got.gdn_mode, got.source("gdn_mode"), got.nonfinite_guard) == ("recurrent", "env", False)
    env = {"VLLM_BI_PRESET": "fast"}  # the section over the preset, the preset's other values kept
    S.apply_section({"gemm": "fp64"}, "r.toml [settings]", env)
    got = S.Settings.from_env(env)
    assert (got.gemm, got.source("gemm"), got.cuda_graphs, got.source("cuda_graphs")) == (
        "fp64", "config", "decode", "preset")


@pytest.mark.parametrize("section, match", [
    ('gdn_mod = "chunk"', r"\[settings\]: unknown settings gdn_mod; known: preset, gdn_mode"),
    ('gdn_mode = "fast"', r"\[settings\]: gdn_mode='fast' is not a setting; use one of auto, recurrent, chunk"),
])
def test_a_bad_settings_section_is_one_line(tmp_path, section, match):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[settings]\n{section}\n")
    with pytest.raises(ConfigError, match=match) as e:
        load_recipe(str(recipe))
    assert "\n" not in str(e.value)
