"""The patch ledger's CUDA rows against a served model on the GPU: the vLLM attributes that differ from a pristine
import after a CUDA engine served a request are exactly the ledger's active CUDA rows (``tests/ledger_observer.py``;
the CPU test is ``tests/test_patch_ledger.py``), with the same negative controls."""

import pytest
import torch
from ledger_observer import UNLISTED, compare, observe

from vllm_bi.patch.ledger import active_rows

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ledger_is_exactly_what_a_served_cuda_model_changed(tiny_model_path, tmp_path):
    observed, tampered, run = observe(tiny_model_path("qwen3.5-moe"), "cuda", tmp_path)
    listed = {p.target for p in active_rows("cuda")}
    assert set(run["active"]) == listed and set(run["applied"]) == listed
    unlisted, missing = compare(observed, listed)
    assert not unlisted and not missing, (
        f"vLLM attributes changed but not in the ledger: {unlisted}; ledger rows not applied: {missing}")
    unlisted, missing = compare(tampered, listed)
    assert unlisted == [UNLISTED] and missing == [run["reverted"]], (unlisted, missing)
