"""Plugin registration, refusal paths and the CPU console-script fix (no engine start needed, except one CLI run)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_bi.plugin import UnsupportedVllmVersion, check_vllm_version

PY = sys.executable


def _run(code: str, bi: bool, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1" if bi else "0")
    return subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def test_version_check():
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.1+cpu") == "0.32.1+cpu"
    for bad in ("0.31.2", "0.33.0", "1.0.0", "garbage"):
        with pytest.raises(UnsupportedVllmVersion, match=r"supports vLLM 0\.32\.x, but vLLM .* is installed"):
            check_vllm_version(bad)


def test_plugin_changes_nothing_without_batch_invariance():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.model_executor.layers.linear import UnquantizedLinearMethod as U\n"
        "from vllm_bi.patch import applied\n"
        "assert applied() == [], applied()\n"
        "assert U.apply.__module__ == 'vllm.model_executor.layers.linear', U.apply.__module__\n"
        "print('untouched')\n"
    )
    r = _run(code, bi=False)
    assert r.returncode == 0 and "untouched" in r.stdout, r.stderr[-3000:]


def test_plugin_loads_through_vllm_and_reports_gdn_invariance():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as E\n"
        "from vllm.v1.attention.selector import _cached_get_mamba_attn_backend\n"
        "from vllm_bi.patch import applied\n"
        "b = _cached_get_mamba_attn_backend(E.GDN_ATTN)\n"
        "assert b.__name__ == 'BIGDNAttentionBackend' and b.supports_batch_invariance()\n"
        "print(len(applied()))\n"
    )
    r = _run(code, bi=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.strip().splitlines()[-1]) >= 20


def test_stock_vllm_refuses_gdn_without_the_plugin_patch():
    """Negative control for the backend registration: vLLM's own GDN backend refuses BI."""
    code = (
        "import vllm.envs as envs\n"
        "from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as E\n"
        "from vllm.v1.attention.selector import _cached_get_mamba_attn_backend\n"
        "_cached_get_mamba_attn_backend(E.GDN_ATTN)\n"
    )
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1", VLLM_PLUGINS="none")
    r = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "not supported for GDN_ATTN" in r.stderr


# Engine configurations checked at start-up, all in one BI process (each case is EngineArgs(...).create_engine_config()
# for a tiny model; one vLLM import instead of one per case): (case, family, EngineArgs keywords).
CONFIG_CASES = [
    ("auto state cache", "qwen3-next", {}),
    ("bf16 state cache", "qwen3-next", {"mamba_ssm_cache_dtype": "bfloat16"}),
    ("speculative decoding, ngram", "qwen3-next",
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}}),
    ("speculative decoding with prefix caching", "qwen3-next",
     {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}, "enable_prefix_caching": True}),
    ("tp with expert parallelism", "qwen3-next", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("pipeline parallelism", "qwen3.5", {"pipeline_parallel_size": 2}),
    # other families' recurrent-state layers, refused at configuration (config.json only: no weights are read)
    ("Nemotron-H (Mamba2)", "config:NemotronHConfig", {}),
    ("LFM2 (short convolution)", "config:Lfm2Config", {}),
    ("Jamba (Mamba)", "config:JambaConfig", {}),
    ("control: Llama, attention only", "config:LlamaConfig", {}),
    # Kimi Linear on CPU: CPU_MLA (whose metadata the MLA forward wraps), chunked prefill and prefix caching kept
    ("kimi linear, split prefill and prefix caching", "kimi-linear",
     {"enable_prefix_caching": True, "max_num_batched_tokens": 32}),
    ("kimi linear, another attention backend", "kimi-linear", {"attention_backend": "CPU_ATTN"}),
    # last: from here on the process runs with VLLM_BI_GDN_STATE=bf16
    ("bf16 setting: auto state cache", "qwen3-next", {}),
    ("bf16 setting: float32 state cache", "qwen3-next", {"mamba_ssm_cache_dtype": "float32"}),
]
# small configs for the "config:" cases (the other fields keep transformers' defaults)
OTHER_FAMILIES = {
    "NemotronHConfig": {"num_hidden_layers": 2, "hybrid_override_pattern": "M*", "hidden_size": 256,
                        "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512},
    "Lfm2Config": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "hidden_size": 256,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2},
    "JambaConfig": {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "hidden_size": 256,
                    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_experts": 1, "mamba_d_state": 16},
    "LlamaConfig": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                    "num_attention_heads": 4, "num_key_value_heads": 2},
}


def _config_only_model(root: str, config_class: str, tokenizer_from: str) -> str:
    """A directory with ``config_class``'s small config (:data:`OTHER_FAMILIES`) and a tiny model's tokenizer."""
    import transformers

    path = os.path.join(root, config_class)
    os.makedirs(path, exist_ok=True)
    cfg = getattr(transformers, config_class)(vocab_size=1024, **OTHER_FAMILIES[config_class])
    cfg.architectures = [config_class.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(path)
    for f in os.listdir(tokenizer_from):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_from, f), path)
    return path


@pytest.fixture(scope="module")
def engine_configs(tiny_model_path, tmp_path_factory):
    """``{case: (accepted, detail)}``: detail is the refusal's message, or ``"<ssm cache dtype> <enforce_eager>"``."""
    root = str(tmp_path_factory.mktemp("other_families"))
    cases = [(name, _config_only_model(root, family[7:], tiny_model_path("qwen3-next")) if family.startswith("config:")
              else tiny_model_path(family), kw) for name, family, kw in CONFIG_CASES]
    code = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"for name, model, kw in {cases!r}:\n"
        "    if name.startswith('bf16 setting'):\n"
        "        import os, vllm_bi.settings\n"
        "        os.environ['VLLM_BI_GDN_STATE'] = 'bf16'\n"
        "        vllm_bi.settings.reload()\n"
        "    try:\n"
        "        c = EngineArgs(model=model, **kw).create_engine_config()\n"
        "        row = [name, True, f'{c.cache_config.mamba_ssm_cache_dtype} {c.model_config.enforce_eager}']\n"
        "        if name.startswith('kimi'):\n"
        "            s = c.scheduler_config\n"
        "            row[2] += (f' {c.attention_config.backend.name} {s.enable_chunked_prefill} '\n"
        "                       f'{c.cache_config.enable_prefix_caching} {s.max_num_batched_tokens}')\n"
        "    except Exception as e:\n"
        "        row = [name, False, f'{type(e).__name__}: {e}']\n"
        "    print('CASE ' + json.dumps(row), flush=True)\n"
    )
    r = _run(code, bi=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("CASE ")]
    return {name: (ok, detail) for name, ok, detail in rows}


def test_auto_state_cache_becomes_float32(engine_configs):
    assert engine_configs["auto state cache"] == (True, "float32 True")


def test_kimi_linear_keeps_split_prefill_and_prefix_caching_on_cpu_mla(engine_configs):
    """vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models; for Kimi Linear vllm_bi keeps
    them and the step's token budget, and serves with CPU_MLA (vLLM would take AMX_MLA on a CPU with AMX tiles,
    whose metadata the batch-invariant MLA forward does not read); another backend is refused with the fix."""
    assert engine_configs["kimi linear, split prefill and prefix caching"] == (True, "float32 True CPU_MLA True True 32")
    ok, detail = engine_configs["kimi linear, another attention backend"]
    assert not ok and "Drop --attention-backend or choose CPU_MLA" in detail, detail


def test_explicit_bf16_state_cache_is_refused(engine_configs):
    ok, detail = engine_configs["bf16 state cache"]
    assert not ok and "--mamba-ssm-cache-dtype float32" in detail and "'bfloat16'" in detail, detail


def test_bf16_state_setting_allocates_a_bf16_cache_and_refuses_float32(engine_configs):
    assert engine_configs["bf16 setting: auto state cache"] == (True, "bfloat16 True")
    ok, detail = engine_configs["bf16 setting: float32 state cache"]
    assert not ok and "--mamba-ssm-cache-dtype bfloat16" in detail and "VLLM_BI_GDN_STATE=bf16" in detail, detail


def test_speculative_decoding_other_than_mtp_or_with_prefix_caching_is_refused(engine_configs):
    ok, detail = engine_configs["speculative decoding, ngram"]
    assert not ok and "method 'ngram' is not supported under batch invariance" in detail, detail
    ok, detail = engine_configs["speculative decoding with prefix caching"]
    assert not ok and "drop --enable-prefix-caching or --speculative-config" in detail, detail


@pytest.mark.parametrize("case,message", [
    ("tp with expert parallelism",
     "tensor parallelism (--tensor-parallel-size 2) with MoE layers is batch-invariant on CPU without expert"),
    ("pipeline parallelism", "pipeline parallelism (--pipeline-parallel-size 2) is not verified"),
])
def test_unverified_parallelism_is_refused(engine_configs, case, message):
    ok, detail = engine_configs[case]
    assert not ok and message in detail, detail


@pytest.mark.parametrize("case,layer", [("Nemotron-H (Mamba2)", "MambaMixer2"),
                                        ("LFM2 (short convolution)", "ShortConv"), ("Jamba (Mamba)", "MambaMixer")])
def test_other_families_recurrent_layers_are_refused_at_configuration(engine_configs, case, layer):
    ok, detail = engine_configs[case]
    assert not ok and f"has {layer} layers" in detail and "without VLLM_BATCH_INVARIANT=1" in detail, detail
    ok, detail = engine_configs["control: Llama, attention only"]  # the check tells the families apart
    assert ok, detail


def test_audit_refuses_unknown_layers():
    from vllm_bi.patch.audit import UnsupportedLayerError, audit_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(UnsupportedLayerError, match=r"0 \(Linear\), 1 \(LayerNorm\)"):
        audit_model(model)
    assert audit_model(torch.nn.Sequential(torch.nn.Identity())) == {}


def test_vllm_console_script_works_on_the_cpu_build():
    exe = shutil.which("vllm", path=os.path.dirname(PY))
    assert exe, "the vllm console script is missing"
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("0.32")


def test_audit_accepts_a_kda_layer_only_with_vllm_bis_forward_and_its_norm_only_under_it():
    """A Kimi KDA layer passes the audit when its forward is ``bi_kda_forward``, and its ``o_norm``
    (``FusedRMSNormGated``, whose arithmetic that forward runs itself) only as that child; the same norm elsewhere,
    or under a KDA layer with stock's forward, is refused."""
    from vllm_bi.model_executor.gdn import bi_kda_forward
    from vllm_bi.patch.audit import UnsupportedLayerError, audit_model

    class FusedRMSNormGated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

    class KimiGatedDeltaNetAttention(torch.nn.Module):
        forward = bi_kda_forward

        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(2))
            self.o_norm = FusedRMSNormGated()

    class StockKDA(KimiGatedDeltaNetAttention):
        def forward(self, x):
            return x

    StockKDA.__name__ = "KimiGatedDeltaNetAttention"
    assert audit_model(torch.nn.ModuleDict({"attn": KimiGatedDeltaNetAttention()})) == {
        "KimiGatedDeltaNetAttention": 1, "FusedRMSNormGated": 1}
    with pytest.raises(UnsupportedLayerError, match=r"attn \(KimiGatedDeltaNetAttention: its forward is not"):
        audit_model(torch.nn.ModuleDict({"attn": StockKDA()}))
    with pytest.raises(UnsupportedLayerError, match=r"norm \(FusedRMSNormGated\)"):
        audit_model(torch.nn.ModuleDict({"norm": FusedRMSNormGated()}))
