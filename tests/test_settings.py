"""vllm_bi's settings (``vllm_bi.settings``): the one reader of ``VLLM_BI_*``, its precedence (a set variable over
the preset over the default), its dict form and the one diff that every consumer uses."""

import ast
import os

import pytest

from vllm_bi import settings as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV_READERS = {"get", "getenv", "setdefault", "__getitem__", "__contains__"}


def env_reads(source: str) -> list[str]:
    """Where ``source`` reads the environment for a ``VLLM_BI_`` name (or through a name we cannot see, a constant or
    a helper's parameter), or defines a ``VLLM_BI_`` constant: ``"line: what"``."""
    tree = ast.parse(source)
    found = []

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    def key_bad(key) -> bool:  # a VLLM_BI_ literal, or anything that is not a literal (it may hold one)
        if isinstance(key, ast.Constant):
            return isinstance(key.value, str) and key.value.startswith("VLLM_BI_")
        return True

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _ENV_READERS and is_environ(f.value):
                if key_bad(node.args[0]):
                    found.append(f"{node.lineno}: environ.{f.attr}({ast.unparse(node.args[0])})")
            if isinstance(f, ast.Attribute) and f.attr == "getenv" and key_bad(node.args[0]):
                found.append(f"{node.lineno}: getenv({ast.unparse(node.args[0])})")
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            if key_bad(node.slice):
                found.append(f"{node.lineno}: environ[{ast.unparse(node.slice)}]")
        if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators) and key_bad(node.left):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str) and node.value.value.startswith("VLLM_BI_"):
            found.append(f"{node.lineno}: constant {ast.unparse(node)}")
    return found


def test_no_module_but_settings_reads_a_vllm_bi_variable():
    bad = {}
    for d, _, files in os.walk(os.path.join(ROOT, "vllm_bi")):
        for f in files:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, ROOT)
            if not f.endswith(".py") or rel == os.path.join("vllm_bi", "settings.py"):
                continue
            with open(path) as fh:
                hits = env_reads(fh.read())
            if hits:
                bad[rel] = hits
    assert not bad, f"read VLLM_BI_* only in vllm_bi/settings.py (vllm_bi.settings.current()): {bad}"


def test_the_check_catches_every_form_of_read():
    """Control: each way of reading the environment that the rule forbids is found."""
    for src in ('import os\nos.environ.get("VLLM_BI_GDN_MODE", "")',
                'import os\nos.getenv("VLLM_BI_GEMM")',
                'import os\nx = os.environ["VLLM_BI_MOE"]',
                'import os\n"VLLM_BI_MOE" in os.environ',
                'import os\nMODE_ENV = "VLLM_BI_GDN_MODE"',
                'import os\ndef choice(env):\n    return os.environ.get(env, "auto")'):
        assert env_reads(src), src
    # and what stays allowed: other variables, writes, messages naming a variable
    assert not env_reads('import os\nos.environ.get("RANK", "0")\nos.environ["X"] = "1"\n'
                         'raise ValueError("set VLLM_BI_GEMM=fp64")')


def test_precedence_env_over_preset_over_default():
    default = S.Settings.from_env({})
    assert default.preset == S.DEFAULT_PRESET and default.gdn_mode == "recurrent" and default.origin == tuple(
        (k, "preset") for k in S.PRESETS[S.DEFAULT_PRESET])
    fast = S.Settings.from_env({"VLLM_BI_PRESET": "fast"})
    assert (fast.gemm, fast.gemm_configs, fast.cuda_graphs) == ("triton", "auto", "decode")
    assert fast.source("gemm") == "preset" and fast.source("gdn_mode") == "default"
    mixed = S.Settings.from_env({"VLLM_BI_PRESET": "fast", "VLLM_BI_GEMM": "fp64", "VLLM_BI_GDN_MODE": "chunk"})
    assert (mixed.gemm, mixed.gdn_mode, mixed.gemm_configs) == ("fp64", "chunk", "auto")
    assert mixed.source("gemm") == "env" and mixed.source("cuda_graphs") == "preset"
    # empty means unset; the graphs' old spellings of "off" still work
    assert S.Settings.from_env({"VLLM_BI_GDN_MODE": "", "VLLM_BI_NONFINITE_GUARD": ""}) == default
    for off in ("", "0", "none", "off", "OFF"):
        assert S.Settings.from_env({"VLLM_BI_CUDA_GRAPHS": off}).cuda_graphs == "off"
    portable = S.Settings.from_env({"VLLM_BI_PRESET": "portable"})
    assert (portable.gemm, portable.cuda_graphs) == ("fp64", "off")


def test_auto_is_fast_on_cuda_and_portable_on_cpu():
    """The auto preset (the default, :data:`DEFAULT_PRESET`) and auto values resolve per device: CUDA gets the Triton GEMM with the shipped tile table and decode graphs,
    CPU the float64 GEMM (CPU tensors never take the Triton one); the portable preset gives CUDA the CPU's
    arithmetic back, and a fast server's dict differs from a portable trainer's (so the trainer refuses it)."""
    d = S.Settings.from_env({"VLLM_BI_PRESET": "auto"})
    assert (d.preset, d.gemm, d.gemm_configs, d.cuda_graphs) == ("auto", "auto", "auto", "auto")
    cuda, cpu = d.arithmetic("cuda"), d.arithmetic("cpu")
    assert cuda["gemm"] == "triton" and cpu["gemm"] == "fp64" and cpu["gemm_configs"] == "none"
    shipped = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": S.DEFAULT_GEMM_TABLE})
    assert cuda["gemm_configs"] == shipped.gemm_tiles() != "none"
    assert S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "vllm"}).arithmetic("cuda")["gemm_configs"] == "none"
    assert d.decode_graphs() == (True, "")
    portable = S.Settings.from_env({"VLLM_BI_PRESET": "portable"})
    assert portable.arithmetic("cuda")["gemm"] == "fp64" and portable.decode_graphs() == (False, "")
    # the recurrent GDN kernel: the default tile on CUDA, fla-core's launch under portable, no tile on CPU
    assert cuda["gdn_tile"] == S.GDN_TILE_AUTO_CUDA and portable.arithmetic("cuda")["gdn_tile"] == "fla"
    assert cpu["gdn_tile"] == "none"
    assert portable.arithmetic("cpu") == cpu
    assert S.diff(cuda, portable.arithmetic("cuda"))[0] == ("gemm", "triton", "fp64")
    assert "VLLM_BI_PRESET=portable" in S.describe_diff(cuda, portable.arithmetic("cuda"))


def test_auto_gdn_mode_resolves_once_per_process(monkeypatch):
    """``VLLM_BI_GDN_MODE=auto`` (the default) is a concrete mode in every Settings: the recurrent one without a CUDA
    device, :data:`GDN_MODE_AUTO_CUDA` with one; an explicit mode is kept."""
    import torch

    assert S.Settings().gdn_mode == S.Settings.from_env({"VLLM_BI_GDN_MODE": "auto"}).gdn_mode
    monkeypatch.setattr(S, "GDN_MODE_AUTO_CUDA", "chunk")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert S.Settings.from_env({}).gdn_mode == "recurrent"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert S.Settings.from_env({}).gdn_mode == "chunk" and S.Settings().arithmetic("cuda")["gdn_mode"] == "chunk"
    assert S.Settings.from_env({"VLLM_BI_GDN_MODE": "recurrent"}).gdn_mode == "recurrent"
    assert S.Settings.from_dict({"gdn_mode": "chunk"}).gdn_mode == "chunk"


def test_auto_graphs_stay_eager_where_a_decode_cannot_be_captured():
    """auto never refuses: the chunk mode and --enforce-eager leave decode eager, with the reason; an explicit
    decode is still asked for (and refused by the engine config where it cannot run)."""
    chunk = S.Settings.from_env({"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_CHUNK_DECODE": "host"})
    on, why = chunk.decode_graphs()
    assert not on and "VLLM_BI_GDN_MODE=chunk with VLLM_BI_CHUNK_DECODE=host" in why
    padded = S.Settings.from_env({"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_CHUNK_DECODE": "padded"})
    assert padded.decode_graphs() == (True, "") and padded.chunk_decode_plan("cpu") == "host"
    auto = S.Settings.from_env({"VLLM_BI_GDN_MODE": "chunk"})
    assert auto.chunk_decode_plan("cuda") == S.CHUNK_DECODE_AUTO_CUDA
    assert auto.decode_graphs()[0] == (S.CHUNK_DECODE_AUTO_CUDA == "padded")
    assert S.Settings.from_env({"VLLM_BI_PRESET": "auto"}).decode_graphs(enforce_eager=True) == (False, "--enforce-eager")
    assert S.Settings.from_env({"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_CUDA_GRAPHS": "decode"}).decode_graphs() == (
        True, "")


@pytest.mark.parametrize("env, match", [
    ({"VLLM_BI_GDN_MODE": "fast"}, "VLLM_BI_GDN_MODE='fast' is not a setting; use one of auto, recurrent, chunk"),
    ({"VLLM_BI_PRESET": "quick"}, "VLLM_BI_PRESET='quick' is not a setting; use one of auto, portable, fast"),
    ({"VLLM_BI_NONFINITE_GUARD": "maybe"}, "VLLM_BI_NONFINITE_GUARD='maybe' is not a setting; use 1 .on. or 0"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_the_choices(env, match):
    with pytest.raises(ValueError, match=match) as e:
        S.Settings.from_env(env)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("read", [lambda: S.Settings.from_env({"VLLM_BI_GDN_MODE": "Hybrid"}),
                                  lambda: S.Settings.from_dict({"gdn_mode": "hybrid"})], ids=["env", "config"])
def test_the_retired_hybrid_gdn_mode_is_refused_in_one_line_naming_the_modes_to_use(read):
    """``VLLM_BI_GDN_MODE=hybrid`` (retired) is refused, from the environment or a trainer config's section, in one
    line that says it is no longer a mode and names the recurrent and chunk modes."""
    with pytest.raises(ValueError, match=r"gdn_mode|GDN_MODE") as e:
        read()
    msg = str(e.value)
    assert "\n" not in msg and "'hybrid'" in msg.lower() and "no longer a mode" in msg and "retired" in msg
    assert "use recurrent (the default) or chunk" in msg and "hybrid" not in S._BY_NAME["gdn_mode"].choices


def test_dict_round_trip():
    s = S.Settings.from_env({"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_NONFINITE_GUARD": "0", "VLLM_BI_MOE": "exact"})
    d = s.to_dict()
    assert d["gdn_mode"] == "chunk" and d["nonfinite_guard"] is False and set(d) == {x.name for x in S.SETTINGS}
    back = S.Settings.from_dict(d)
    assert back.to_dict() == d
    with pytest.raises(ValueError, match="unknown settings gdn"):
        S.Settings.from_dict({"gdn": "chunk"})


def test_arithmetic_resolves_for_the_device_and_the_diff_names_what_differs():
    s = S.Settings()
    cpu, cuda = s.arithmetic("cpu"), s.arithmetic("cuda")
    assert (cpu["attention"], cpu["moe"], cpu["ops"]) == ("torch", "loop", "vllm_bi")
    assert (cuda["attention"], cuda["moe"]) == ("triton", "triton") and cpu["gemm_configs"] == "none"
    assert S.diff(cpu, cpu) == [] and S.describe_diff(cpu, cpu) is None
    other = dict(cpu, gdn_mode="chunk")
    assert S.diff(other, cpu) == [("gdn_mode", "chunk", "recurrent")]
    line = S.describe_diff(other, cpu)
    assert line == ("the server's GDN mode is 'chunk', this trainer's 'recurrent'; set VLLM_BI_GDN_MODE to the same "
                    "value on both sides")
    # the MoE paths by their bits: the exact kernels give the loop's float64 bits under the float64 GEMM
    assert S.diff(dict(cpu, moe="exact"), cpu) == []
    assert S.diff(dict(cpu, moe="triton"), cpu) == [("moe", "triton", "loop")]
    # the tile table counts only under the Triton GEMM
    assert S.diff(dict(cpu, gemm_configs="abc"), cpu) == []
    tri = dict(cpu, gemm="triton")
    assert S.diff(dict(tri, gemm_configs="abc"), tri) == [("gemm_configs", "abc", "none")]
    # a key an older server does not report is not compared
    assert S.diff({"gdn_mode": "recurrent"}, cpu) == []
    # the log-softmax kernel gives other bits than the torch formula: CUDA's default, named when the sides differ
    assert cpu["logprobs"] == "torch" and cuda["logprobs"] == S.LOGPROBS_AUTO_CUDA == "triton"
    formula = S.Settings.from_env({"VLLM_BI_LOGPROBS": "torch"}).arithmetic("cuda")
    assert S.diff(formula, cuda) == [("logprobs", "torch", "triton")]
    assert "set VLLM_BI_LOGPROBS to the same value" in S.describe_diff(formula, cuda)


def test_digest_setting_parses_resolves_per_device_and_is_not_arithmetic():
    """``VLLM_BI_DIGEST`` picks the weight digest's implementation: auto is :data:`DIGEST_AUTO_CUDA` on CUDA and torch
    elsewhere, an explicit value is kept on every device, a bad one is refused in one line. Both implementations
    give the same digests, so it is no key of the arithmetic dict and two sides that differ on it are not told."""
    assert S.DIGEST_AUTO_CUDA == "triton" and S.Settings().digest == "auto"
    auto = S.Settings.from_env({"VLLM_BI_DIGEST": "auto"})
    assert (auto.digest, auto.digest_op("cuda"), auto.digest_op("cpu")) == ("auto", S.DIGEST_AUTO_CUDA, "torch")
    for raw, value in (("triton", "triton"), (" Torch ", "torch"), ("TRITON", "triton")):
        s = S.Settings.from_env({"VLLM_BI_DIGEST": raw})
        assert s.digest == s.digest_op("cuda") == s.digest_op("cpu") == value and s.source("digest") == "env"
    assert S.Settings.from_dict({"digest": "triton"}).digest == "triton"
    with pytest.raises(ValueError, match="VLLM_BI_DIGEST='fused' is not a setting; use one of auto, torch, triton"):
        S.Settings.from_env({"VLLM_BI_DIGEST": "fused"})
    fused = S.Settings.from_env({"VLLM_BI_DIGEST": "triton"})
    assert "digest" not in S.ARITHMETIC_ENV and "VLLM_BI_DIGEST" not in S.ARITHMETIC_ENV.values()
    assert fused.arithmetic("cuda") == S.Settings().arithmetic("cuda")
    assert S.diff(fused.arithmetic("cuda"), S.Settings().arithmetic("cuda")) == []


def test_current_is_read_once_and_reload_rereads(monkeypatch):
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")  # the test suite's monkeypatch reloads the settings
    assert S.current().gdn_mode == "chunk" and S.current() is S.current()
    os.environ["VLLM_BI_GDN_MODE"] = "recurrent"  # a change behind the settings' back is not seen ...
    try:
        assert S.current().gdn_mode == "chunk"
        assert S.reload().gdn_mode == "recurrent"  # ... until they are read again
    finally:
        monkeypatch.setenv("VLLM_BI_GDN_MODE", "recurrent")


def test_serving_docs_table_is_generated_from_the_settings():
    with open(os.path.join(ROOT, "docs", "serving.md")) as f:
        text = f.read()
    assert S.settings_table() in text, "regenerate docs/serving.md's table: python -m vllm_bi.settings --table"
