"""Trainer-side model: loads each family from its HF checkpoint, and its gradients match an
independent float32 reference (HF transformers) — P5, whole model.

Tolerance (bf16 forward vs an fp32 reference, one 48-token sequence, loss = mean NLL):
every parameter tensor's gradient has cosine similarity >= 0.995 with the reference and relative
L2 error <= 6%; per-head gating vectors with < 16 elements (A_log, dt_bias): cos >= 0.99, rel <= 15%.
Measured (2026-11-29): qwen3-next worst cos 0.9997 / rel 2.4%; qwen3.5-moe layer-0 A_log cos 0.998 /
rel 10% (2 elements, a sum over all tokens of bf16-noisy terms; MoE routing flips add to it).
"""

import os

import pytest
import torch

from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

FAMILIES = ["qwen3-next", "qwen3.5", "qwen3.5-moe"]


def _hf_grads(path, ids):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    hf = getattr(transformers, cfg.architectures[0]).from_pretrained(path, dtype=torch.float32)
    lp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
    (-lp.mean()).backward()
    return {n: p.grad for n, p in hf.named_parameters()}, (-lp.mean()).item()


def _ours_to_hf(name: str, grads: dict, grad: torch.Tensor):
    """Yield (hf name, our gradient slice) pairs for one of our parameters."""
    if name.endswith("mlp.w13") or name.endswith("mlp.w2"):
        # transformers keeps experts fused in memory: gate_up_proj [E, 2I, D], down_proj [E, D, I]
        layer = name.split(".")[1]
        hf = "gate_up_proj" if name.endswith("w13") else "down_proj"
        for e in range(grad.shape[0]):
            yield (f"model.layers.{layer}.mlp.experts.{hf}", e), grad[e]
        return
    base = name if name.startswith("lm_head") else "model." + name
    for cand in (base, base + ".weight"):
        if cand in grads:
            yield cand, grad
            return
    raise KeyError(f"no reference gradient for {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_float32_reference(family, tiny_model_path):
    path = tiny_model_path(family)
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (48,))
    model = QwenGDNForCausalLM.from_pretrained(path)
    loss = -model.token_logprobs(ids, [0, 48])[:-1].mean()
    loss.backward()
    ref, ref_loss = _hf_grads(path, ids)
    assert abs(loss.item() - ref_loss) < 5e-3
    checked = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        for hf_name, g in _ours_to_hf(name, ref, p.grad):
            h = (ref[hf_name[0]][hf_name[1]] if isinstance(hf_name, tuple) else ref[hf_name]).double()
            g = g.double().reshape(h.shape)
            if h.norm() == 0:
                continue
            cos = torch.nn.functional.cosine_similarity(g.flatten(), h.flatten(), dim=0).item()
            rel = ((g - h).norm() / h.norm()).item()
            min_cos, max_rel = (0.995, 0.06) if h.numel() >= 16 else (0.99, 0.15)
            assert cos >= min_cos and rel <= max_rel, f"{family} {name} ({hf_name}): cos {cos:.5f}, rel {rel:.4f}"
            checked += 1
    assert checked >= 20


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not supported"):
        QwenGDNForCausalLM.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoint_round_trip(family, tiny_model_path, tmp_path):
    from safetensors.torch import load_file

    path = tiny_model_path(family)
    model = QwenGDNForCausalLM.from_pretrained(path)
    original = load_file(f"{path}/model.safetensors")
    exported = model.hf_state_dict()
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    out = model.save_pretrained(str(tmp_path / "export"), like=path)
    again = QwenGDNForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert os.path.exists(f"{out}/tokenizer.json") and os.path.exists(f"{out}/config.json")


def test_gdn_output_stays_packed_under_autograd(tiny_model_path, monkeypatch):
    """The trainer's GDN layers take ``gdn_varlen``'s packed output. Per-sequence slices of it would each cost the
    backward a zero tensor of the whole output's size: at 64 x 1K tokens that doubled a layer's training time on the
    H200 (docs/results/2026-12-01-h200-gdn-decode-gpu-time.md)."""
    from vllm_bi.models import qwen_gdn

    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs.get("packed", False))
        return real(*args, **kwargs)

    real = qwen_gdn.gdn_varlen
    monkeypatch.setattr(qwen_gdn, "gdn_varlen", recording)
    model = QwenGDNForCausalLM.from_pretrained(tiny_model_path("qwen3.5"))
    ids = torch.randint(3, 1000, (40,))
    (-model.token_logprobs(ids, [0, 13, 30, 40])[:-1].mean()).backward()
    assert calls and all(calls), f"gdn_varlen calls with packed={calls}"
