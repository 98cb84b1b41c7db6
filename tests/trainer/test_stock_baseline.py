"""The trainer's non-batch-invariant baseline (``--arithmetic stock``, ``vllm_bi.trainer.stock.StockModel``): the
loop's model interface on transformers' own model, for timing what batch invariance costs an RL step.

Its logprobs are checked against transformers' forward of each sequence alone within 2e-2 (bf16 logits: padding a
batch may change a few bits, which is the point of the baseline), its gradients flow, its weights keep the
checkpoint's names through a save and a reload, and its logprobs are not vllm_bi's (the control: the baseline
really runs other arithmetic)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from vllm_bi.trainer.stock import StockModel

PAIRS = [([5, 9, 11, 3], [7, 2, 8]), ([4, 6], [1, 1, 9, 12, 3]), ([13, 2, 2, 8, 1, 5], [10])]


def _alone(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model.hf(input_ids=ids).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    return lp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
def test_stock_model_logprobs_gradients_and_names(family, tiny_model_path, tmp_path):
    path = tiny_model_path(family)
    model = StockModel.from_pretrained(path)
    lps, ent = model.completion_logprobs(PAIRS, entropy=True)
    assert [len(x) for x in lps] == [len(c) for _, c in PAIRS] and ent > 0
    for (p, c), got in zip(PAIRS, lps):
        assert got.dtype == torch.float32 and torch.allclose(got.detach(), _alone(model, p, c), atol=2e-2)
    sum(x.sum() for x in lps).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)

    def tensors(d):
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}

    out = model.save_pretrained(str(tmp_path / "v1"), like=path, state_dict=model.hf_state_dict())
    base, saved = tensors(path), tensors(out)
    assert set(saved) == set(base)  # the checkpoint's own names, so the server reloads them
    with open(os.path.join(out, "config.json")) as f, open(os.path.join(path, "config.json")) as g:
        assert f.read() == g.read()  # the server's config, not transformers' rewrite of it
    back = StockModel.from_pretrained(out).hf_state_dict()
    state = model.hf_state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_stock_logprobs_are_not_vllm_bis(tiny_model_path):
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

    path = tiny_model_path("qwen3.5")
    with torch.no_grad():
        stock, _ = StockModel.from_pretrained(path).completion_logprobs(PAIRS)
        bi, _ = QwenGDNForCausalLM.from_pretrained(path).completion_logprobs(PAIRS)
    assert not all(torch.equal(a, b) for a, b in zip(stock, bi))


def test_stock_refuses_what_needs_vllm_bis_model():
    from vllm_bi.trainer.config import ConfigError, TrainerConfig

    with pytest.raises(ConfigError, match="recompute_at_sample_version|recompute-at-sample-version"):
        TrainerConfig(arithmetic="stock", recompute_at_sample_version=True).validate()
    assert TrainerConfig(arithmetic="stock").validate().arithmetic == "stock"
