"""Replacement for vLLM's ``enable_batch_invariant_mode`` on CPU, and on CUDA in own-ops mode.

Stock vLLM registers Triton kernels for ``aten::mean.dim``, ``_log_softmax``,
``softmax``, ``_softmax``, ``bmm`` on ``current_platform.dispatch_key`` — the
CPU key on CPU, where Triton has no backend, so every ``x.mean(-1)`` raises
``'function' object is not subscriptable``. On CPU vllm_bi registers these
instead, each routed to the op library (row-wise reductions, exact GEMM),
plus ``sigmoid``/``silu`` through :mod:`vllm_bi.ops.pointwise` (stock CPU
kernels round the vectorised body and the scalar tail differently).

This is a safety net for code paths vllm_bi does not replace explicitly; the
replaced layers call :mod:`vllm_bi.ops` directly.
"""

from __future__ import annotations

import torch

from vllm_bi.ops import pointwise
from vllm_bi.ops.linear import bi_bmm
from vllm_bi.ops.reduce import row_sum
from vllm_bi.ops.softmax import log_softmax, softmax

__all__ = ["enable_cpu_batch_invariant_mode", "enable_cuda_own_ops_mode", "register_overrides", "is_enabled"]

_LIB: torch.library.Library | None = None


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    out_dtype = dtype or x.dtype
    if x.dim() == 0:  # a scalar's mean (over dim 0, -1 or none) is itself: e.g. a trainer's gathered loss
        return x.to(out_dtype, copy=True)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else sorted(d % x.dim() for d in dim)
    keep = [d for d in range(x.dim()) if d not in dims]
    xp = x.permute(*keep, *dims)
    lead = [x.shape[d] for d in keep]
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    flat = xp.reshape(*lead, -1)
    m = (row_sum(flat, acc) / flat.shape[-1]).squeeze(-1)
    if keepdim:
        shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
        m = m.reshape(shape)
    return m.to(out_dtype)


def _log_softmax(x, dim, half_to_float):
    return log_softmax(x, dim, torch.float32 if half_to_float else x.dtype)


def _softmax_int(x, dim, dtype=None):
    return softmax(x, dim, dtype)


def _softmax(x, dim, half_to_float):
    return softmax(x, dim, torch.float32 if half_to_float else x.dtype)


def _bmm(a, b):
    return bi_bmm(a, b, torch.promote_types(a.dtype, b.dtype))


def _bmm_out(a, b, *, out):
    out.copy_(_bmm(a, b))
    return out


def _sigmoid(x):
    return pointwise.sigmoid(x).to(x.dtype)


def _silu(x):
    return pointwise.silu(x).to(x.dtype)


def _sigmoid_(x):
    return x.copy_(_sigmoid(x))


def _silu_(x):
    return x.copy_(_silu(x))


def register_overrides(key: str) -> None:
    """Route ``mean.dim``, (log-)softmax, ``bmm``, ``sigmoid`` and ``silu`` on dispatch key ``key`` to the op
    library (idempotent). CPU: always under BI; CUDA: in ``VLLM_BI_CUDA_OPS=vllm_bi`` mode, instead of vLLM's
    own overrides, so that model code calling these directly computes what the trainer computes."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("aten::mean.dim", _mean_dim, key)
    lib.impl("aten::_log_softmax", _log_softmax, key)
    lib.impl("aten::softmax.int", _softmax_int, key)
    lib.impl("aten::_softmax", _softmax, key)
    lib.impl("aten::bmm", _bmm, key, allow_override=True)
    lib.impl("aten::bmm.out", _bmm_out, key, allow_override=True)
    # model code calls torch.sigmoid / F.silu directly (attention output gate, shared-expert gate)
    lib.impl("aten::sigmoid", _sigmoid, key)
    lib.impl("aten::silu", _silu, key)
    lib.impl("aten::sigmoid_", _sigmoid_, key)
    lib.impl("aten::silu_", _silu_, key)
    _LIB = lib


def enable_cpu_batch_invariant_mode() -> None:
    """Register the CPU overrides (idempotent)."""
    register_overrides("CPU")


def enable_cuda_own_ops_mode() -> None:
    """Replaces vLLM's ``enable_batch_invariant_mode`` on CUDA in own-ops mode: the op-library overrides on
    the CUDA key, and vLLM's Hopper cuBLAS settings (no split-K) for any GEMM left outside the op library."""
    import os

    from vllm_bi.ops.linear import NO_SPLIT_K_ENV

    os.environ.update(NO_SPLIT_K_ENV)
    register_overrides("CUDA")


def is_enabled() -> bool:
    return _LIB is not None
