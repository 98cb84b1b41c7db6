"""Every architecture vLLM 0.32 registers that has a recurrent-state layer (a ``MambaBase`` subclass: Mamba, Mamba2,
short convolutions, linear and delta-rule attention) other than the Qwen GDN layer is refused at configuration time
with its layer type named (``patch.model_families.refusal``, which reads the layers from vLLM's source).

The list is derived here from the registry itself, independently of that source reading: each architecture whose
class imports on this CPU install is loaded, vLLM's own model info says whether it keeps a recurrent state, and the
state layer classes its module holds are found by import. No engine is started."""

import json
import subprocess
import sys
import textwrap

from vllm_bi.patch.model_families import SUPPORTED_ARCHITECTURES

SCRIPT = textwrap.dedent("""
    import inspect, json, logging, sys
    from types import SimpleNamespace
    logging.disable(logging.CRITICAL)
    from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm_bi.patch.model_families import refusal
    rows = []
    for arch in sorted(ModelRegistry.get_supported_archs()):
        try:
            cls = ModelRegistry._try_load_model_cls(arch)
        except Exception:
            cls = None
        if cls is None:  # needs what this install lacks (torchvision, a GPU library)
            continue
        info = _ModelInfo.from_model_cls(cls)
        flags = dict(is_hybrid=info.is_hybrid, has_inner_state=info.has_inner_state,
                     is_attention_free=info.is_attention_free)
        held = sorted(n for n, o in vars(sys.modules[cls.__module__]).items()
                      if inspect.isclass(o) and issubclass(o, MambaBase) and o is not MambaBase)
        rows.append([arch, any(flags.values()), held, refusal(SimpleNamespace(architecture=arch, **flags))])
    print("ROWS " + json.dumps(rows))
""")
ABSTRACT = {"GatedDeltaNetAttention", "LinearAttention"}  # bases that hold no arithmetic of their own
ISSUE_FAMILIES = {"NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM",
                  "JambaForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM", "Lfm2ForCausalLM",
                  "OlmoHybridForCausalLM", "KimiLinearForCausalLM", "BailingMoeV2_5ForCausalLM"}


def test_every_other_recurrent_state_architecture_is_refused_with_its_layer_named():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("ROWS ")]
    rows = json.loads(line[5:])
    refused, accepted = set(), set()
    for arch, stateful, held, why in rows:
        layers = set(held) - ABSTRACT
        if not stateful:
            assert why is None, (arch, why)  # attention-only models are the layer audit's
            continue
        if arch in SUPPORTED_ARCHITECTURES:  # served on CPU (this machine): accepted whatever its package holds
            assert why is None, (arch, why)
            accepted.add(arch)
        elif layers and layers <= {"QwenGatedDeltaNetAttention"}:
            assert why is None, (arch, why)
            accepted.add(arch)
        elif layers:
            assert why and "without VLLM_BATCH_INVARIANT=1" in why, (arch, held, why)
            assert any(f"{name}" in why for name in layers - {"QwenGatedDeltaNetAttention"}), (arch, held, why)
            refused.add(arch)
    print(f"refused {len(refused)}: {sorted(refused)}; accepted: {sorted(accepted)}")
    assert ISSUE_FAMILIES - set(SUPPORTED_ARCHITECTURES) <= refused, ISSUE_FAMILIES - refused
    assert "Qwen3NextForCausalLM" in accepted  # the supported GDN layer is told apart
    # Kimi K3 shares Kimi Linear's package and stays refused by its own state layer
    assert "KimiLinearForCausalLM" in accepted and "KimiK3ForConditionalGeneration" in refused


def test_kimi_linear_is_refused_where_its_forwards_have_no_path(monkeypatch):
    """Kimi Linear is listed for CPU and CUDA; on ROCm (named apart from CUDA) it is refused at configuration time,
    naming the platforms and the fix; on CUDA it is served (a gated CUDA feature), and refused while the kimi-linear
    feature is neither gated nor previewed (``tests/test_kimi_cuda_config.py`` drives the preview). No engine
    started."""
    from types import SimpleNamespace

    from vllm_bi import settings
    from vllm_bi.patch import model_families as MF

    assert MF.SUPPORTED_ARCHITECTURES["KimiLinearForCausalLM"][0] == ("cpu", "cuda")
    config = SimpleNamespace(architecture="KimiLinearForCausalLM", is_hybrid=True)
    assert MF.refusal(config) is None  # this machine: CPU
    monkeypatch.setattr(MF, "_platform", lambda: "rocm")
    why = MF.refusal(config)
    assert why and "served batch-invariantly on cpu, cuda only" in why and "no ROCM path" in why and "\n" not in why
    monkeypatch.setattr(MF, "_platform", lambda: "cuda")
    assert "kimi-linear" in settings.CUDA_FEATURES and MF.refusal(config) is None
    monkeypatch.cuda_feature_off("kimi-linear")
    why = MF.refusal(config)
    assert why and "VLLM_BI_CUDA_PREVIEW=kimi-linear" in why and "\n" not in why
