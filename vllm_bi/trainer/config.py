"""Trainer configuration: one dataclass, read from a TOML recipe and overridden on the command line.

Precedence: defaults < ``--config FILE.toml`` < ``--option value`` flags. Every field below is a flag
(``max_staleness`` -> ``--max-staleness``); ``python -m vllm_bi.trainer --help`` lists them with
these help texts. Recipes live in the repository's top-level ``trainer/`` folder.

A recipe's ``[settings]`` section holds vllm_bi's arithmetic settings (``gdn_mode = "chunk"``, ``preset = "fast"``;
names as in ``vllm-bi info``). The trainer applies it to itself and to the server it starts; a ``VLLM_BI_*``
variable set in the environment wins over it (:func:`vllm_bi.settings.apply_section`). Against a server started
elsewhere nothing is adopted from the server: a mismatch is refused, naming the setting and both values.
"""

from __future__ import annotations

import argparse
import difflib
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field

from vllm_bi.errors import OneLineParser, UsageError, exit_status_help
from vllm_bi.model_dir import QWEN_ARCHITECTURES, read_model_config
from vllm_bi.settings import Settings

__all__ = ["TrainerConfig", "ConfigError", "parse_args"]


class ConfigError(UsageError):
    """A bad option value or recipe (exit status 2); the message names the option and the fix."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainerConfig:
    # ---- model and server
    model: str = _f("", "HF checkpoint directory of a GDN hybrid (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / Kimi Linear). "
                        "Empty: build the built-in small random-weight model (--model-family) in RUN_DIR/base_model.")
    model_family: str = _f("qwen3-next", "family of the built-in model when --model is empty",
                           choices=("qwen3-next", "qwen3.5", "qwen3.5-moe"))
    server_url: str = _f("", "URL of a running `VLLM_BATCH_INVARIANT=1 VLLM_SERVER_DEV_MODE=1 vllm serve MODEL`. "
                             "Empty: the trainer starts one itself (CPU settings) and stops it at the end.")
    server_args: str = _f("--max-num-batched-tokens 256 --max-num-seqs 32",
                          "extra `vllm serve` arguments when the trainer starts the server")
    api_key: str = _f("", "the server's API key (default: VLLM_API_KEY). With --server-url: the key it was started "
                          "with; otherwise the key of the server the trainer starts (default: one made for the run). "
                          "Never written to RUN_DIR", secret=True)
    run_dir: str = _f("runs/digits", "output folder: metrics.jsonl, tb/ (TensorBoard), checkpoint/, weights/, logs")
    # ---- data and reward
    task: str = _f("digits", "built-in task name (digits; tool_digits: multi-turn) or a JSONL file with one "
                             "{\"prompt\": ..., ...} per line")
    reward: str = _f("", "reward function: a built-in name (digits, exact_match, contains, tool_digits) or a dotted "
                         "path 'package.module:function' taking (prompt, completion, example) -> float. "
                         "Empty: the task's own reward (digits for the digits task, tool_digits for tool_digits, "
                         "exact_match for JSONL)")
    env: str = _f("", "multi-turn rollouts: the environment, a built-in name (tool_digits) or "
                      "'package.module:function' taking (example, turns) and returning the tool's output (text or "
                      "token ids) or None to end; each turn is a new request on the conversation's token ids "
                      "(prefix-cache hits), and the trainer trains on the model's tokens only. Empty: the task's own "
                      "(tool_digits for the tool_digits task), else one turn")
    max_turns: int = _f(3, "multi-turn rollouts: at most this many model turns per trajectory")
    # ---- rollouts
    steps: int = _f(40, "optimizer steps to run (a resumed run continues up to this many)")
    prompts_per_step: int = _f(8, "prompts per rollout batch")
    group_size: int = _f(4, "samples per prompt (the GRPO group)")
    max_tokens: int = _f(12, "max completion tokens per sample")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling p")
    seed: int = _f(0, "seed of the data order, of every sample's server-side seed, and of torch")
    # ---- algorithm
    algo: str = _f("dapo", "grpo: symmetric clip; dapo: asymmetric clip-higher and groups with identical "
                           "rewards left out", choices=("grpo", "dapo"))
    clip_low: float = _f(0.2, "lower clip: ratio >= 1 - clip_low")
    clip_high: float = _f(0.28, "upper clip: ratio <= 1 + clip_high (grpo uses clip_low for both)")
    lr: float = _f(5e-3, "AdamW learning rate (fp32 master weights)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)")
    micro_batch_seqs: int = _f(16, "sequences per trainer forward/backward (gradient accumulation over the batch)")
    arithmetic: str = _f("vllm_bi", "vllm_bi: the server's op library, logprobs equal to the server's bit for bit; "
                                    "stock: the non-batch-invariant baseline for timing what batch invariance costs "
                                    "(transformers' own model against a stock vLLM server, VLLM_BATCH_INVARIANT=0; "
                                    "its logprobs differ from the server's)", choices=("vllm_bi", "stock"))
    # ---- async and weight sync
    max_staleness: int = _f(0, "off-policy window: a batch may be sampled up to this many weight versions before "
                               "the trainer uses it (0 = synchronous, on-policy)")
    weight_push: str = _f("files", "how new weights reach the server: files (an HF checkpoint under RUN_DIR/weights, "
                                   "reloaded by the server; any device) or ipc (CUDA: vLLM's weight-transfer engine, "
                                   "CUDA IPC, trainer and server on one GPU; nothing written to disk; the server needs "
                                   "--weight-transfer-config '{\"backend\": \"ipc\"}' and "
                                   "VLLM_ALLOW_INSECURE_SERIALIZATION=1, which the trainer's own server gets)",
                          choices=("files", "ipc"))
    verify_weights: bool = _f(True, "after every weight push, check that the server's weight digest equals the "
                                    "trainer's (refuse to continue on a mismatch)")
    recompute_at_sample_version: bool = _f(False, "also recompute each stale batch with the weights of the version "
                                                   "it was sampled under (metric bit_wise/logprob_diff_at_sample_version/max; "
                                                   "proves the gap is staleness only; costs a forward per step)")
    keep_weight_versions: int = _f(0, "weight versions to keep under RUN_DIR/weights (0 = max_staleness + 1)")
    # ---- checkpoints and logging
    save_every: int = _f(1, "checkpoint every N steps (and at step 0 and at the end); 0: never (a cut run "
                            "starts again from the base model). A checkpoint holds the fp32 masters and AdamW "
                            "moments, 12 bytes per parameter, each process writing its own shards")
    resume: bool = _f(True, "continue from RUN_DIR/checkpoint when it exists")
    tensorboard: bool = _f(True, "also write TensorBoard events to RUN_DIR/tb (needs the tensorboard package)")
    progress: bool = _f(True, "show a progress bar")
    # ---- vllm_bi's arithmetic settings: the recipe's [settings] section only (not a flag)
    settings: dict = field(default_factory=dict, metadata={"help": "vllm_bi settings from the recipe's [settings] "
                                                                   "section", "flag": False})

    def validate(self) -> "TrainerConfig":
        def bad(opt, msg):
            raise ConfigError(f"--{opt.replace('_', '-')}: {msg}")

        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "micro_batch_seqs", "max_turns"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0:
            bad("save_every", f"must be >= 0 (0: no checkpoints), got {self.save_every}")
        if self.group_size < 2:
            bad("group_size", "GRPO needs at least 2 samples per prompt to normalise advantages")
        if self.max_staleness < 0:
            bad("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if not (0.0 < self.temperature):
            bad("temperature", "must be > 0 (RL samples; greedy gives every group one answer)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            bad("clip_low", "need 0 <= clip_low < 1 and clip_high >= 0")
        if self.lr <= 0:
            bad("lr", "must be > 0")
        if self.keep_weight_versions and self.keep_weight_versions < self.max_staleness + 1:
            bad("keep_weight_versions", f"must be 0 or >= max_staleness + 1 = {self.max_staleness + 1}")
        if self.weight_push == "ipc" and self.recompute_at_sample_version:
            bad("recompute_at_sample_version", "reloads the sampled version from its files; --weight-push ipc writes "
                "none (use --weight-push files)")
        if self.arithmetic == "stock" and self.recompute_at_sample_version:
            bad("recompute_at_sample_version", "recomputes with vllm_bi's model; not with --arithmetic stock")
        if self.server_url and not self.model:
            bad("model", "with --server-url, also give --model: the checkpoint directory the server was started with")
        if self.server_url and not self.server_url.startswith(("http://", "https://")):
            bad("server_url", f"{self.server_url!r} is not a server URL; give one like http://127.0.0.1:8000")
        if self.model:
            try:  # a missing or corrupt checkpoint, or another architecture: refused before anything loads
                cfg = read_model_config(self.model, "--model")
            except UsageError as e:
                raise ConfigError(str(e)) from None
            if self.arithmetic == "stock" and (cfg.get("architectures") or [None])[0] not in QWEN_ARCHITECTURES:
                bad("arithmetic", f"stock runs transformers' model, which has no {cfg['architectures'][0]} class "
                    "(its modelling code is remote code); use --arithmetic vllm_bi")
        return self

    @property
    def weight_versions_kept(self) -> int:
        return self.keep_weight_versions or self.max_staleness + 1


FIELDS = {f.name: f for f in dataclasses.fields(TrainerConfig)}


def _coerce(name: str, value, source: str):
    f = FIELDS[name]
    typ = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float, "bool": bool}[f.type]
    try:
        if typ is bool:
            if isinstance(value, bool):
                out = value
            elif str(value).lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError(value)
        elif typ is float and isinstance(value, bool) or typ is int and isinstance(value, (bool, float)):
            raise ValueError(value)
        else:
            out = typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name} = {value!r} is not a valid {typ.__name__}") from None
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        raise ConfigError(f"{source}: {name} = {out!r}; choose one of {', '.join(choices)}")
    return out


def load_recipe(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file (recipes live in the repository's trainer/ folder)")
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    flat = {}
    for k, v in raw.items():  # sections are only for readability: [rollout] steps = 10 == steps = 10
        if k == "settings":  # except [settings]: vllm_bi's own, checked here, applied when the run starts
            if not isinstance(v, dict):
                raise ConfigError(f"--config {path}: settings must be a [settings] section of name = value lines")
            try:
                Settings.from_dict(v)
            except ValueError as e:
                raise ConfigError(f"--config {path} [settings]: {e}") from None
            flat["settings"] = dict(v)
            continue
        for kk, vv in (v.items() if isinstance(v, dict) else [(k, v)]):
            if kk not in FIELDS or kk == "settings":
                near = difflib.get_close_matches(kk, FIELDS, n=1)
                raise ConfigError(f"--config {path}: unknown option {kk!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            flat[kk] = _coerce(kk, vv, f"--config {path}")
    return flat


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m vllm_bi.trainer",
        epilog=exit_status_help(
            "the run reached --steps", "a check of the run's own numbers failed: the server's weights differ from "
            "the trainer's after a push, or a non-finite loss or gradient norm (the update is not applied)",
            "the vllm_bi settings that decide the bits differ: the server's from the trainer's, or the checkpoint's "
            "from this process's"),
        description="Async GRPO/DAPO against a live batch-invariant vLLM server, with bit-exact trainer logprobs. "
                    "Defaults < --config recipe < flags. Without options: the built-in 'digits' task on a small "
                    "random-weight Qwen3-Next, a server started for you, 40 steps (about 10 minutes on 2 CPU cores).",
    )
    p.add_argument("--config", help="TOML recipe (see the trainer/ folder); flags override it")
    for name, f in FIELDS.items():
        if f.metadata.get("flag") is False:
            continue
        flag = "--" + name.replace("_", "-")
        kw = {"default": None, "help": f.metadata["help"] + f" (default: {f.default!r})"}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.type in (bool, "bool"):
            kw["metavar"] = "{true,false}"
        p.add_argument(flag, dest=name, **kw)
    return p


def parse_args(argv: list[str] | None = None) -> TrainerConfig:
    args = build_parser().parse_args(argv)
    values = load_recipe(args.config) if args.config else {}
    for name in FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = _coerce(name, v, "--" + name.replace("_", "-"))
    cfg = TrainerConfig(**values)
    if cfg.algo == "grpo" and "clip_high" not in values:
        cfg.clip_high = cfg.clip_low
    return cfg.validate()
