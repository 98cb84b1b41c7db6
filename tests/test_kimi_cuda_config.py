"""Kimi Linear's configuration checks on CUDA (``patch.engine_config._kimi_linear``, ``patch.model_families.refusal``)
driven with a fake CUDA platform object; no engine is started, no GPU needed.

With the ``kimi-linear`` CUDA feature on (gated in ``CUDA_FEATURES``, so no variable is needed): TRITON_MLA is chosen
and steps run eagerly; the chunk GDN mode, decode CUDA graphs, another attention backend, ``VLLM_KIMI_K3_GEMM_AR=1``
and the Triton attention op asked for by name (MLA's head dims are no power of two; CUDA's default, ``auto``, attends
MLA with the torch op) are each refused in one line naming the fix. With the feature taken out and not previewed (negative control) the model is refused on CUDA, naming the
preview variable. A Qwen checkpoint is left alone; ROCm stays refused."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_bi import settings as S
from vllm_bi.patch import engine_config as EC
from vllm_bi.patch import model_families as MF


class FakePlatform:
    def __init__(self, kind):
        self.kind = kind

    def is_cpu(self):
        return self.kind == "cpu"

    def is_cuda(self):
        return self.kind == "cuda"

    def is_rocm(self):
        return self.kind == "rocm"

    def is_cuda_alike(self):
        return self.kind in ("cuda", "rocm")


CUDA = FakePlatform("cuda")


@pytest.fixture
def env(monkeypatch):
    """Set ``VLLM_BI_*`` variables for one test (the suite's ``monkeypatch`` re-reads the settings on each change and
    restores them after the test). Nothing set but what the test sets: CUDA's default attention op."""
    for name in ("VLLM_BI_CUDA_PREVIEW", "VLLM_BI_GDN_MODE", "VLLM_BI_CUDA_GRAPHS", "VLLM_BI_PRESET",
                 "VLLM_BI_ATTENTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_env


def _model(tmp_path, arch):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


def _args(model, **kw):
    return SimpleNamespace(model=model, attention_backend=kw.get("attention_backend"),
                           attention_config=SimpleNamespace(backend=None), enforce_eager=kw.get("eager", False))


def _kimi_config():
    return SimpleNamespace(architecture="KimiLinearForCausalLM", is_hybrid=True)


def test_preview_on_chooses_triton_mla_and_eager_steps(tmp_path, env, monkeypatch):
    env(VLLM_BI_CUDA_PREVIEW="kimi-linear")
    args = _args(_model(tmp_path, "KimiLinearForCausalLM"))
    assert EC._kimi_linear(args, CUDA) is True
    assert args.attention_backend == "TRITON_MLA" and args.enforce_eager is True
    chosen = _args(args.model, attention_backend="TRITON_MLA")
    assert EC._kimi_linear(chosen, CUDA) is True and chosen.attention_backend == "TRITON_MLA"
    monkeypatch.setattr(MF, "_platform", lambda: "cuda")
    assert MF.refusal(_kimi_config()) is None
    env(VLLM_BI_CUDA_PREVIEW="all")
    assert MF.refusal(_kimi_config()) is None
    # the attention op: CUDA's default takes the torch op for MLA (and the Triton kernel elsewhere); so does torch
    for value in ("auto", "torch"):
        env(VLLM_BI_ATTENTION=value)
        assert EC._kimi_linear(_args(args.model), CUDA) is True
        assert S.current().attention_op("cuda", mla=True) == "torch"
    assert S.current().attention_op("cuda") == "torch"
    env(VLLM_BI_ATTENTION="auto")
    assert S.current().attention_op("cuda") == "triton"


@pytest.mark.parametrize("case, env_values, backend, fix", [
    ("chunk mode", {"VLLM_BI_GDN_MODE": "chunk"}, None, "set VLLM_BI_GDN_MODE=recurrent"),
    ("decode graphs", {"VLLM_BI_CUDA_GRAPHS": "decode"}, None, "set VLLM_BI_CUDA_GRAPHS=off"),
    ("decode graphs from the preset", {"VLLM_BI_PRESET": "fast"}, None, "from VLLM_BI_PRESET=fast"),
    ("another backend", {}, "TRITON_ATTN", "Drop --attention-backend or choose TRITON_MLA"),
    ("another MLA backend", {}, "FLASHMLA", "Drop --attention-backend or choose TRITON_MLA"),
    ("fused GEMM + all-reduce", {"VLLM_KIMI_K3_GEMM_AR": "1"}, None, "unset it or set it to 0"),
    ("Triton attention", {"VLLM_BI_ATTENTION": "triton"}, None, "unset VLLM_BI_ATTENTION or set it to auto or torch"),
])
def test_preview_on_refuses_in_one_line(tmp_path, env, case, env_values, backend, fix):
    env(VLLM_BI_CUDA_PREVIEW="kimi-linear", **env_values)
    args = _args(_model(tmp_path, "KimiLinearForCausalLM"), attention_backend=backend)
    with pytest.raises(EC.BatchInvarianceConfigError) as e:
        EC._kimi_linear(args, CUDA)
    msg = str(e.value)
    assert fix in msg and "\n" not in msg and msg.startswith("vllm_bi: "), (case, msg)


def test_preview_off_refuses_kimi_on_cuda(tmp_path, env, monkeypatch):
    """Negative control: with kimi-linear neither gated (taken out of CUDA_FEATURES here) nor previewed, the same
    checkpoint that the tests above configure is refused on CUDA, one line naming VLLM_BI_CUDA_PREVIEW=kimi-linear;
    nothing is set."""
    monkeypatch.cuda_feature_off("kimi-linear")
    args = _args(_model(tmp_path, "KimiLinearForCausalLM"))
    assert EC._kimi_linear(args, CUDA) is False
    assert args.attention_backend is None and args.enforce_eager is False
    monkeypatch.setattr(MF, "_platform", lambda: "cuda")
    why = MF.refusal(_kimi_config())
    assert why and "VLLM_BI_CUDA_PREVIEW=kimi-linear" in why and "\n" not in why
    env(VLLM_BI_CUDA_PREVIEW="speculative")  # another feature's preview does not serve Kimi Linear
    assert MF.refusal(_kimi_config()) == why


def test_gated_feature_needs_no_preview(tmp_path, env, monkeypatch):
    """A GPU gate lists kimi-linear in CUDA_FEATURES: CUDA serves it without the preview variable."""
    assert "kimi-linear" in S.CUDA_FEATURES
    args = _args(_model(tmp_path, "KimiLinearForCausalLM"))
    assert EC._kimi_linear(args, CUDA) is True and args.attention_backend == "TRITON_MLA"
    monkeypatch.setattr(MF, "_platform", lambda: "cuda")
    assert MF.refusal(_kimi_config()) is None


def test_rocm_stays_refused(env, monkeypatch):
    env(VLLM_BI_CUDA_PREVIEW="kimi-linear")
    monkeypatch.setattr(MF, "_platform", lambda: "rocm")
    why = MF.refusal(_kimi_config())
    assert why and "on cpu, cuda only" in why and "no ROCM path" in why and "\n" not in why


def test_platform_names_rocm_apart(monkeypatch):
    import vllm.platforms

    for kind in ("cpu", "cuda", "rocm"):
        monkeypatch.setattr(vllm.platforms, "current_platform", FakePlatform(kind))
        assert MF._platform() == kind


def test_qwen_left_alone(tmp_path, env):
    env(VLLM_BI_CUDA_PREVIEW="kimi-linear")
    args = _args(_model(tmp_path, "Qwen3_5ForCausalLM"))
    assert EC._kimi_linear(args, CUDA) is False
    assert args.attention_backend is None and args.enforce_eager is False


def test_cpu_keeps_cpu_mla(tmp_path, env):
    """CPU's behaviour whatever the preview says: CPU_MLA, no eager change here (CPU's own block sets it)."""
    model = _model(tmp_path, "KimiLinearForCausalLM")
    for preview in ("none", "kimi-linear"):
        env(VLLM_BI_CUDA_PREVIEW=preview)
        args = _args(model)
        assert EC._kimi_linear(args, FakePlatform("cpu")) is True
        assert args.attention_backend == "CPU_MLA" and args.enforce_eager is False


def test_kda_core_devices_and_modes():
    """The KDA core's device check: CPU in both modes, CUDA in the recurrent mode only, another device refused."""
    from vllm_bi.gdn.layer import _check_kda

    for mode in ("recurrent", "chunk"):
        _check_kda("kda", torch.device("cpu"), mode)
        _check_kda("gdn", torch.device("cuda"), mode)
    _check_kda("kda", torch.device("cuda"), "recurrent")
    with pytest.raises(NotImplementedError, match="VLLM_BI_GDN_MODE=recurrent"):
        _check_kda("kda", torch.device("cuda"), "chunk")
    with pytest.raises(NotImplementedError, match="CPU and CUDA only"):
        _check_kda("kda", torch.device("meta"), "recurrent")
