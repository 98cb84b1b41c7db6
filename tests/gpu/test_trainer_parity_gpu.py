"""Trainer == server on CUDA (P4 on GPU): `vllm serve` with VLLM_BATCH_INVARIANT=1 and VLLM_BI_CUDA_OPS=vllm_bi
(the default: the server runs vllm_bi's op library, the trainer's ops), 8 prompts x 4 seeded samples in flight
at once with prompts split by --max-num-batched-tokens 64; every sampled token's logprob recomputed by the
trainer model on CUDA must be bitwise equal. A server on vLLM's own BI kernels (VLLM_BI_CUDA_OPS=vllm: batch-
invariant serving, 1/768 trainer tokens equal on the H200) is refused before sampling.

On the device: `scripts/gpu_run.sh install` (vLLM bundle), then `pytest -m gpu tests/gpu` (a few minutes).
"""

import pytest
from gpu_env import require_cuda_vllm_fla

pytestmark = [pytest.mark.gpu, pytest.mark.server]

require_cuda_vllm_fla()

from vllm_bi.parity import SettingsMismatch, run_parity  # noqa: E402
from vllm_bi.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("qwen3.5", str(tmp_path_factory.mktemp("m") / "qwen3.5"))


def test_trainer_equals_server_with_the_op_library_on_cuda(model, monkeypatch):
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm_bi")
    rep = run_parity(model, n=4, max_tokens=24, trainer_device="cuda", show_progress=False, log=print)
    print(rep.table())
    assert rep.tokens >= 8 * 4 * 20 and rep.ok, rep.table()


def test_a_server_on_vllms_own_kernels_is_refused(model, monkeypatch):
    # vLLM's own BI kernels: batch-invariant serving, but 1/768 trainer tokens equal on the H200; refused
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm")
    with pytest.raises(SettingsMismatch, match="VLLM_BI_CUDA_OPS=vllm"):
        run_parity(model, n=4, max_tokens=24, trainer_device="cuda", show_progress=False, log=print)
