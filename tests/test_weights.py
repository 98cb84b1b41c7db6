"""The layout-independent weight digest: what it sees, what it ignores, and its integer arithmetic checked
against numpy's unsigned 64-bit words (wrapping by definition)."""

import numpy as np
import torch

from vllm_bi import weights
from vllm_bi.weights import digest_mismatches, weight_digest


def _numpy_sums(t: torch.Tensor) -> tuple[int, int]:
    words = t.detach().reshape(-1).double().numpy().view(np.uint64)
    out = []
    for salt in (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03):
        x = words ^ np.uint64(salt)
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        out.append(int(x.sum(dtype=np.uint64)))
    return out[0], out[1]


def test_sums_equal_unsigned_reference_and_ignore_chunking(monkeypatch):
    torch.manual_seed(0)
    t = torch.randn(1000, 37).to(torch.bfloat16)
    t[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -1e30])
    with np.errstate(over="ignore"):
        ref = _numpy_sums(t)
    assert weights._value_sums(t) == ref
    monkeypatch.setattr(weights, "_CHUNK", 777)  # many passes, a ragged last one
    assert weights._value_sums(t) == ref


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.A_log": torch.randn(3, generator=g),
        "model.embed_tokens.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
    }


def test_layout_changes_keep_the_digest_and_value_changes_do_not():
    st = _state()
    base = weight_digest(st.items())
    assert set(base) == {"layer000", "layer001", "other"}
    # vLLM's layout: fused q|k, bf16 values held in fp32, another order, an mtp head that is skipped
    fused = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([st["model.layers.0.self_attn.k_proj.weight"],
                                                               st["model.layers.0.self_attn.q_proj.weight"]]).float(),
        "model.embed_tokens.weight": st["model.embed_tokens.weight"].t().contiguous(),
        "model.layers.1.mlp.A_log": st["model.layers.1.mlp.A_log"].flip(0),
        "mtp.layers.0.weight": torch.ones(3),
    }
    assert weight_digest(reversed(list(fused.items()))) == base
    changed = dict(st)
    w = st["model.layers.0.self_attn.k_proj.weight"].clone()
    w[1, 2] = w[1, 2] * 2
    changed["model.layers.0.self_attn.k_proj.weight"] = w
    assert digest_mismatches(base, weight_digest(changed.items())) == ["layer000"]
    rounded = dict(st, **{"model.layers.1.mlp.A_log": st["model.layers.1.mlp.A_log"].to(torch.bfloat16)})
    assert digest_mismatches(base, weight_digest(rounded.items())) == ["layer001"]
    missing = {k: v for k, v in st.items() if "embed" not in k}
    assert digest_mismatches(base, weight_digest(missing.items())) == ["other"]
