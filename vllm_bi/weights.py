"""Layout-independent weight digests: do the server and the trainer hold the same weights?

vLLM stores a checkpoint's tensors in its own layout (fused ``qkv_proj``,
stacked expert weights, fp32 copies of bf16 tensors), the trainer in another
(HF names). A per-tensor checksum cannot compare the two. :func:`weight_digest`
groups the values by decoder layer (``layers.N.``; everything else is
``"other"``) and hashes each group's *multiset of values*: every value is
widened to float64 (exact for bf16/fp16/fp32), its bit pattern taken as a
64-bit integer and mixed (two splitmix64 finalisers), and the mixed words
summed modulo 2^64 — integer sums, so neither the order of the values nor the
order of the additions matters, and the same digest comes out on CPU and GPU.
Fusing, stacking, reshaping and widening do not change a group's digest; any
changed value, a missing or extra tensor, or a value rounded to another dtype
does. (Swapping two values inside one layer would not — the failure modes this
guards against are stale, partial or rounded loads.)

It runs in one pass on the GPU when there is one (a CPU sort of every value, the
first version, took minutes per push at Qwen3.5-9B dimensions under torchrun's
one thread per process). Under ``VLLM_BI_DIGEST=triton`` a bf16, fp16 or fp32
tensor hashed on CUDA takes one fused Triton kernel instead of torch's
elementwise kernels (:mod:`vllm_bi.ops.digest_triton`: one read of the values
and one sum brought to the host per tensor); it gives the torch path's sums
bit for bit, so the setting is not part of the arithmetic a server and its
trainer must share. The torch path is the CPU's and the reference.

The vLLM side runs :func:`weight_digest` on ``model.named_parameters()`` in
each worker (``vllm_bi_weight_digest`` over ``/collective_rpc``, installed by
the plugin); the trainer runs it on its HF-named state dict.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

__all__ = ["weight_digest", "digest_mismatches"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _group(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer{int(m.group(1)):03d}" if m else "other"


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_MASK64 = (1 << 64) - 1
_SALTS = (_signed(0x9E3779B97F4A7C15), _signed(0xD1B54A32D192ED03))
_MUL = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))
_CHUNK = 1 << 22  # values per pass: bounds the temporaries (32 MB each)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, wrapping modulo 2^64 like the unsigned original."""
    x = x ^ _shr(x, 30)
    x = x * _MUL[0]
    x = x ^ _shr(x, 27)
    x = x * _MUL[1]
    return x ^ _shr(x, 31)


def _hash_device(t: torch.Tensor) -> torch.device:
    if t.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _kernel_wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether values of ``dtype`` hashed on ``device`` take the fused kernel: a CUDA device, a dtype the kernel
    reads, and ``VLLM_BI_DIGEST`` resolving to ``triton`` there."""
    from vllm_bi.settings import current

    if device.type != "cuda" or current().digest_op("cuda") != "triton":
        return False
    from vllm_bi.ops.digest_triton import DTYPES

    return dtype in DTYPES


def _kernel_sums(flat: torch.Tensor, dev: torch.device) -> tuple[int, int]:
    """The fused kernel's two sums of the flat tensor ``flat`` on ``dev`` (a tensor elsewhere is copied over in
    chunks), added on ``dev`` and read once."""
    from vllm_bi.ops.digest_triton import mixed_sums

    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    step = max(flat.numel() if flat.device == dev else _CHUNK, 1)
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    for s in range(0, flat.numel(), step):
        acc += mixed_sums(flat[s : s + step].to(dev), _SALTS, _MUL)
    a, b = acc.tolist()
    return a & _MASK64, b & _MASK64


def _value_sums(t: torch.Tensor, device=None) -> tuple[int, int]:
    """The two sums (mod 2^64) of mixed value words of ``t``, computed on ``device`` (default: the GPU if there is
    one, else ``t``'s device); the same on every device and on either path (module doc)."""
    flat = t.detach().reshape(-1)
    dev = _hash_device(flat) if device is None else torch.device(device)
    if _kernel_wanted(flat.dtype, dev):
        return _kernel_sums(flat, dev)
    sums = [0, 0]
    for s in range(0, flat.numel(), _CHUNK):
        bits = flat[s : s + _CHUNK].to(dev).to(torch.float64).view(torch.int64)
        for k in (0, 1):
            sums[k] = (sums[k] + int(_mix(bits ^ _SALTS[k]).sum())) & _MASK64
    return sums[0], sums[1]


def weight_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{group: "<count>:<32 hex digits>"}`` over the values of ``named_tensors`` (see module doc)."""
    groups: dict[str, list[int]] = {}
    for name, t in named_tensors:
        if name.startswith("mtp.") or ".mtp." in name:
            continue
        a, b = _value_sums(t)
        acc = groups.setdefault(_group(name), [0, 0, 0])
        acc[0] += t.numel()
        acc[1] = (acc[1] + a) & _MASK64
        acc[2] = (acc[2] + b) & _MASK64
    return {g: f"{n}:{a:016x}{b:016x}" for g, (n, a, b) in sorted(groups.items())}


def digest_mismatches(server: dict[str, str], trainer: dict[str, str]) -> list[str]:
    """Groups whose digests differ (or exist on one side only), sorted."""
    return sorted(g for g in server.keys() | trainer.keys() if server.get(g) != trainer.get(g))
