"""vllm_bi's settings: the only code that reads the ``VLLM_BI_*`` environment variables.

A :class:`Settings` is frozen and validated once. Every other module reads the process's instance through
:func:`current` (cached; :func:`reload` re-reads the environment, for tests and tools that change it), never the
environment.

Precedence: a variable that is set wins over a trainer config's ``[settings]`` section (:func:`apply_section`),
the section over the preset ``VLLM_BI_PRESET`` names, and the preset over the default.
Presets:

- ``auto`` (the default): every setting at its ``auto`` value, resolved per device: on CUDA at tensor parallel size
  1 the fast arithmetic (Triton GEMM with the shipped tile table, decode CUDA graphs where the GDN mode allows them),
  elsewhere (CPU, CUDA with TP > 1) the portable one. The server's start-up resolves it and logs what it chose;
- ``portable``: the exact arithmetic whose bits do not depend on the GPU model (float64 GEMM accumulation, eager
  decode, torch's elementwise kernels rather than Triton's approximate ``exp``); the CPU's arithmetic, and CUDA's default before the fast one became it;
- ``fast``: the fastest exact settings measured on the H200 (Triton GEMM with the tile table ``auto`` names, decode
  CUDA graphs); CUDA only.

``VLLM_BI_GEMM_CONFIGS=tune`` names no file: a CUDA server tunes (or loads from ``VLLM_BI_CACHE_DIR``) a table for
its device and model when it loads the model and takes it with :func:`use_tuned_table`; a trainer takes a copy of
its server's the same way. Until then the table's digest is :data:`TUNE_PENDING`.

Two processes reproduce each other's bits when their :meth:`Settings.arithmetic` dicts agree (:func:`diff`): the
resolved values that decide bits on a device (the auto choices made for that device, the GEMM tile table's digest),
not the names a user typed. The server reports that dict (``vllm_bi_info``), and ``vllm-bi info``, ``vllm-bi
parity``, the trainer's refusal of a mismatched server, its checkpoint metadata and ``metrics.jsonl`` use it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re

from vllm_bi.errors import UsageError

__all__ = ["Settings", "SETTINGS", "launcher_pid", "PARENT_PID_ENV", "PRESETS", "ARITHMETIC_ENV", "ABSENT_MEANT", "current", "reload", "diff", "describe_diff",
           "settings_table", "TUNE", "TUNE_PENDING", "use_tuned_table", "tuned_table"]

PREFIX = "VLLM_BI_"
_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    default: object
    choices: tuple | None  # None: free text; (True, False): a switch
    doc: str

    @property
    def env(self) -> str:
        return PREFIX + self.name.upper()


# The preset a process gets when VLLM_BI_PRESET is unset: auto (fast on CUDA at TP 1, portable elsewhere). A change
# here changes CUDA's bits: it lands with a GPU gate run of the tree that has it (vllm_bi.gpu_gate).
DEFAULT_PRESET = "auto"
# What VLLM_BI_ROWWISE=auto runs on CUDA. A change here changes CUDA's bits, as DEFAULT_PRESET does.
ROWWISE_AUTO_CUDA = "triton"
# What VLLM_BI_GDN_MODE=auto (the default) runs in a process that has a CUDA device; elsewhere auto is the recurrent
# mode (CPU's exact reference). A change here changes CUDA's bits, as DEFAULT_PRESET does.
GDN_MODE_AUTO_CUDA = "recurrent"
# How VLLM_BI_CHUNK_DECODE=auto plans the chunk mode's decode steps on CUDA. Both plans give the same bits; a change
# here changes which kernels CUDA runs, so it lands with a GPU gate run as DEFAULT_PRESET does.
CHUNK_DECODE_AUTO_CUDA = "host"
# What VLLM_BI_LOGPROBS=auto runs on CUDA. The Triton kernels' bits differ from the torch formula's on some rows
# (their sums run in another order), so a change here changes CUDA's bits, as DEFAULT_PRESET does, and lands with a
# full GPU gate run. The portable preset keeps the torch formula.
LOGPROBS_AUTO_CUDA = "triton"
# Which rows the trainer's lm_head and log-softmax take on CUDA under VLLM_BI_TRAINER_LOGITS=auto: "all" (every
# position of the packed sequences, then the completion rows picked out) or "completions" (those rows only). The
# op library's GEMM and log-softmax give a row the same bits in a batch of any size (the server relies on it), so both
# give the same logprobs; tests/test_trainer_logits.py checks them with torch.equal on CPU. A change here changes a
# default CUDA path and lands with a GPU gate run.
TRAINER_LOGITS_AUTO_CUDA = "all"
# What VLLM_BI_DIGEST=auto runs on CUDA. Both implementations give the same weight digests by construction, so this
# decides no bits of a served token. The kernel gave the torch path's digests at full model size on the GPU
# (benchmarks/weight_digest.py); as a change of a default CUDA path, the switch lands with a full GPU gate run.
DIGEST_AUTO_CUDA = "triton"
# Whether the reducing row kernels on CUDA (row_sum, the Triton RMSNorms) read their rows in one memory layout
# (vllm_bi.ops.layout.canonical_rows) or as the caller holds them. A padded view gave row_sum other bits than a
# contiguous tensor on the GPU; the copy into one layout fixes that, but it changes the bits of rows held in another
# layout, so a change here lands with a full GPU gate run, as DEFAULT_PRESET does.
CANONICAL_ROWS_CUDA = True
# How the recurrent mode's CUDA kernel (vllm_bi.gdn.slots.recurrent_in_slots) cuts the state under
# VLLM_BI_GDN_TILE=auto: "fla" is fla-core's fused recurrent launch (its bits; a trainer may run fla-core's kernel),
# another value a tile of vllm_bi's own (gdn.slots.parse_tile; the trainer then runs vllm_bi's kernel too). 16x1x3
# (16 values of the state per program, one warp, three stages) took 0.43-0.78x fla's prefill time and 0.89x its
# decode time at Qwen3.5-9B's GDN dims (benchmarks/gdn_recurrent_tiles.py). A change here changes CUDA's bits, as
# DEFAULT_PRESET does; the portable preset keeps fla's.
GDN_TILE_AUTO_CUDA = "16x1x3"
# The GDN gates on CUDA under VLLM_BI_GDN_GATES=auto: "torch" (vllm_bi.ops.pointwise, one kernel per operation) or
# "triton" (vllm_bi.ops.gates_triton: one kernel, the same operations in the same order, meant to give torch's bits;
# tests/gpu/test_gates_cuda.py checks that; a 9B-dims layer step took 0.67-0.85x the torch kernels' GPU time with the
# direct IO below: docs/results/2026-12-07-h100-cublas-bits-bf16-state-and-gdn-glue.md). A change here lands with a GPU
# run of that test and a gate.
GDN_GATES_AUTO_CUDA = "triton"
# How the recurrent mode's server step moves its data on CUDA under VLLM_BI_GDN_IO=auto: "copies" (torch copies: the
# conv states gathered out of their cache slots and the new requests' zeroed, q, k and v split out of the conv's
# output, the core's output scattered into the layer's rows, the new conv states stored back) or "direct" (the conv
# reads and writes the states in their slots and writes q, k and v apart, the recurrent kernel writes the layer's
# rows: vllm_bi.ops.conv.slot_causal_conv1d). The same arithmetic on the same values, so the same bits by
# construction; tests/gpu/test_gdn_io_cuda.py checks them with torch.equal. A change here lands with that GPU run
# and a gate.
GDN_IO_AUTO_CUDA = "direct"
# What VLLM_BI_GEMM_CONFIGS=auto gives CUDA's Triton GEMM: "shipped" (the shipped table DEFAULT_GEMM_TABLE on every
# card), "card" (the shipped table made on this card, chosen by the device's name: card_gemm_table; DEFAULT_GEMM_TABLE
# on a card without one) or "tune" (a table tuned for this device and the served model on a server's first start and
# cached, the entries of a shipped table made on this device taken as they are: patch/gemm_tuning). The tiles decide a
# product's bits, so a change here changes CUDA's bits and lands with a GPU gate run, as DEFAULT_PRESET does.
GEMM_CONFIGS_AUTO_CUDA = "shipped"
DEFAULT_GEMM_TABLE = "h200-qwen3.5-9b"  # auto's table under "shipped"; card's on a card without one of its own
# What CUDA serves under batch invariance beyond the Qwen GDN models without speculative decoding: each feature named
# here runs a CUDA path a GPU run showed exact, and lands with a full GPU gate run of the tree that lists it
# (speculative decoding: tests/gpu/test_speculative_cuda.py; Kimi Linear: tests/gpu/test_kimi_linear_cuda.py and the
# gate's Kimi job; speculative-one-token: the one-token test of tests/gpu/test_speculative_cuda.py).
# VLLM_BI_CUDA_PREVIEW runs the others, for measuring. speculative-one-token: with speculative decoding, one-token
# prompts, whose requests vLLM's scheduler may pad into speculative rows that the GDN glue then starts from zeroed
# slots (model_executor/gdn.new_spec_requests and, in Model Runner V2, gdn.wrap_mamba_prepare_attn); served on CPU
# always and on CUDA while it is listed here.
FEATURES = ("speculative", "kimi-linear", "speculative-one-token")
CUDA_FEATURES: tuple[str, ...] = ("speculative", "kimi-linear", "speculative-one-token")

SETTINGS = (
    _Spec("preset", DEFAULT_PRESET, ("auto", "portable", "fast"),
          "a named set of the settings below (explicit variables win); auto: fast on CUDA at TP 1, portable elsewhere"),
    _Spec("gdn_mode", "auto", ("auto", "recurrent", "chunk"),
          "GDN arithmetic: the recurrence or 64-row blocks (chunk); auto: "
          f"{GDN_MODE_AUTO_CUDA} where the process has a CUDA device, recurrent elsewhere; docs/gdn-modes.md"),
    _Spec("cuda_ops", "vllm_bi", ("vllm_bi", "vllm"),
          "CUDA kernels: the trainer's op library, or vLLM's own batch-invariant ones (serving only, no parity)"),
    _Spec("gemm", "auto", ("auto", "fp64", "triton"),
          "GEMM arithmetic: float64 accumulation (exact everywhere) or vLLM's batch-invariant Triton matmul (CUDA); "
          "auto: triton on CUDA, fp64 on CPU"),
    _Spec("gemm_configs", "auto", None, "the Triton GEMM's tile table: a JSON file, a shipped table's name "
          "(h200-qwen3.5-9b, h100-qwen3.5-9b: Qwen3.5-9B's shapes tuned on that card), card (the shipped table made "
          f"on this card, chosen by the device's name; {DEFAULT_GEMM_TABLE} on a card without one), vllm (vLLM's own "
          "tiles) or "
          "tune (tuned for this device and the served model's shapes on a server's first start, cached under "
          "VLLM_BI_CACHE_DIR; a trainer takes its server's; CUDA only, "
          "ignored on CPU; the entries of a shipped table made on this device are taken as they are); auto: "
          + {"shipped": f"the shipped table {DEFAULT_GEMM_TABLE}, on every card"}.get(GEMM_CONFIGS_AUTO_CUDA,
                                                                                     GEMM_CONFIGS_AUTO_CUDA)),
    _Spec("attention", "auto", ("auto", "torch", "triton"),
          "attention op: auto is Triton on CUDA (torch for multi-head latent attention), torch on CPU"),
    _Spec("rowwise", "auto", ("auto", "torch", "triton"),
          "row-local ops (RMSNorms, the GDN gated norm, SiLU-and-mul): one Triton kernel each, or torch's eager "
          f"kernels; auto: {ROWWISE_AUTO_CUDA} on CUDA, torch on CPU"),
    _Spec("gdn_tile", "auto", None,
          "the recurrent GDN kernel's tile on CUDA (server and trainer alike): fla (fla-core's launch, [K, 8] of the "
          "state per program, one warp) or BVxWARPSxSTAGES (values of the state per program, Triton warps and stages, "
          f"e.g. 32x2x3); each tile gives its own bits; auto: {GDN_TILE_AUTO_CUDA}"),
    _Spec("gdn_gates", "auto", ("auto", "torch", "triton"),
          "the GDN gates (g from a, A_log and dt_bias; beta from b) on CUDA: torch's elementwise kernels, one per "
          "operation, or one Triton kernel running the same operations (meant to give the same bits; checked by "
          f"tests/gpu/test_gates_cuda.py); CPU runs torch's; auto: {GDN_GATES_AUTO_CUDA}"),
    _Spec("gdn_io", "auto", ("auto", "copies", "direct"),
          "how the recurrent GDN server step moves its data on CUDA: torch copies around the kernels (conv states "
          "gathered and stored, q, k and v split, outputs scattered), or direct (the conv reads and writes its states "
          "in their cache slots and writes q, k and v apart; the recurrent kernel writes the layer's rows); the same "
          f"arithmetic either way; CPU copies; auto: {GDN_IO_AUTO_CUDA}"),
    _Spec("gdn_state", "fp32", ("fp32", "bf16"),
          "the recurrent GDN state between tokens (server cache and trainer alike): fp32, or rounded to bf16 after "
          "every token (half the state cache and its decode traffic, stock vLLM's cache dtype; its own bits; the "
          "recurrent mode only; experimental: docs/gdn-modes.md)"),
    _Spec("moe", "auto", ("auto", "loop", "exact", "triton"),
          "MoE experts: auto is triton on CUDA, loop on CPU; exact gives the loop's float64 bits on the device"),
    _Spec("chunk_decode", "auto", ("auto", "host", "padded"),
          "the chunk mode's decode steps on CUDA: planned on the host (eager only), or every block padded to 64 rows "
          f"with its indices built on the device (capturable; the same bits); auto: {CHUNK_DECODE_AUTO_CUDA}"),
    _Spec("logprobs", "auto", ("auto", "torch", "triton"),
          "log-softmax of the logits (the server's logprobs and the trainer's): the fp32 torch formula, or two Triton "
          "kernels over fixed spans of each row (CUDA; other bits than the formula's); auto: "
          f"{LOGPROBS_AUTO_CUDA} on CUDA, torch on CPU"),
    _Spec("trainer_logits", "auto", ("auto", "all", "completions"),
          "the rows the trainer's lm_head and log-softmax take: every position of its packed sequences, or the "
          "completion tokens' only (the rows whose logprobs it uses: less work and memory where prompts are long; "
          "the same logprobs, since the op library gives a row the same bits in a batch of any size); auto: "
          f"completions on CPU, {TRAINER_LOGITS_AUTO_CUDA} on CUDA"),
    _Spec("digest", "auto", ("auto", "torch", "triton"),
          "the weight digest's value sums: torch's elementwise kernels, or one fused Triton kernel (CUDA; bf16, fp16 "
          "and fp32 tensors); the same digests either way, so server and trainer may differ; auto: "
          f"{DIGEST_AUTO_CUDA} on CUDA, torch on CPU"),
    _Spec("spec_verify", "fused", ("steps", "fused"),
          "how a GDN layer scores a speculative step's k + 1 rows on CUDA: steps (one one-token step per position) or "
          "fused (one in-place pass per request, the state after each row stored in its slot; the same bits)"),
    _Spec("cuda_graphs", "auto", ("auto", "off", "decode"),
          "decode: capture decode steps in CUDA graphs (CUDA); auto: decode where the GDN mode and ops allow it"),
    _Spec("nonfinite_guard", True, (True, False), "a NaN or +inf logit fails its request instead of being served"),
    _Spec("debug_nonfinite", False, (True, False),
          "every GDN layer checks its values and logs the first non-finite one (host reads: debugging only)"),
    _Spec("allow_unverified_device", False, (True, False), "serve on a platform never verified (ROCm, XPU)"),
    _Spec("allow_unverified_tp", False, (True, False), "tensor parallelism on CUDA where it was never measured"),
    _Spec("cuda_preview", "none", ("none", *FEATURES, "all"),
          "run a CUDA feature that no GPU gate has shown exact yet (one of vllm_bi.settings.FEATURES not in "
          "CUDA_FEATURES), for measuring; CUDA already serves the gated ones (speculative decoding, Kimi Linear, "
          "one-token prompts with speculative decoding), so naming one of those changes nothing; none refuses the "
          "previews by name"),
    _Spec("cache_dir", "", None, "where vllm_bi keeps what it makes once per machine (tuned GEMM tile tables in "
          "gemm_tiles/); unset: $XDG_CACHE_HOME/vllm_bi, else ~/.cache/vllm_bi"),
)
_BY_NAME = {s.name: s for s in SETTINGS}
PRESETS = {
    "auto": {},
    "portable": {"gemm": "fp64", "cuda_graphs": "off", "rowwise": "torch", "logprobs": "torch", "gdn_tile": "fla",
                 "gdn_gates": "torch", "gdn_io": "copies"},
    "fast": {"gemm": "triton", "cuda_graphs": "decode"},
}
# the arithmetic dict's keys (the names ``vllm_bi_info`` has always used) and the variable that sets each
ARITHMETIC_ENV = {"gdn_mode": "VLLM_BI_GDN_MODE", "ops": "VLLM_BI_CUDA_OPS", "gemm": "VLLM_BI_GEMM",
                  "gemm_configs": "VLLM_BI_GEMM_CONFIGS", "attention": "VLLM_BI_ATTENTION",
                  "rowwise": "VLLM_BI_ROWWISE", "moe": "VLLM_BI_MOE", "logprobs": "VLLM_BI_LOGPROBS",
                  "gdn_tile": "VLLM_BI_GDN_TILE", "gdn_gates": "VLLM_BI_GDN_GATES",
                  "gdn_state": "VLLM_BI_GDN_STATE"}
_LABEL = {"gdn_mode": "GDN mode", "ops": "CUDA op mode", "gemm": "GEMM mode", "gemm_configs": "Triton GEMM tile table",
          "attention": "attention op", "rowwise": "row-local ops", "moe": "MoE experts path",
          "logprobs": "log-softmax op", "gdn_tile": "recurrent GDN tile", "gdn_gates": "GDN gates path",
          "gdn_state": "GDN state dtype"}
# what a record made before an arithmetic key existed ran, where that key applies now (its value is not "none"): a
# checkpoint's settings are read with these filled in, so a resume across the key's arrival is compared, not skipped
ABSENT_MEANT = {"gdn_tile": "fla", "gdn_gates": "torch", "gdn_state": "fp32"}
# retired spellings of a value: one line naming the replacement
_ALIASES = {"cuda_graphs": {"": "off", "0": "off", "none": "off"}}
# retired values: refused with why and what to use instead
_RETIRED = {"gdn_mode": {"hybrid": "is no longer a mode (retired: it served at the recurrent mode's speed and was "
                                   "inexact on CUDA; docs/gdn-modes.md); use recurrent (the default) or chunk"},
            "gemm": {"cublas": "is refused: cuBLAS with split-K off was measured not batch-invariant on an H100 (a row "
                               "of a 64-column GEMM differed at one row; docs/results/"
                               "2026-12-07-h100-cublas-bits-bf16-state-and-gdn-glue.md) and took 2-3x cuBLAS's "
                               "default time at small batches; use triton (the CUDA default) or fp64"}}


def _parse(spec: _Spec, raw: str, origin: str):
    value = raw.strip()
    if spec.choices == (True, False):
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise UsageError(f"{origin}={raw!r} is not a setting; use 1 (on) or 0 (off)")
    if spec.choices is None:
        if spec.name == "gdn_tile":
            return _tile_value(value, origin)
        return TUNE if spec.name == "gemm_configs" and value.lower() == TUNE else value
    value = value.lower()
    value = _ALIASES.get(spec.name, {}).get(value, value)
    if value in _RETIRED.get(spec.name, {}):
        raise UsageError(f"{origin}={raw!r} {_RETIRED[spec.name][value]}")
    if value not in spec.choices:
        raise UsageError(f"{origin}={raw!r} is not a setting; use one of {', '.join(spec.choices)} "
                         f"(default {spec.default})")
    return value


def _tile_value(raw: str, origin: str) -> str:
    value = raw.strip().lower()
    if value in ("auto", "fla"):
        return value
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", value)
    if m is None or int(m[1]) not in (8, 16, 32, 64, 128) or int(m[2]) not in (1, 2, 4, 8) or not 1 <= int(m[3]) <= 4:
        raise UsageError(f"{origin}={raw!r} is not a tile; use auto, fla or BVxWARPSxSTAGES with BV in 8..128 "
                         "(a power of two), WARPS in 1, 2, 4, 8 and STAGES in 1..4, e.g. 32x2x3")
    return value


def _resolved(value: str, device: str, cuda_auto: str, elsewhere: str) -> str:
    """A setting's value on ``device``: ``auto`` is ``cuda_auto`` on CUDA and ``elsewhere`` on other devices; any other
    value is itself."""
    if value == "auto":
        return cuda_auto if device == "cuda" else elsewhere
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """One process's vllm_bi settings (validated; see the module doc)."""

    preset: str = DEFAULT_PRESET
    gdn_mode: str = "auto"  # resolved at construction: the value is always recurrent or chunk
    cuda_ops: str = "vllm_bi"
    gemm: str = "auto"
    gemm_configs: str = "auto"
    attention: str = "auto"
    rowwise: str = "auto"
    gdn_tile: str = "auto"
    gdn_gates: str = "auto"
    gdn_io: str = "auto"
    gdn_state: str = "fp32"
    moe: str = "auto"
    chunk_decode: str = "auto"
    logprobs: str = "auto"
    trainer_logits: str = "auto"
    digest: str = "auto"
    spec_verify: str = "fused"
    cuda_graphs: str = "auto"
    nonfinite_guard: bool = True
    debug_nonfinite: bool = False
    allow_unverified_device: bool = False
    allow_unverified_tp: bool = False
    cuda_preview: str = "none"
    cache_dir: str = ""
    origin: tuple = ()  # (name, "env" | "config" | "preset") of every value that is not the default

    def __post_init__(self):
        if self.gdn_mode == "auto":
            object.__setattr__(self, "gdn_mode", _auto_gdn_mode())
        if self.gdn_state != "fp32" and self.gdn_mode != "recurrent":
            raise UsageError(f"VLLM_BI_GDN_STATE={self.gdn_state} runs in the recurrent GDN mode only, this process "
                             f"runs {self.gdn_mode!r}; set VLLM_BI_GDN_MODE=recurrent or unset VLLM_BI_GDN_STATE")

    @classmethod
    def from_env(cls, environ=None) -> "Settings":
        """Read ``VLLM_BI_*`` from ``environ`` (default ``os.environ``). A bad value raises ``UsageError`` (a
        ``ValueError``) naming the variable and what to use; so does an unknown ``VLLM_BI_`` variable that looks like
        a setting's misspelling."""
        env = os.environ if environ is None else environ
        values, origin = {}, []
        raw = env.get(_BY_NAME["preset"].env, "").strip()
        preset = _parse(_BY_NAME["preset"], raw, _BY_NAME["preset"].env) if raw else DEFAULT_PRESET
        values["preset"] = preset
        for name, value in PRESETS[preset].items():
            values[name] = value
            origin.append((name, "preset"))
        for spec in SETTINGS[1:]:
            raw = env.get(spec.env)
            # unset, empty or "auto": the preset's value or the default (the graphs' empty value meant off)
            if raw is None or (raw.strip().lower() in ("", "auto") and spec.name != "cuda_graphs"
                               and not (spec.choices and "auto" in spec.choices and raw.strip())):
                continue
            values[spec.name] = _parse(spec, raw, spec.env)
            origin = [o for o in origin if o[0] != spec.name] + [
                (spec.name, "config" if _FROM_CONFIG.get(spec.env) == raw else "env")]
        return cls(**values, origin=tuple(origin))

    def to_dict(self) -> dict:
        """Every setting by name (the form ``vllm-bi info`` prints)."""
        return {s.name: getattr(self, s.name) for s in SETTINGS}

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        unknown = sorted(set(d) - set(_BY_NAME))
        if unknown:
            raise UsageError(f"unknown settings {', '.join(unknown)}; known: {', '.join(_BY_NAME)}")
        return cls(**{k: _parse(_BY_NAME[k], str(int(v)) if isinstance(v, bool) else str(v), k) for k, v in d.items()})

    def source(self, name: str) -> str:
        """Where ``name``'s value came from: ``env``, ``config``, ``preset`` or ``default``."""
        return dict(self.origin).get(name, "default")

    # ------------------------------------------------------------------ resolved for a device
    def cuda_feature(self, name: str) -> bool:
        """Whether CUDA runs ``name`` (one of :data:`FEATURES`): gated (:data:`CUDA_FEATURES`) or previewed."""
        if name not in FEATURES:
            raise ValueError(f"unknown CUDA feature {name!r}; one of {', '.join(FEATURES)}")
        return name in CUDA_FEATURES or self.cuda_preview in (name, "all")

    def attention_op(self, device: str, mla: bool = False) -> str:
        """The attention op on ``device`` (``triton`` or ``torch``); ``mla``: for multi-head latent attention
        (Kimi Linear's), which ``auto`` attends with the torch op on every device (its head dims, 128 + 64, are
        no power of two, which the Triton kernel needs)."""
        if self.attention == "auto":
            return "triton" if device == "cuda" and not mla else "torch"
        return self.attention

    def rowwise_op(self, device: str) -> str:
        """The row-local ops' implementation on ``device`` (``triton`` or ``torch``)."""
        return _resolved(self.rowwise, device, ROWWISE_AUTO_CUDA, "torch")

    def gdn_gates_op(self, device: str) -> str:
        """How the GDN gates run on ``device``: ``torch`` or ``triton`` (CUDA, or CPU in Triton's interpreter when set
        explicitly, for tests)."""
        return _resolved(self.gdn_gates, device, GDN_GATES_AUTO_CUDA, "torch")

    def gdn_io_op(self, device: str) -> str:
        """How the recurrent GDN server step moves its data on ``device``: ``copies`` or ``direct`` (CUDA, or CPU in
        Triton's interpreter when set explicitly, for tests)."""
        return _resolved(self.gdn_io, device, GDN_IO_AUTO_CUDA, "copies")

    def gdn_summary(self, device: str) -> str:
        """The GDN arithmetic on ``device`` in one phrase, for reports and logs: the mode, then the state, the
        recurrent tile where one runs, and the gates' path."""
        tile = self.recurrent_tile(device)
        return (f"{self.gdn_mode} (state {self.gdn_state}{'' if tile == 'none' else f', tile {tile}'}, "
                f"gates {self.gdn_gates_op(device)})")

    def recurrent_tile(self, device: str) -> str:
        """The recurrent GDN kernel's tile on ``device`` (``fla`` or ``BVxWARPSxSTAGES``); ``none`` where no
        such kernel runs (CPU, the chunk mode)."""
        if device != "cuda" or self.gdn_mode != "recurrent":
            return "none"
        return GDN_TILE_AUTO_CUDA if self.gdn_tile == "auto" else self.gdn_tile

    def trainer_logits_rows(self, device: str) -> str:
        """The rows the trainer's lm_head and log-softmax take on ``device``: ``all`` or ``completions``."""
        return _resolved(self.trainer_logits, device, TRAINER_LOGITS_AUTO_CUDA, "completions")

    def logprobs_op(self, device: str) -> str:
        """The log-softmax's implementation on ``device`` (``torch`` or ``triton``)."""
        return _resolved(self.logprobs, device, LOGPROBS_AUTO_CUDA, "torch")

    def digest_op(self, device: str) -> str:
        """The weight digest's implementation on ``device`` (``torch`` or ``triton``; not part of :meth:`arithmetic`:
        both give the same digests)."""
        return _resolved(self.digest, device, DIGEST_AUTO_CUDA, "torch")

    def moe_path(self, device: str) -> str:
        """The MoE experts' path on ``device`` (``loop``, ``exact`` or ``triton``)."""
        return _resolved(self.moe, device, "triton", "loop")

    def chunk_decode_plan(self, device: str) -> str:
        """How the chunk mode plans a decode step on ``device``: ``padded`` (CUDA only: indices on the device,
        capturable) or ``host``."""
        if device != "cuda":
            return "host"
        return CHUNK_DECODE_AUTO_CUDA if self.chunk_decode == "auto" else self.chunk_decode

    def gemm_on(self, device: str) -> str:
        """The GEMM arithmetic on ``device`` (``fp64`` or ``triton``; CPU tensors always take float64)."""
        if device != "cuda":
            return "fp64"
        return "triton" if self.gemm == "auto" else self.gemm

    def ops(self, device: str) -> str:
        """The op set a server on ``device`` runs (CPU: always the op library)."""
        return self.cuda_ops if device == "cuda" else "vllm_bi"

    def gemm_table_path(self) -> str | None:
        """The tile table file ``gemm_configs`` names (a path, or the name of a table shipped with vllm_bi in
        ``vllm_bi/ops/gemm_tiles/``); ``None`` when unset."""
        value = self.gemm_configs
        if value in ("", "vllm"):
            return None
        if self.tunes_table():
            return _TUNED[0] if _TUNED else None
        return self._named_table_path

    @functools.cached_property
    def _named_table_path(self) -> str:
        # resolved once per settings object: the Triton GEMM asks before every product, and the name's resolution
        # reads the file system (the shipped tables' folder)
        value = self.gemm_configs
        if value == "auto":
            value = DEFAULT_GEMM_TABLE if GEMM_CONFIGS_AUTO_CUDA == "shipped" else CARD
        if value == CARD:
            value = card_gemm_table()
        if os.sep in value or value.endswith(".json") or os.path.exists(value):
            return value
        if value in builtin_tables():
            return os.path.join(BUILTIN_GEMM_TABLES, value + ".json")
        raise UsageError(f"VLLM_BI_GEMM_CONFIGS={value}: neither a table file (a path, *.json) nor a table shipped "
                         f"with vllm_bi ({', '.join(builtin_tables()) or 'none'}); fix it or unset it")

    def gemm_table_name(self) -> str:
        """The tile table as the start-up line names it: ``auto`` and ``card`` resolved to the shipped table they name
        (:data:`GEMM_CONFIGS_AUTO_CUDA`, :func:`card_gemm_table`), ``auto`` under ``tune`` as ``tune``, any other
        value as given."""
        if self.tunes_table():
            return TUNE
        path = self.gemm_table_path() if self.gemm_configs in ("auto", CARD) else None
        return os.path.basename(path)[:-5] if path else self.gemm_configs

    def gemm_tiles(self) -> str:
        """The Triton GEMM tile table's digest: ``none`` (vLLM's own) or the file's sha256 prefix; under ``tune``
        the digest of the table this process took (:func:`use_tuned_table`), :data:`TUNE_PENDING` before."""
        if self.tunes_table():
            return _TUNED[1] if _TUNED else TUNE_PENDING
        path = self.gemm_table_path()
        if path is None:
            return "none"
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError as e:
            raise UsageError(f"VLLM_BI_GEMM_CONFIGS={path}: cannot read it ({e}); fix the path or unset it") from None

    def cache_root(self, environ=None) -> str:
        """The folder of vllm_bi's per-machine cache: ``VLLM_BI_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm_bi``, else
        ``~/.cache/vllm_bi``."""
        if self.cache_dir:
            return os.path.abspath(os.path.expanduser(self.cache_dir))
        env = os.environ if environ is None else environ
        base = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(os.path.abspath(base), "vllm_bi")

    def tunes_table(self) -> bool:
        """Whether the Triton GEMM's tile table is the one tuned for this device and model: ``VLLM_BI_GEMM_CONFIGS=tune``,
        or ``auto`` where :data:`GEMM_CONFIGS_AUTO_CUDA` is ``tune``."""
        return self.gemm_configs == TUNE or (self.gemm_configs == "auto" and GEMM_CONFIGS_AUTO_CUDA == TUNE)

    def tunes_gemm(self, device: str) -> bool:
        """Whether a server on ``device`` tunes (or loads its cached) Triton GEMM tile table at start-up: under
        :meth:`tunes_table` with the Triton GEMM, which is CUDA's only."""
        return self.tunes_table() and self.gemm_on(device) == "triton"

    def arithmetic(self, device: str) -> dict:
        """What decides a token's bits on ``device``: the dict a server reports and a trainer must equal
        (:func:`diff`)."""
        gemm = self.gemm_on(device)
        return {"gdn_mode": self.gdn_mode, "ops": self.ops(device), "gemm": gemm,
                "gemm_configs": self.gemm_tiles() if gemm == "triton" else "none",
                "attention": self.attention_op(device),
                "rowwise": self.rowwise_op(device), "moe": self.moe_path(device),
                "logprobs": self.logprobs_op(device), "gdn_tile": self.recurrent_tile(device),
                "gdn_gates": self.gdn_gates_op(device), "gdn_state": self.gdn_state}

    def decode_graphs(self, enforce_eager: bool = False) -> tuple[bool, str]:
        """Whether a CUDA server captures its decode steps, and, when ``auto`` leaves them eager, why. ``decode``
        always asks for capture (the engine config then refuses what cannot be captured); ``auto`` captures unless
        :meth:`graph_blockers` names something (MoE counted as present: the host-grouped loop path blocks) or
        ``--enforce-eager`` is given."""
        if self.cuda_graphs != "auto":
            return self.cuda_graphs == "decode", ""
        why = self.graph_blockers(has_moe=True)
        if enforce_eager:
            why.append("--enforce-eager")
        return not why, "; ".join(why)

    def graph_blockers(self, has_moe: bool) -> list[str]:
        """What keeps a CUDA decode step from being captured under these settings (and a model with MoE layers or
        not); empty if nothing does."""
        why = []
        if self.gdn_mode == "chunk" and self.chunk_decode_plan("cuda") == "host":
            why.append("VLLM_BI_GDN_MODE=chunk with VLLM_BI_CHUNK_DECODE=host (decode steps planned on the host; "
                       "use VLLM_BI_CHUNK_DECODE=padded)")
        if self.attention_op("cuda") != "triton":
            why.append(f"VLLM_BI_ATTENTION={self.attention_op('cuda')} (rows grouped on the host; use triton)")
        if self.cuda_ops != "vllm_bi":
            why.append("VLLM_BI_CUDA_OPS=vllm (vLLM's own kernels: not planned for capture here)")
        if has_moe and self.moe_path("cuda") == "loop":
            why.append("MoE layers with VLLM_BI_MOE=loop (experts grouped on the host; use exact or triton)")
        if why and self.source("cuda_graphs") == "preset" and self.cuda_graphs == "decode":
            why.append(f"(VLLM_BI_CUDA_GRAPHS=decode came from VLLM_BI_PRESET={self.preset}; set "
                       "VLLM_BI_CUDA_GRAPHS=off to keep the preset's other settings)")
        return why


def _auto_gdn_mode() -> str:
    """``VLLM_BI_GDN_MODE=auto``: :data:`GDN_MODE_AUTO_CUDA` in a process with a CUDA device (the server's engine and
    workers, a trainer on a GPU), recurrent elsewhere. One answer per process, so the engine's state shapes, its
    workers and a trainer on the same kind of machine agree; a trainer on another kind of machine than its server
    is refused by the settings comparison (:func:`diff`)."""
    if GDN_MODE_AUTO_CUDA == "recurrent":
        return "recurrent"
    try:
        import torch

        return GDN_MODE_AUTO_CUDA if torch.cuda.is_available() else "recurrent"
    except ImportError:
        return "recurrent"


TUNE = "tune"  # VLLM_BI_GEMM_CONFIGS's value for a table tuned for this device and model
TUNE_PENDING = "tune-pending"  # the digest under ``tune`` before this process took a table
CARD = "card"  # VLLM_BI_GEMM_CONFIGS's value for the shipped table made on this card (card_gemm_table)
_TUNED: tuple[str, str] | None = None  # (path, digest) of the table this process took under ``tune``


def use_tuned_table(path: str) -> str:
    """Make ``path`` this process's table under ``VLLM_BI_GEMM_CONFIGS=tune`` (the server's tuned or cached one, a
    trainer's copy of its server's): its digest is read once, here, and returned."""
    global _TUNED
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError as e:
        raise UsageError(f"VLLM_BI_GEMM_CONFIGS=tune: cannot read the tuned table {path} ({e})") from None
    _TUNED = (os.path.abspath(path), digest)
    return digest


def tuned_table() -> tuple[str, str] | None:
    """``(path, digest)`` of the table this process took under ``VLLM_BI_GEMM_CONFIGS=tune``, or None."""
    return _TUNED


BUILTIN_GEMM_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops", "gemm_tiles")


@functools.lru_cache(maxsize=1)
def cuda_device_name() -> str | None:
    """This process's CUDA device's name (``NVIDIA H100 80GB HBM3``), None without CUDA. Through vLLM's platform
    where it is importable (NVML: a process that has not touched CUDA, such as vLLM's API server, stays so), else
    torch's."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cuda():
                return str(current_platform.get_device_name())
        except Exception:  # noqa: BLE001 - no usable vLLM here: torch names the device as well
            pass
        return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - no CUDA runtime: no CUDA device
        return None


def card_gemm_table(device: str | None = None) -> str:
    """The shipped tile table made on ``device`` (default: :func:`cuda_device_name`), by the ``device`` each table
    records; :data:`DEFAULT_GEMM_TABLE` where none was (and without CUDA). One table per card: a test checks it."""
    device = cuda_device_name() if device is None else device
    made_here = (name for name, made_on in shipped_table_devices().items() if made_on == device)
    return (next(made_here, None) if device else None) or DEFAULT_GEMM_TABLE


def shipped_table_devices(folder: str | None = None) -> dict[str, str]:
    """``{name: the device it was tuned on}`` of every tile table in ``folder`` (default: the shipped ones), in name
    order; ``""`` for a file that does not say (or cannot be read)."""
    import json

    folder = BUILTIN_GEMM_TABLES if folder is None else folder
    out = {}
    for name in _table_names(folder):
        try:
            with open(os.path.join(folder, name + ".json")) as f:
                out[name] = str(json.load(f).get("device", ""))
        except (OSError, ValueError, AttributeError):
            out[name] = ""
    return out


def shipped_table_with_digest(digest: str) -> str | None:
    """The name of the shipped tile table whose digest (:meth:`Settings.gemm_tiles`) is ``digest``, None if none."""
    for name in builtin_tables():
        if Settings.from_env({"VLLM_BI_GEMM_CONFIGS": name}).gemm_tiles() == digest:
            return name
    return None


def builtin_tables() -> list[str]:
    """Names of the GEMM tile tables shipped with vllm_bi (``VLLM_BI_GEMM_CONFIGS=<name>``)."""
    return _table_names(BUILTIN_GEMM_TABLES)


def _table_names(folder: str) -> list[str]:
    """The tile tables in ``folder`` by name (``NAME.json``), sorted; none where it cannot be read."""
    try:
        return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json"))
    except OSError:
        return []


def _moe_bits(path: str, gemm: str) -> str:
    """The exact grouped kernels and the loop under the float64 GEMM give the same bits."""
    return "float64" if path == "exact" or (path == "loop" and gemm == "fp64") else f"{path}/{gemm}"


def diff(server: dict, mine: dict) -> list[tuple[str, object, object]]:
    """``(key, server's value, mine)`` for every arithmetic setting on which two :meth:`Settings.arithmetic` dicts
    give other bits (an absent key, from an older vllm_bi, is not compared). The tile table counts only under the
    Triton GEMM; the MoE paths by the bits they give."""
    out = []
    for key in ARITHMETIC_ENV:
        if key not in server or key not in mine:
            continue
        a, b = server[key], mine[key]
        if key == "gemm_configs" and mine.get("gemm") != "triton":
            continue
        if key == "moe":
            if _moe_bits(a, server.get("gemm", "fp64")) == _moe_bits(b, mine.get("gemm", "fp64")):
                continue
        elif a == b:
            continue
        out.append((key, a, b))
    return out


def describe_diff(server: dict, mine: dict, theirs: str = "the server", ours: str = "this trainer") -> str | None:
    """One line naming the first setting on which ``server`` and ``mine`` differ, both values and the fix; None if
    they agree."""
    rows = diff(server, mine)
    if not rows:
        return None
    key, a, b = rows[0]
    if key == "gemm":
        return (f"{theirs}'s {_LABEL[key]} is {a!r}, {ours}'s {b!r}: set VLLM_BI_GEMM to the same value on both sides "
                "(VLLM_BI_PRESET=portable on both gives the float64 GEMM, the CPU's and a server's under tensor "
                "parallelism; VLLM_BI_PRESET=fast on both the Triton one)")
    if key == "ops" and a != "vllm_bi":
        return (f"{theirs} runs vLLM's own batch-invariant CUDA kernels (VLLM_BI_CUDA_OPS={a}): its serving is "
                "batch-invariant, but the trainer's ops give other bits; restart it without VLLM_BI_CUDA_OPS "
                "(default vllm_bi)")
    more = f" (and {len(rows) - 1} more: {', '.join(r[0] for r in rows[1:])})" if len(rows) > 1 else ""
    return (f"{theirs}'s {_LABEL[key]} is {a!r}, {ours}'s {b!r}{more}; set {ARITHMETIC_ENV[key]} to the same value "
            "on both sides")


def settings_table() -> str:
    """The settings as a Markdown table (variable, default, values, what it does): ``docs/serving.md``'s."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    for s in SETTINGS:
        values = "1, 0" if s.choices == (True, False) else ", ".join(s.choices) if s.choices else "text"
        default = ("1" if s.default else "0") if isinstance(s.default, bool) else (s.default or "(unset)")
        rows.append(f"| `{s.env}` | {default} | {values} | {s.doc} |")
    return "\n".join(rows)


_CURRENT: Settings | None = None
_FROM_CONFIG: dict[str, str] = {}  # variables set from a config section (apply_section), and their values


def _raw(value) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def apply_section(section: dict, source: str, environ=None) -> list[str]:
    """A config file's ``[settings]`` section (keys: setting names, e.g. ``gdn_mode = "chunk"``) becomes this
    process's settings, and those of the servers it starts: each value is set as its ``VLLM_BI_*`` variable unless
    the environment already sets that variable, which wins (returned: the setting names the environment kept).
    A bad name or value raises ``UsageError`` (a ``ValueError``) naming ``source``; nothing is set then."""
    env = os.environ if environ is None else environ
    parsed = {}
    for name, value in section.items():
        if name not in _BY_NAME:
            raise UsageError(f"{source}: unknown setting {name!r}; known: {', '.join(_BY_NAME)}")
        parsed[name] = _parse(_BY_NAME[name], _raw(value), f"{source} {name}")
    kept = []
    for name, value in parsed.items():
        var = _BY_NAME[name].env
        if env.get(var) is not None and _FROM_CONFIG.get(var) != env[var]:
            kept.append(name)
            continue
        env[var] = _FROM_CONFIG[var] = _raw(value)
    if environ is None:
        reload()
    return kept



PARENT_PID_ENV = PREFIX + "PARENT_PID"  # not a setting: the launcher's pid, in the environment of a server it starts


def launcher_pid(environ=None) -> int | None:
    """The pid of the vllm_bi process that started this server (``VLLM_BI_PARENT_PID``, set by
    :class:`vllm_bi.launcher.VllmServer`), or None for a server started otherwise."""
    raw = (os.environ if environ is None else environ).get(PARENT_PID_ENV, "")
    return int(raw) if raw.strip().isdigit() else None


def current() -> Settings:
    """This process's settings (read from the environment once)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Settings.from_env()
    return _CURRENT


def reload() -> Settings:
    """Re-read the environment (after a change to it) and return the new settings."""
    global _CURRENT
    _CURRENT = None
    return current()


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_bi.settings", description="vllm_bi's settings table")
    ap.add_argument("--write", metavar="MD", help="replace the table between the settings markers in this file")
    args = ap.parse_args(argv)
    table = settings_table()
    if not args.write:
        print(table)
        return 0
    with open(args.write) as f:
        text = f.read()
    if MARK_OPEN not in text or MARK_CLOSE not in text:
        raise SystemExit(f"{args.write}: no {MARK_OPEN} ... {MARK_CLOSE} block to replace")
    head, rest = text.split(MARK_OPEN, 1)
    tail = rest.split(MARK_CLOSE, 1)[1]
    with open(args.write, "w") as f:
        f.write(f"{head}{MARK_OPEN}\n{table}\n{MARK_CLOSE}{tail}")
    print(f"rewrote {args.write}")
    return 0


MARK_OPEN, MARK_CLOSE = "<!-- settings -->", "<!-- /settings -->"

if __name__ == "__main__":
    raise SystemExit(_main())
