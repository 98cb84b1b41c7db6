"""The patch ledger (``vllm_bi/patch/ledger.py``) is what is applied, and nothing else.

The served-model test compares the ledger's active rows with an independent observation: the vLLM attributes that
differ between a process that served a model under ``VLLM_BATCH_INVARIANT=1`` and a pristine import of the same
modules (``tests/ledger_observer.py``). Its negative controls: in the same served process, one unlisted attribute
replaced and one listed patch undone; the comparison must name both.
"""

import os

import pytest
from ledger_observer import check_ledger

from vllm_bi.patch.ledger import LEDGER, active_rows, ledger_table, resolve
from vllm_bi.settings import Settings

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_ledger_page_matches_the_ledger():
    with open(os.path.join(ROOT, "docs", "patches.md")) as f:
        assert f.read() == ledger_table(), "docs/patches.md is stale: python -m vllm_bi.patch.ledger --write docs/patches.md"


def test_every_row_names_a_vllm_symbol_and_a_replacement():
    """Static check of every row, CUDA rows included: the target's owner exists in this vLLM, and so does the
    replacement (a row for a class vLLM renamed would otherwise only fail at a server's start)."""
    import importlib
    import inspect

    from vllm_bi.patch.ledger import _split

    new_methods = {"vllm_bi_weight_digest", "vllm_bi_info", "vllm_bi_model_layout"}
    for p in LEDGER:
        assert p.platform in ("all", "cpu", "cuda") and p.why and p.how and p.upstream and p.remove_when, p
        module, parts, key = _split(p.target)
        owner = importlib.import_module(module)
        for name in parts[:-1]:
            owner = getattr(owner, name)
        if p.kind == "attr" and parts[-1] not in new_methods:
            inspect.getattr_static(owner, parts[-1])  # raises AttributeError for a stale row
        assert resolve(p.new) is not None
    targets = [(p.target, p.platform, p.when) for p in LEDGER]
    assert len(targets) == len(set(targets)), "a row is listed twice"


def test_rows_follow_the_settings(monkeypatch):
    """The settings decide which rows apply: the chunk GDN mode adds its rows (GDN's and KDA's state shapes; CUDA
    serves KDA in the recurrent mode only), the kimi-linear CUDA feature adds Kimi Linear's rows on CUDA and the
    speculative-one-token one Model Runner V2's row count, vLLM's own CUDA kernels swap the op-library rows for the
    norm fixes, the guard's rows go with the guard."""
    base = {p.target for p in active_rows("cpu", Settings())}
    chunk = {p.target for p in active_rows("cpu", Settings(gdn_mode="chunk"))}
    assert {t.split(":")[1] for t in chunk - base} == {"MambaStateShapeCalculator.gated_delta_net_state_shape",
                                                      "MambaStateShapeCalculator.kda_state_shape"}
    assert not base - chunk
    cuda_chunk = {p.target for p in active_rows("cuda", Settings(gdn_mode="chunk"))}
    cuda_base = {p.target for p in active_rows("cuda", Settings())}
    assert {t.split(":")[1] for t in cuda_chunk - cuda_base} == {"MambaStateShapeCalculator.gated_delta_net_state_shape"}
    unguarded = {p.target for p in active_rows("cpu", Settings(nonfinite_guard=False))}
    assert len(base - unguarded) == 4 and not unguarded - base
    # Kimi Linear's rows (KDA and MLA forwards, the MLA metadata, no low-latency GEMMs): always on CPU, on CUDA only
    # with the kimi-linear feature (a gated CUDA feature; VLLM_BI_CUDA_PREVIEW=kimi-linear where it is not)
    kimi = {p.target.split(":")[1] for p in LEDGER if p.when == "Kimi Linear on the device"}
    assert kimi == {"KimiGatedDeltaNetAttention.forward", "MultiHeadLatentAttention.forward",
                    "MLACommonMetadataBuilder.build", "enable_kimi_k3_low_latency_gemm"}
    from vllm_bi import settings

    assert "kimi-linear" in settings.CUDA_FEATURES
    assert {t.split(":")[1] for t in cuda_base if t.split(":")[1] in kimi} == kimi
    monkeypatch.cuda_feature_off("kimi-linear")
    cuda_no_kimi = {p.target for p in active_rows("cuda", Settings())}
    cuda_kimi = {p.target for p in active_rows("cuda", Settings(cuda_preview="kimi-linear"))}
    assert cuda_kimi == cuda_base
    assert {t.split(":")[1] for t in cuda_kimi - cuda_no_kimi} == kimi and not cuda_no_kimi - cuda_kimi
    assert {t.split(":")[1] for t in base if t.split(":")[1] in kimi} == kimi - {"enable_kimi_k3_low_latency_gemm"}
    # speculative decoding's verification row: on CUDA with its feature (a CUDA feature by default)
    spec_rows = {p.target for p in LEDGER if p.when == "speculative decoding on CUDA"}
    assert {t.split(":")[1] for t in spec_rows} == {"RejectionSampler.__call__"} and spec_rows <= cuda_base
    # one-token prompts under speculation on CUDA: Model Runner V2's row count, on CUDA with the speculative-one-token
    # feature (a gated CUDA feature: installed with no preview set), never on CPU; without the feature only with
    # VLLM_BI_CUDA_PREVIEW=speculative-one-token (or all)
    one_token = {p.target for p in LEDGER if p.when == "one-token prompts under speculation on CUDA"}
    assert {t.split(":")[1] for t in one_token} == {"MambaHybridModelState.prepare_attn"}
    assert "speculative-one-token" in settings.CUDA_FEATURES
    assert one_token <= cuda_base and one_token <= cuda_no_kimi and not one_token & base
    monkeypatch.delenv("VLLM_BI_CUDA_PREVIEW", raising=False)  # the suite's monkeypatch re-reads settings
    assert one_token <= {p.target for p in active_rows("cuda")}
    monkeypatch.cuda_feature_off("speculative-one-token")
    cuda_neither = {p.target for p in active_rows("cuda", Settings())}
    assert cuda_no_kimi - cuda_neither == one_token and not cuda_neither - cuda_no_kimi
    assert {p.target for p in active_rows("cuda", Settings(cuda_preview="speculative-one-token"))} == cuda_no_kimi
    assert {p.target for p in active_rows("cuda", Settings(cuda_preview="all"))} == cuda_base
    own = [p for p in active_rows("cuda", Settings()) if p.target.endswith("GemmaRMSNorm.forward_cuda")]
    theirs = [p for p in active_rows("cuda", Settings(cuda_ops="vllm")) if p.target.endswith("GemmaRMSNorm.forward_cuda")]
    assert [p.new for p in own] == ["vllm_bi.patch.cpu_layers:gemma_rms_forward"]
    assert [p.new for p in theirs] == ["vllm_bi.patch.cuda_ops:gemma_rms_forward_cuda"]


@pytest.mark.server
def test_ledger_is_exactly_what_a_served_model_changed(tiny_model_path, tmp_path):
    check_ledger(tiny_model_path("qwen3.5"), "cpu", tmp_path)


def test_an_on_import_row_applies_when_its_module_is_first_imported(tmp_path, monkeypatch):
    """A row of kind ``on_import`` whose module is not imported yet waits, and is applied right after vLLM (here: a
    module of this test) first imports it, before the importer goes on; its callback says when."""
    import sys

    from vllm_bi.patch import ledger as L

    (tmp_path / "vllm_bi_late_target.py").write_text("def f():\n    return 'stock'\n\n\nFIRST = f()\n")
    (tmp_path / "vllm_bi_late_new.py").write_text("def f():\n    return 'patched'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = L.Patch("vllm_bi_late_target:f", "all", "why", "how", "vllm_bi_late_new:f", kind="on_import")
    seen = []
    L.apply_row(row, monkeypatch.setattr, seen.append)
    assert seen == [] and "vllm_bi_late_target" not in sys.modules
    import vllm_bi_late_target as target

    assert seen == [row] and target.f() == "patched" and target.FIRST == "stock"
    assert "vllm_bi_late_target" not in L._AFTER_IMPORT.pending
    monkeypatch.delitem(sys.modules, "vllm_bi_late_target")
