"""Rotary position embedding (elementwise per token: batch-invariant by construction)."""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rope_cos_sin_cache"]

_CACHE: dict = {}


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device=None) -> torch.Tensor:
    """``[max_position, rotary_dim]`` fp32 table of ``cos | sin`` (default RoPE), memoised, on ``device``
    (default: the host).

    The server and the trainer both take the table from here, so they rotate by the same bits. The table is
    computed once on the host and copied once to each device (it is large: 67 MB at 262144 positions and
    rotary dim 64, which a copy per layer and step would pay again, and which a CUDA-graph capture cannot
    copy from pageable memory).
    """
    key = (int(rotary_dim), int(max_position), float(base))
    if key not in _CACHE:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        freqs = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        _CACHE[key] = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32)
    if device is None or torch.device(device).type == "cpu":
        return _CACHE[key]
    on = (*key, str(torch.device(device)))
    if on not in _CACHE:
        from vllm_bi.ops.device import host_to

        _CACHE[on] = host_to(_CACHE[key], device)
    return _CACHE[on]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> torch.Tensor:
    # x: [T, heads, head_size]; cos/sin: [T, 1, rotary_dim // 2], fp32
    rot = x[..., :rotary_dim].float()
    if neox:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def apply_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``query [T, Hq*head_size]`` and ``key [T, Hk*head_size]`` by ``positions [T]``.

    ``cos_sin_cache [max_pos, rotary_dim]`` holds ``cos | sin`` halves (vLLM's layout).
    Math in fp32, one rounding to the input dtype.
    """
    positions = positions.flatten()
    if cos_sin_cache.device != positions.device:
        cos_sin_cache = cos_sin_cache.to(positions.device)
    cs = cos_sin_cache.index_select(0, positions).float()
    cos, sin = cs.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    T = positions.shape[0]
    q = _rotate(query.view(T, -1, head_size), cos, sin, rotary_dim, is_neox_style).reshape(query.shape)
    k = None
    if key is not None:
        k = _rotate(key.view(T, -1, head_size), cos, sin, rotary_dim, is_neox_style).reshape(key.shape)
    return q, k
