"""Rotary embedding: accuracy against float64, batch invariance, and the cos|sin table kept once per device."""

import torch

from vllm_bi.ops import rotary
from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache


def _reference(positions, x, head_size, rotary_dim, base, neox):
    """The rotation in float64 from first principles (angles ``p * base^(-2i/d)``)."""
    T = x.shape[0]
    x = x.double().view(T, -1, head_size)
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = positions.double()[:, None, None] * inv  # [T, 1, d/2]
    rot = x[..., :rotary_dim]
    if neox:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).flatten(-2)
    return torch.cat([out, x[..., rotary_dim:]], -1).reshape(T, -1)


def test_rotary_matches_float64_and_is_batch_invariant():
    torch.manual_seed(0)
    head, rdim, base = 64, 32, 10000.0
    table = rope_cos_sin_cache(rdim, 4096, base)
    pos = torch.randint(0, 4096, (37,))
    q = torch.randn(37, 4 * head, dtype=torch.bfloat16)
    k = torch.randn(37, 2 * head, dtype=torch.bfloat16)
    for neox in (True, False):
        qo, ko = apply_rotary(pos, q, k, table, head, rdim, neox)
        for got, x in ((qo, q), (ko, k)):
            ref = _reference(pos, x, head, rdim, base, neox)
            # fp32 math, one bf16 rounding: within 1 bf16 ulp (2^-8 relative) of the float64 rotation
            assert ((got.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()
        # a token's bits do not depend on the other tokens in the call
        for i in (0, 5, 36):
            qi, ki = apply_rotary(pos[i : i + 1], q[i : i + 1], k[i : i + 1], table, head, rdim, neox)
            assert torch.equal(qi, qo[i : i + 1]) and torch.equal(ki, ko[i : i + 1])


def test_table_is_built_once_and_kept_per_device(monkeypatch):
    rotary._CACHE.clear()
    host = rope_cos_sin_cache(16, 64, 500.0)
    assert rope_cos_sin_cache(16, 64, 500.0) is host
    assert rope_cos_sin_cache(16, 64, 500.0, torch.device("cpu")) is host  # the host's table is the host copy
    # another device gets one copy of the host table, made once (the GDN index helper's pinned copy on CUDA)
    copies = []

    def fake_host_to(t, device):
        copies.append(str(device))
        return t.clone()

    monkeypatch.setattr("vllm_bi.ops.device.host_to", fake_host_to)
    a = rope_cos_sin_cache(16, 64, 500.0, "meta")
    b = rope_cos_sin_cache(16, 64, 500.0, "meta")
    assert a is b and copies == ["meta"]
    assert torch.equal(a, host)
