"""Layout-independent weight digests: do the server and the trainer hold the same weights?

vLLM stores a checkpoint's tensors in its own layout (fused ``qkv_proj``,
stacked expert weights, fp32 copies of bf16 tensors), the trainer in another
(HF names). A per-tensor checksum cannot compare the two. :func:`weight_digest`
groups the values by decoder layer (``layers.N.``; everything else is
``"other"``) and hashes each group's *sorted multiset of values*: every value
is widened to float64 (exact for bf16/fp16/fp32), its bit pattern taken as an
int64, the group sorted and SHA-256 hashed. Fusing, stacking, reshaping and
widening do not change a group's digest; any changed value, a missing or extra
tensor, or a value rounded to another dtype does. (Swapping two values inside
one layer would not — the failure modes this guards against are stale,
partial or rounded loads.)

The vLLM side runs :func:`weight_digest` on ``model.named_parameters()`` in
each worker (``vllm_bi_weight_digest`` over ``/collective_rpc``, installed by
the plugin); the trainer runs it on its HF-named state dict.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch

__all__ = ["weight_digest", "digest_mismatches"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _group(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer{int(m.group(1)):03d}" if m else "other"


def weight_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{group: "<count>:<sha256 prefix>"}`` over the values of ``named_tensors`` (see module doc)."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, t in named_tensors:
        if name.startswith("mtp.") or ".mtp." in name:
            continue
        bits = t.detach().to("cpu", torch.float64).reshape(-1).view(torch.int64)
        groups.setdefault(_group(name), []).append(bits)
    out = {}
    for g, parts in sorted(groups.items()):
        allbits = torch.sort(torch.cat(parts)).values
        out[g] = f"{allbits.numel()}:{hashlib.sha256(allbits.numpy().tobytes()).hexdigest()[:24]}"
    return out


def digest_mismatches(server: dict[str, str], trainer: dict[str, str]) -> list[str]:
    """Groups whose digests differ (or exist on one side only), sorted."""
    return sorted(g for g in server.keys() | trainer.keys() if server.get(g) != trainer.get(g))
