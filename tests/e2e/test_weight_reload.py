"""Weight sync groundwork: the trainer changes its weights in memory, exports an HF
checkpoint, the running BI server loads it in place (no restart), and the trainer's in-memory
model still reproduces the server's logprobs bit for bit."""

import pytest
import torch

from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
from vllm_bi.parity import trainer_logprobs
from vllm_bi.launcher import VllmServer, cpu_env

pytestmark = pytest.mark.server


def test_reload_in_place_keeps_trainer_parity(tiny_model_path, tmp_path):
    src = tiny_model_path("qwen3-next")
    model = QwenGDNForCausalLM.from_pretrained(src)
    ids = list(range(10, 90))
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(src, env=env, args=["--max-num-batched-tokens", "64"]) as srv:
        before = srv.complete(ids, max_tokens=12, temperature=1.0, seed=3)
        assert trainer_logprobs(model, [before])[0] == before.logprobs
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # stand-in for an optimizer step
            for p in model.parameters():
                if p.dtype == torch.bfloat16 and p.ndim >= 2:
                    p.copy_((p.float() * (1 + 0.05 * torch.randn(p.shape, generator=g))).to(p.dtype))
        srv.reload_weights(model.save_pretrained(str(tmp_path / "step1"), like=src))
        after = srv.complete(ids, max_tokens=12, temperature=1.0, seed=3)
    assert before.logprobs != after.logprobs, "the reload did not change the served model"
    assert trainer_logprobs(model, [after])[0] == after.logprobs
