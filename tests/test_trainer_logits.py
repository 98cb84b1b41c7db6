"""``VLLM_BI_TRAINER_LOGITS``: the trainer's lm_head and log-softmax over the completion rows only give the logprobs
and entropy of all rows, bit for bit, on every model family of the op library; the gradients agree to fp32 rounding.
"""

import pytest
import torch

from vllm_bi import settings as S
from vllm_bi.models import from_pretrained

# prompts of different lengths (one token, a long one) and completions of different lengths, packed together
PAIRS = [([5, 9, 14, 3, 8, 21, 2, 11, 7, 30, 4], [12, 6, 19]), ([17], [3, 3, 25, 8, 1, 14]),
         ([2, 4, 6, 8, 10, 12, 14], [9])]


def _run(model, monkeypatch, rows: str, shift: int = 0):
    monkeypatch.setenv("VLLM_BI_TRAINER_LOGITS", rows)
    model.zero_grad(set_to_none=True)
    pairs = [(p[:len(p) - shift] if shift else p, c) for p, c in PAIRS]
    lps, ent = model.completion_logprobs(pairs, entropy=True)
    torch.cat(lps).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in lps], ent, grads


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next", "kimi-linear"])
def test_completion_rows_give_the_logprobs_of_all_rows(family, tiny_model_path, monkeypatch):
    model = from_pretrained(tiny_model_path(family))
    assert S.current().trainer_logits_rows("cpu") == S.Settings.from_env({}).trainer_logits_rows("cpu")
    all_lps, all_ent, all_grads = _run(model, monkeypatch, "all")
    lps, ent, grads = _run(model, monkeypatch, "completions")
    assert [lp.shape for lp in lps] == [(len(c),) for _, c in PAIRS]
    assert all(torch.equal(a, b) for a, b in zip(all_lps, lps)) and ent == all_ent
    # the gradients: fp32 sums of the same nonzero terms (the other rows add exact zeros), perhaps in another
    # order; tolerance: 1e-5 of each tensor's largest entry
    assert set(grads) == set(all_grads)
    for n, g in grads.items():
        scale = all_grads[n].abs().max().item() or 1.0
        assert (g - all_grads[n]).abs().max().item() <= 1e-5 * scale, n
    # the control: a prompt one token shorter moves every completion row, and the logprobs change
    moved, _, _ = _run(model, monkeypatch, "completions", shift=1)
    assert not all(torch.equal(a, b) for a, b in zip(all_lps, moved))


def test_auto_takes_the_completion_rows_on_cpu_and_the_cuda_choice_on_cuda(monkeypatch):
    auto = S.Settings.from_env({})
    assert auto.trainer_logits_rows("cpu") == "completions"
    assert auto.trainer_logits_rows("cuda") == S.TRAINER_LOGITS_AUTO_CUDA in ("all", "completions")
    assert S.Settings.from_env({"VLLM_BI_TRAINER_LOGITS": "all"}).trainer_logits_rows("cpu") == "all"
    with pytest.raises(ValueError, match="VLLM_BI_TRAINER_LOGITS"):
        S.Settings.from_env({"VLLM_BI_TRAINER_LOGITS": "some"})
