"""Weight sync groundwork (issue 4): new weights loaded into a running BI server in place, and the
trainer model loaded from the same checkpoint still reproduces the server's logprobs bit for bit."""

import shutil

import pytest
import torch

from vllm_bi.model_executor.models.hybrid import GDNHybridForCausalLM
from vllm_bi.parity import trainer_logprobs
from vllm_bi.testing.server import VllmServer, cpu_env

pytestmark = pytest.mark.server


def _perturbed_copy(src: str, dst: str, seed: int = 5) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(f"{dst}/model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for k, t in w.items():
        if t.dtype == torch.bfloat16 and t.ndim == 2:
            w[k] = (t.float() * (1 + 0.05 * torch.randn(t.shape, generator=g))).to(torch.bfloat16)
    save_file(w, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


def test_reload_in_place_keeps_trainer_parity(tiny_model_path, tmp_path):
    src = tiny_model_path("qwen3-next")
    new = _perturbed_copy(src, str(tmp_path / "step1"))
    ids = list(range(10, 90))
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(src, env=env, args=["--max-num-batched-tokens", "64"]) as srv:
        before = srv.complete(ids, max_tokens=12, temperature=1.0, seed=3)
        srv.reload_weights(new)
        after = srv.complete(ids, max_tokens=12, temperature=1.0, seed=3)
    assert before.logprobs != after.logprobs, "the reload did not change the served model"
    assert trainer_logprobs(GDNHybridForCausalLM.from_pretrained(src), [before])[0] == before.logprobs
    assert trainer_logprobs(GDNHybridForCausalLM.from_pretrained(new), [after])[0] == after.logprobs
