"""Tuning the Triton GEMM's tiles (``VLLM_BI_GEMM=triton``) per weight shape ``(N, K)`` and bucket of ``M``, and the
on-disk cache of tuned tables (``VLLM_BI_GEMM_CONFIGS=tune``).

The algorithm (:func:`tune_shapes`) takes its measurements from injected functions, so it runs the same on a GPU
(:class:`PersistentGemmBench`: vLLM's batch-invariant persistent matmul, CUDA events) and in unit tests (fake
timings and products):

- ``time_reference(n, k, m)``: milliseconds of the reference product (cuBLAS), the score's denominator;
- ``time_tiles(n, k, m, block_k, tile)``: milliseconds with one ``tile = (BLOCK_M, BLOCK_N, warps, stages)`` and
  that ``BLOCK_K`` for every ``M``, or ``None`` when the candidate does not run (shared memory);
- ``product(n, k, block_k, m_buckets, m)``: the rows of the first ``m`` rows of one fixed input batch, computed with
  the whole shape config installed (``m_buckets = [(max M, tile), ...]``).

Selection, deterministic for given timings: per shape, per candidate ``BLOCK_K`` (:data:`BLOCK_KS`) and per bucket,
the candidates (:func:`candidates`) are ranked by ``(ms, tile)``; the ``BLOCK_K``'s score is the sum over buckets of
the best candidate's time relative to the reference. Per ``K``, the ``BLOCK_K`` that ran every bucket of every shape
with that ``K`` and has the least summed score (ties: the smaller ``BLOCK_K``) is every such shape's: one ``BLOCK_K``
per ``K`` (``gemm_configs``' module doc: a fused layer's columns must give its parts' bits). Then the
bucket-invariance check: the rows of a batch of ``M`` must be ``torch.equal`` to the same rows of the largest batch
(:data:`CHECK_MS` and every bucket bound), whatever bucket's tiles ``M`` takes. A bucket's candidate whose rows
differ is rejected and the next-fastest one tried; a shape whose bucket has no candidate left is left out of the
table (:attr:`TuneResult.failed`), so vLLM's lookup and ``consistent_tiles`` give it the reference config of its
``K`` or vLLM's default tile, both one tile for every ``M``.

A table (:func:`table_doc`) is the format-1 file :func:`vllm_bi.ops.gemm_configs.load_table` reads: every
``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` and warp count is a power of two, stages are 3 or 4, bucket bounds increase
and every shape with one ``K`` shares its ``BLOCK_K``.

The cache (:func:`cached_or_tuned`): one file per key under ``<cache dir>/gemm_tiles/``, the key naming the device
(name, compute capability), the versions of torch, Triton, vLLM and vllm_bi, the tuning plan (buckets, ``BLOCK_K``
candidates, :data:`TUNE_VERSION`) and the shape set. A file is written to a temporary name in the same folder and
moved into place with ``os.replace``, so a reader never sees half a table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable

__all__ = ["BUCKETS", "SERVER_BUCKETS", "BLOCK_KS", "CHECK_MS", "TUNE_VERSION", "candidates", "plan_size",
           "tune_shapes", "TuneResult", "table_doc", "cache_key", "cache_file", "write_text_atomic",
           "read_cached", "cached_or_tuned", "model_shapes", "cuda_ms", "PersistentGemmBench", "device_key",
           "save_received_table", "adopt_table", "HeadStart", "head_start", "to_tune",
           "tune_with_head_start"]

BUCKETS = (1, 4, 8, 16, 32, 64, 256, 512, 1024, 2048, 8192)  # the benchmark's default buckets of M
SERVER_BUCKETS = (1, 16, 64, 256, 1024, 8192)  # a server's first-start tuning (the shipped H200 table's buckets)
SERVER_REPS = 3
BLOCK_KS = (64, 128)
BLOCK_NS = (64, 128, 256)
WARPS = (4, 8)
STAGES = (3, 4)
CHECK_MS = (1, 2, 3, 5, 17, 100, 300, 1000, 3000)  # batch sizes whose rows are checked against the largest batch's
TUNE_VERSION = 1  # the algorithm and candidate set; part of the cache key
FOREVER = 1 << 30  # the bucket bound of a single-tile config

Tile = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, warps, stages


def _block_m(max_m: int) -> tuple[int, ...]:
    return (16,) if max_m <= 16 else (16, 32, 64) if max_m <= 64 else (64, 128)


def candidates(max_m: int) -> list[Tile]:
    """The tiles tried for a bucket of ``M`` up to ``max_m``: ``BLOCK_M`` by bucket, ``BLOCK_N`` 64/128/256, 4 or 8
    warps, 3 or 4 stages (all powers of two but the stages, as ``load_table`` requires)."""
    return [(bm, bn, w, s) for bm in _block_m(max_m) for bn in BLOCK_NS for w in WARPS for s in STAGES]


def plan_size(shapes: Iterable, buckets=SERVER_BUCKETS, block_ks=BLOCK_KS) -> int:
    """How many candidate timings :func:`tune_shapes` makes (a progress bar's total)."""
    return len(list(shapes)) * len(block_ks) * sum(len(candidates(m)) for m in buckets)


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune_shapes` chose. ``entries``: ``{(n, k): (block_k, [(max_m, tile), ...])}`` (the checked
    table); ``timings``: ``{(n, k): [(max_m, reference ms, tuned ms, tile), ...]}`` of the chosen candidates;
    ``rejected``: ``(n, k, max_m, tile)`` of every candidate whose rows changed with ``M``; ``failed``: ``(n, k,
    why)`` of the shapes left out."""

    entries: dict = dataclasses.field(default_factory=dict)
    timings: dict = dataclasses.field(default_factory=dict)
    rejected: list = dataclasses.field(default_factory=list)
    failed: list = dataclasses.field(default_factory=list)
    block_k: dict = dataclasses.field(default_factory=dict)  # K -> the BLOCK_K every shape with that K uses


def _rank(n, k, bk, buckets, time_tiles, tick) -> list[list[tuple[float, Tile]]] | None:
    """Per bucket, the candidates that ran, fastest first (ties: the smaller tile); None if a bucket had none."""
    ranked = []
    for m in buckets:
        runs = []
        for tile in candidates(m):
            ms = time_tiles(n, k, m, bk, tile)
            tick()
            if ms is not None:
                runs.append((float(ms), tile))
        if not runs:
            return None
        ranked.append(sorted(runs))
    return ranked


def _check_ms(buckets, check_ms) -> list[list[int]]:
    """The batch sizes checked in each bucket: the bucket bounds, the one above the previous bound and every
    :data:`CHECK_MS` in the bucket's range (the last bucket's range reaching the largest of them)."""
    top = max(max(buckets), max(check_ms))
    out, lo = [], 0
    for i, hi in enumerate(buckets):
        hi_ = top if i == len(buckets) - 1 else hi
        out.append(sorted({m for m in (*check_ms, *buckets, lo + 1, hi_) if lo < m <= hi_}))
        lo = hi
    return out


def _invariant_buckets(n, k, bk, buckets, ranked, check_ms, product, rejected) -> list | None:
    """The fastest tile per bucket whose rows equal the largest batch's (see the module doc); None if a bucket has
    no such tile. ``rejected`` collects the candidates that failed."""
    import torch

    chosen = [r[0][1] for r in ranked]
    ms_of = _check_ms(buckets, check_ms)
    top = ms_of[-1][-1]

    def config():
        return [(m, t) for m, t in zip(buckets, chosen)]

    full = None
    order = list(range(len(buckets)))
    for i in order[-1:] + order[:-1]:  # the last bucket first: its tile computes the largest batch
        for _, tile in ranked[i]:
            chosen[i] = tile
            if i == order[-1]:
                full = product(n, k, bk, config(), top)
            if all(torch.equal(product(n, k, bk, config(), m), full[:m]) for m in ms_of[i]):
                break
            rejected.append((n, k, buckets[i], tile))
        else:
            return None
    return config()


def tune_shapes(shapes: Iterable[tuple[int, int]], time_reference: Callable, time_tiles: Callable, product: Callable,
                buckets=SERVER_BUCKETS, block_ks=BLOCK_KS, check_ms=CHECK_MS, tick: Callable = lambda: None,
                done_shape: Callable = lambda n, k: None) -> TuneResult:
    """Choose and check a table for ``shapes`` (``(N, K)`` pairs) from the injected measurements (module doc).
    ``tick()`` is called after every candidate timing (:func:`plan_size` of them), ``done_shape(n, k)`` once a
    shape's measurements are no longer needed."""
    shapes = sorted(set((int(n), int(k)) for n, k in shapes))
    buckets = sorted(set(buckets))
    res = TuneResult()
    measured = {}  # (n, k) -> {block_k: (score, ranked)}
    for n, k in shapes:
        ref = {m: time_reference(n, k, m) for m in buckets}
        per_bk = {}
        for bk in block_ks:
            ranked = _rank(n, k, bk, buckets, time_tiles, tick)
            if ranked is not None:
                per_bk[bk] = (sum(r[0][0] / ref[m] for m, r in zip(buckets, ranked)), ranked, ref)
        measured[(n, k)] = per_bk
    for kk in sorted({k for _, k in shapes}):
        group = [measured[s] for s in shapes if s[1] == kk]
        ok = [bk for bk in block_ks if all(bk in g for g in group)]
        if ok:
            res.block_k[kk] = min(ok, key=lambda bk: (sum(g[bk][0] for g in group), bk))
    for n, k in shapes:
        if k not in res.block_k:
            res.failed.append((n, k, "no BLOCK_K ran every bucket"))
            done_shape(n, k)
            continue
        bk = res.block_k[k]
        _, ranked, ref = measured[(n, k)][bk]
        m_buckets = _invariant_buckets(n, k, bk, buckets, ranked, check_ms, product, res.rejected)
        done_shape(n, k)
        if m_buckets is None:
            res.failed.append((n, k, "rows differ by M with every candidate of a bucket"))
            continue
        res.entries[(n, k)] = (bk, m_buckets)
        res.timings[(n, k)] = [(m, ref[m], {t: x for x, t in runs}[tile], tile)
                               for (m, tile), runs in zip(m_buckets, ranked)]
    return res


def table_doc(result: TuneResult, arch: str, **meta) -> dict:
    """The format-1 table of ``result`` (``load_table``'s), ``meta`` (device, command, key, ...) beside it."""
    shapes = {f"{n}x{k}": {"block_k": bk, "m_buckets": [[m, *tile] for m, tile in buckets]}
              for (n, k), (bk, buckets) in sorted(result.entries.items())}
    return {"format": 1, "arch": arch, **meta, "shapes": shapes}


# ---------------------------------------------------------------------------------------------------- the cache
def cache_key(device: str, capability: tuple[int, int], versions: dict, shapes: Iterable[tuple[int, int]],
              buckets=SERVER_BUCKETS, block_ks=BLOCK_KS) -> dict:
    """What a cached table must have been tuned for: the device, the versions (torch, triton, vllm, vllm_bi), the
    tuning plan and the shape set."""
    return {"device": device, "capability": list(capability), "versions": dict(sorted(versions.items())),
            "tune_version": TUNE_VERSION, "buckets": list(buckets), "block_ks": list(block_ks),
            "shapes": [f"{n}x{k}" for n, k in sorted(set(shapes))]}


def cache_file(cache_dir: str, key: dict) -> str:
    """``<cache_dir>/gemm_tiles/<device>-<sha256 prefix of the key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key["device"]).strip("-").lower() or "device"
    return os.path.join(cache_dir, "gemm_tiles", f"{slug}-{digest}.json")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``: a reader sees the
    old file or the whole new one, never a part."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_cached(path: str, key: dict) -> bool:
    """Whether ``path`` holds a valid table (``load_table``) tuned for ``key``."""
    from vllm_bi.ops.gemm_configs import load_table

    try:
        with open(path) as f:
            doc = json.load(f)
        load_table(path)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("key") == key


def cached_or_tuned(key: dict, cache_dir: str, tune: Callable[[], dict],
                    waiting: Callable[[str], None] = lambda path: None) -> tuple[str, float | None]:
    """The cache file of ``key``: read when it holds a table for ``key``, else ``tune()``'s table (a format-1 dict;
    ``key`` is added) written there atomically. Returns ``(path, seconds tuning took, or None for a cache hit)``.
    Processes that start at once on one machine tune once: the first holds a lock file beside the table while it
    tunes, and the others wait for it (``waiting(path)`` is called first) and then read its table."""
    import fcntl
    import time

    path = cache_file(cache_dir, key)
    if read_cached(path, key):
        return path, None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if read_cached(path, key):  # written by the process this one waited for
                return path, None
            t0 = time.perf_counter()
            doc = tune()
            doc["key"] = key
            write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=False) + "\n")
            return path, time.perf_counter() - t0
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclasses.dataclass(frozen=True)
class HeadStart:
    """The entries a shipped table made on this device gives a model's shapes: ``name`` (the table's name and
    digest, part of the cache key), ``entries`` (``{(n, k): (block_k, [(max_m, tile), ...])}``, taken as they are)
    and ``block_k`` (``{K: BLOCK_K}`` of the table, which a tuned shape with that ``K`` must share)."""

    name: str
    arch: str
    entries: dict
    block_k: dict


def head_start(shapes: Iterable[tuple[int, int]], device: str, folder: str) -> HeadStart | None:
    """The first table in ``folder`` (by name) whose ``device`` is ``device`` and which holds one of ``shapes``, as a
    :class:`HeadStart`; None when there is none. A table made on another device is never taken: its tiles were timed
    there."""
    from vllm_bi.ops.gemm_configs import load_table
    from vllm_bi.settings import shipped_table_devices

    wanted = set((int(n), int(k)) for n, k in shapes)
    for name in [n for n, made_on in shipped_table_devices(folder).items() if made_on == device]:
        path = os.path.join(folder, name + ".json")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            arch, table = load_table(path)
        except (OSError, ValueError):
            continue
        entries = {s: (bk, [(m, tuple(t)) for m, *t in buckets]) for s, (bk, buckets) in table.items() if s in wanted}
        if entries:
            digest = hashlib.sha256(raw).hexdigest()[:16]
            return HeadStart(f"{name}:{digest}", arch, entries, {k: bk for (_, k), (bk, _) in table.items()})
    return None


def to_tune(shapes: Iterable[tuple[int, int]], start: HeadStart | None) -> list[tuple[tuple[int, ...], list]]:
    """The shapes the head start lacks, grouped by the ``BLOCK_K`` candidates they may take: ``[(block_ks,
    [(n, k), ...]), ...]`` (a ``K`` the head start has: its ``BLOCK_K`` only)."""
    have = start.entries if start is not None else {}
    groups: dict[tuple[int, ...], list] = {}
    for n, k in sorted(set((int(n), int(k)) for n, k in shapes)):
        if (n, k) in have:
            continue
        fixed = start.block_k.get(k) if start is not None else None
        groups.setdefault((fixed,) if fixed else tuple(BLOCK_KS), []).append((n, k))
    return sorted(groups.items())


def tune_with_head_start(shapes: Iterable[tuple[int, int]], start: HeadStart | None, tune: Callable) -> TuneResult:
    """A table for ``shapes``: the head start's entries as they are, the other shapes tuned by ``tune(shapes,
    block_ks)`` (:func:`tune_shapes` with the measurements bound), those of a ``K`` the head start has with its
    ``BLOCK_K`` only (one ``BLOCK_K`` per ``K`` across the table), the others with :data:`BLOCK_KS`."""
    shapes = sorted(set((int(n), int(k)) for n, k in shapes))
    res = TuneResult()
    if start is not None:
        res.entries.update({s: e for s, e in start.entries.items() if s in shapes})
        res.block_k.update({k: bk for (_, k), (bk, _) in res.entries.items()})
    for block_ks, group in to_tune(shapes, start):
        part = tune(group, block_ks)
        res.entries.update(part.entries)
        res.timings.update(part.timings)
        res.rejected += part.rejected
        res.failed += part.failed
        res.block_k.update(part.block_k)
    return res


def save_received_table(text: str, folder: str) -> str:
    """A table received from a server, written (atomically, byte for byte) to ``folder/<sha256 prefix>.json``:
    the local file a trainer installs. Returns the path; the file's digest is the sender's."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = os.path.join(folder, f"{digest}.json")
    write_text_atomic(path, text)
    return path


def model_shapes(model, classes: tuple) -> list[tuple[int, int]]:
    """The ``(N, K)`` of every 16-bit 2-D ``weight`` of the modules of ``model`` that are ``classes`` instances (the
    products the Triton GEMM runs: vLLM's linear layers and the LM head)."""
    import torch

    out = set()
    for mod in model.modules():
        w = getattr(mod, "weight", None) if isinstance(mod, classes) else None
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16):
            out.add((int(w.shape[0]), int(w.shape[1])))
    return sorted(out)


# ---------------------------------------------------------------------------------------------------- on the GPU
def cuda_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events) after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def device_key(shapes, buckets=SERVER_BUCKETS, block_ks=BLOCK_KS) -> dict:
    """:func:`cache_key` for this process's CUDA device and installed versions."""
    import torch
    import triton
    import vllm

    from vllm_bi import __version__

    versions = {"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm.__version__,
                "vllm_bi": __version__}
    return cache_key(torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()), versions, shapes,
                     buckets, block_ks)


class PersistentGemmBench:
    """The injected functions of :func:`tune_shapes` on this CUDA device: vLLM 0.32's batch-invariant persistent
    matmul with one shape's config installed in vLLM's table, against cuBLAS (``torch.mm``), on random bf16 weights
    and inputs. :meth:`restore` puts vLLM's own table back (call it when done)."""

    def __init__(self, reps: int = SERVER_REPS, rows: int | None = None, seed: int = 0):
        import torch
        from vllm.model_executor.determinism import batch_invariant_configs as C
        from vllm.platforms.interface import DeviceCapability

        self.torch, self.C, self.reps, self.seed = torch, C, reps, seed
        self.rows = rows or max(max(BUCKETS), max(CHECK_MS))
        self.arch = C._get_tuned_matmul_arch_family(DeviceCapability(*torch.cuda.get_device_capability()))
        if self.arch is None:
            raise RuntimeError(f"vLLM has no tuned-matmul arch family for {torch.cuda.get_device_name()}")
        self.table = C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.setdefault(self.arch, {})
        self.vllm_own = dict(self.table)
        self._data: dict = {}

    def _tensors(self, n, k):
        if (n, k) not in self._data:
            torch = self.torch
            g = torch.Generator(device="cuda").manual_seed(self.seed)
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            x = torch.randn(self.rows, k, device="cuda", generator=g).bfloat16()
            self._data = {(n, k): (w, x)}  # one shape's tensors at a time
        return self._data[(n, k)]

    def use(self, n, k, block_k, m_buckets) -> None:
        """Install one shape's config (``[(max M, tile), ...]``) in vLLM's lookup."""
        C = self.C
        self.table[(n, k)] = C._MatmulShapeConfig(block_k=block_k, m_buckets=tuple(
            (m, C._MatmulMConfig(*tile)) for m, tile in m_buckets))
        C._TUNED_MATMUL_CONFIGS_RESOLVED = False

    def default(self, n, k) -> None:
        """vLLM's own config for ``(n, k)`` (its table's, or its default tile)."""
        self.table.pop((n, k), None)
        if (n, k) in self.vllm_own:
            self.table[(n, k)] = self.vllm_own[(n, k)]
        self.C._TUNED_MATMUL_CONFIGS_RESOLVED = False

    def _mm(self, x, w):
        from vllm.model_executor.determinism.batch_invariant import matmul_persistent

        return matmul_persistent(x, w.t())

    def time_reference(self, n, k, m) -> float:
        w, x = self._tensors(n, k)
        return cuda_ms(lambda: self.torch.mm(x[:m], w.t()), self.reps)

    def time_default(self, n, k, m) -> float:
        w, x = self._tensors(n, k)
        self.default(n, k)
        return cuda_ms(lambda: self._mm(x[:m], w), self.reps)

    def time_tiles(self, n, k, m, block_k, tile) -> float | None:
        w, x = self._tensors(n, k)
        self.use(n, k, block_k, [(FOREVER, tile)])
        try:
            return cuda_ms(lambda: self._mm(x[:m], w), self.reps)
        except Exception:  # noqa: BLE001 - tiles that do not fit in shared memory
            self.torch.cuda.synchronize()
            return None
        finally:
            self.default(n, k)

    def product(self, n, k, block_k, m_buckets, m):
        w, x = self._tensors(n, k)
        self.use(n, k, block_k, m_buckets)
        try:
            return self._mm(x[:m], w)
        finally:
            self.default(n, k)

    def done_shape(self, n, k) -> None:
        self._data.clear()

    def restore(self) -> None:
        self._data.clear()
        self.table.clear()
        self.table.update(self.vllm_own)
        self.C._TUNED_MATMUL_CONFIGS_RESOLVED = False
        self.torch.cuda.empty_cache()


def adopt_table(text: str, folder: str) -> tuple[str, str]:
    """Make a table received from a server (its text) this process's under ``VLLM_BI_GEMM_CONFIGS=tune``: written
    byte for byte to ``folder`` (:func:`save_received_table`), checked (``load_table``) and taken
    (:func:`vllm_bi.settings.use_tuned_table`). Returns ``(path, digest)``; a bad table raises ``ValueError``."""
    from vllm_bi.ops.gemm_configs import load_table
    from vllm_bi.settings import use_tuned_table

    path = save_received_table(text, folder)
    load_table(path)
    return path, use_tuned_table(path)
