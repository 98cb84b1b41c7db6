"""Host-built index tensors on the device: copied once per distinct layout, kept alive while a CUDA graph reads them.

Every GDN layer, the attention glue and the rotary table build small index tensors (offsets, rows, sequence ids)
on the host from the scheduler's step. The helpers here copy each through pinned memory without blocking the
stream, cache them by content (the layout is the same for every layer of a step), and keep those a captured CUDA
graph may replay alive for the process's life.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["host_to", "step_cached", "kept", "index_on", "rows_of"]


def host_to(t: torch.Tensor, device) -> torch.Tensor:
    """A host-built (index) tensor on ``device``. On CUDA it goes through pinned memory without blocking: a
    copy from pageable memory makes PyTorch synchronise the stream, which stops the host from queueing work
    ahead of the GPU (the GDN core makes several such copies per layer). Values are copied, never computed."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    pinned = t.pin_memory()
    out = pinned.to(device, non_blocking=True)
    if torch.cuda.is_current_stream_capturing():  # the graph replays this copy: its source must stay
        _CAPTURED.append(pinned)
    return out


def step_cached(md, key: str, dev, build):
    """``build()`` once per scheduler step: kept on the step's metadata object ``md`` (under ``key``, for ``dev``),
    which all layers of the step share, so the host reads the scheduler's device tensors once per step (each
    read synchronises the stream)."""
    cached = getattr(md, key, None)
    if cached is not None and cached[0] == dev:
        return cached[1]
    value = build()
    try:
        setattr(md, key, (dev, value))
    except AttributeError:  # a metadata class with __slots__: built per layer
        pass
    return value


# Tensors a captured CUDA graph reads (index tensors from the caches below, pinned sources of captured copies):
# a graph replays by address, so they must outlive the caches' evictions. Kept for the process's life.
_CAPTURED: list[torch.Tensor] = []


def kept(t: torch.Tensor) -> torch.Tensor:
    """``t``, kept alive for the process's life when a CUDA graph is being captured (it may read ``t``)."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        _CAPTURED.append(t)
    return t


# Index tensors are pure functions of the batch layout, which is the same for every GDN layer of a step (and
# often of the next step): they are built and copied once and then reused. Callers only read them.
_INDEX_CACHE = 64


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _index_on(values: tuple[int, ...], device: str) -> torch.Tensor:
    return host_to(torch.tensor(values, dtype=torch.long), device)


def index_on(values, device) -> torch.Tensor:
    """A short index vector (offsets, sequence ids) on ``device``, built once per distinct content (shared:
    read only)."""
    return kept(_index_on(tuple(int(v) for v in values), str(torch.device(device))))


@functools.lru_cache(maxsize=_INDEX_CACHE)
def _rows_of(ranges: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    lens = torch.tensor([e - s for s, e in ranges], dtype=torch.long)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.long)
    offsets = lens.cumsum(0) - lens
    rows = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - offsets, lens)
    return host_to(rows, device)


def rows_of(ranges: list[tuple[int, int]], device) -> torch.Tensor:
    """The row indices ``s..e-1`` of every range, concatenated (built and copied once per distinct layout;
    shared: read only)."""
    return kept(_rows_of(tuple((int(s), int(e)) for s, e in ranges), str(torch.device(device))))
