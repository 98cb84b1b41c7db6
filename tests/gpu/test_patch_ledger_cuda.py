"""The patch ledger's CUDA rows against a served model on the GPU: the vLLM attributes that differ from a pristine
import after a CUDA engine served a request are exactly the ledger's active CUDA rows (``tests/ledger_observer.py``;
the CPU test is ``tests/test_patch_ledger.py``), with the same negative controls."""

import pytest
import torch
from ledger_observer import check_ledger

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ledger_is_exactly_what_a_served_cuda_model_changed(tiny_model_path, tmp_path):
    check_ledger(tiny_model_path("qwen3.5-moe"), "cuda", tmp_path)
