"""Tuned tile configs for the Triton GEMM mode (``VLLM_BI_GEMM=triton``), per weight shape and batch-size bucket.

vLLM 0.32's batch-invariant persistent matmul picks its tiles from a table keyed by the weight's ``(N, K)``:
one ``BLOCK_K`` per shape and, per bucket of ``M`` (the rows of the batch), ``BLOCK_M``, ``BLOCK_N``, warps and
stages. A row's bits depend on the ``K`` loop only (``BLOCK_K`` and its order), so the other choices may follow
``M`` without changing them (checked on the GPU: ``tests/gpu/test_ops_cuda.py``, ``benchmarks/bi_gemm_tune.py``).
vLLM's table covers a few Qwen3-1.7B shapes; every other shape runs one default tile (128 x 128 x 64), which
leaves most of a GPU idle at small ``M`` and is 1.4-4.6x cuBLAS at Qwen3.5-9B's shapes on the H200.

``VLLM_BI_GEMM_CONFIGS=<file.json>`` adds a table made by ``benchmarks/bi_gemm_tune.py`` (format 1)::

    {"format": 1, "arch": "hopper", "device": "...", "command": "...",
     "shapes": {"12288x4096": {"block_k": 64, "m_buckets": [[1, 16, 128, 8, 3], [4, ...], ...]}}}

or names a table shipped with vllm_bi (``vllm_bi/ops/gemm_tiles/<name>.json``): ``h200-qwen3.5-9b`` holds
Qwen3.5-9B's six linear shapes tuned on an H200 (1.0-2.0x cuBLAS, rows equal in every batch size checked,
``docs/results/2026-11-30-h200-gemm-tiles-and-fsdp2-9b.md``); or is ``tune``: a table tuned on a server's first
start for its device and the served model's shapes (:mod:`.gemm_tune`, cached on disk; a trainer installs a copy of
its server's). In the file, ``"NxK"`` is the weight's shape and each bucket is ``[max M, BLOCK_M, BLOCK_N, warps,
stages]`` (the last bucket also serves larger ``M``). The tiles are part of the arithmetic of the trainer's forward
too: server and trainer must load the same table. :func:`table_digest` names it in ``vllm_bi_info``, and the trainer
refuses a server whose digest differs.

One ``BLOCK_K`` per ``K``: vLLM fuses layers the trainer runs apart (``gate_up`` = ``gate`` and ``up``, ``qkv``, GDN's
``in_proj_qkvz``), so the server's ``(2 I, H)`` product must give, column for column, the trainer's two ``(I, H)``
products. A column's bits depend on ``K``'s loop only, so it is enough that every shape with the same ``K`` uses the
same ``BLOCK_K``. vLLM's lookup does not promise that: on Hopper its Qwen3-1.7B shapes with ``K = 2048`` take 128
and every other ``K = 2048`` shape its default 64, and its Blackwell and sm120 tables mix 32, 64 and 128 for one
``K``. :func:`consistent_tiles`, called before every product, makes it so (a table file that mixes them is refused).
"""

from __future__ import annotations

import json

from vllm_bi.settings import BUILTIN_GEMM_TABLES as BUILTIN_DIR
from vllm_bi.settings import builtin_tables, current

__all__ = ["BUILTIN_DIR", "builtin_tables", "consistent_tiles", "install_gemm_configs", "load_table", "table_digest", "table_path"]

_installed: dict[str, str] = {}  # path -> digest of the table installed in this process
_user_shapes: set[tuple[int, int]] = set()  # (N, K) of the installed table file
_reference: dict | None = None  # K -> the shape config every (N, K) product uses, for the current device table


def table_path() -> str | None:
    """The table file ``VLLM_BI_GEMM_CONFIGS`` names (a path, or a shipped table's name), ``None`` when unset."""
    return current().gemm_table_path()


def table_digest() -> str:
    """A short name of the table this process uses: ``"none"`` (vLLM's own) or the file's sha256 prefix."""
    return current().gemm_tiles()


def _pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def load_table(path: str) -> tuple[str, dict[tuple[int, int], tuple[int, list[tuple[int, int, int, int, int]]]]]:
    """Read and check a table file: ``(arch, {(N, K): (block_k, [(max_m, block_m, block_n, warps, stages)])})``.
    Raises ``ValueError`` naming the file and the bad entry."""
    def bad(why: str) -> ValueError:
        return ValueError(f"VLLM_BI_GEMM_CONFIGS={path}: {why} (make the file with benchmarks/bi_gemm_tune.py)")

    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise bad(f"cannot read it as JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise bad("not a format-1 table")
    arch = doc.get("arch")
    if arch not in ("ada", "hopper", "blackwell", "sm120"):
        raise bad(f"unknown arch {arch!r} (ada, hopper, blackwell or sm120)")
    shapes = {}
    for key, entry in (doc.get("shapes") or {}).items():
        try:
            n, k = (int(v) for v in key.split("x"))
            block_k = entry["block_k"]
            buckets = [tuple(b) for b in entry["m_buckets"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise bad(f"shape {key!r}: expected \"NxK\": {{\"block_k\": ..., \"m_buckets\": [...]}}") from None
        if not _pow2(block_k) or not buckets:
            raise bad(f"shape {key}: block_k must be a power of two and m_buckets non-empty")
        last = 0
        for b in buckets:
            if len(b) != 5 or not all(isinstance(v, int) for v in b):
                raise bad(f"shape {key}: bucket {list(b)} is not [max M, BLOCK_M, BLOCK_N, warps, stages]")
            max_m, bm, bn, warps, stages = b
            if max_m <= last or not (_pow2(bm) and _pow2(bn) and _pow2(warps)) or stages < 1:
                raise bad(f"shape {key}: bucket {list(b)}: max M must increase; block sizes and warps powers of two")
            last = max_m
        shapes[(n, k)] = (block_k, buckets)
    if not shapes:
        raise bad("no shapes")
    per_k: dict[int, set[int]] = {}
    for (n, k), (block_k, _) in shapes.items():
        per_k.setdefault(k, set()).add(block_k)
    mixed = {k: sorted(v) for k, v in per_k.items() if len(v) > 1}
    if mixed:
        raise bad(f"shapes with the same K must share one block_k (a fused layer's columns must give the bits of "
                  f"its parts), got {mixed}")
    return arch, shapes


def install_gemm_configs() -> str:
    """Add ``VLLM_BI_GEMM_CONFIGS``'s table to vLLM's (idempotent per file). Returns :func:`table_digest`.
    Called before the Triton GEMM mode's first product, in the server and in the trainer alike."""
    path = table_path()
    if path is None:
        if current().tunes_table():
            raise RuntimeError("VLLM_BI_GEMM_CONFIGS=tune: this process has no tuned table yet: a server tunes (or "
                               "loads its cached table) when it loads the model, a trainer takes its server's "
                               "(vllm_bi_info) when it connects; connect to the server first or set "
                               "VLLM_BI_GEMM_CONFIGS to a table file")
        return "none"
    if path in _installed:
        return _installed[path]
    try:
        from vllm.model_executor.determinism import batch_invariant_configs as C

        shape_cls, m_cls = C._MatmulShapeConfig, C._MatmulMConfig
        tables = C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"VLLM_BI_GEMM_CONFIGS: this vLLM has no batch-invariant matmul config table ({e}); "
                           "vllm_bi supports vllm==0.32.0. Unset it.") from None
    arch, shapes = load_table(path)
    table = tables.setdefault(arch, {})
    for (n, k), (block_k, buckets) in shapes.items():
        table[(n, k)] = shape_cls(block_k=block_k, m_buckets=tuple(
            (max_m, m_cls(bm, bn, warps, stages)) for max_m, bm, bn, warps, stages in buckets))
    C._TUNED_MATMUL_CONFIGS_RESOLVED = False  # vLLM reads its table for this device again
    _user_shapes.update(shapes)
    global _reference
    _reference = None
    _installed[path] = table_digest()
    return _installed[path]


def consistent_tiles(n: int, k: int) -> None:
    """Make vLLM's lookup give the ``(n, k)`` product the ``BLOCK_K`` of every other shape with this ``k`` (see the
    module doc). On the first call for a device table, each ``K`` gets one reference config: the table file's for
    that ``K``, else vLLM's entry with the smallest ``BLOCK_K`` (ties: the smallest ``N``); a shape whose
    ``BLOCK_K`` differs takes the reference config whole (its tiles ran with that ``BLOCK_K`` on this GPU family).
    A shape missing from the table with a ``K`` that has a reference gets the reference too; one whose ``K`` has
    none keeps vLLM's default (``BLOCK_K`` 64 for every such shape). Deterministic, so server and trainer agree."""
    global _reference
    from vllm.model_executor.determinism import batch_invariant_configs as C

    if not C._TUNED_MATMUL_CONFIGS_RESOLVED:
        C.resolve_tuned_matmul_configs()
        _reference = None
    table = C._TUNED_MATMUL_CONFIGS_FOR_DEVICE
    if not table:
        return
    if _reference is None:
        by_k: dict[int, list[tuple[int, object]]] = {}
        for (nn, kk), cfg in sorted(table.items()):
            by_k.setdefault(kk, []).append((nn, cfg))
        ref = {}
        for kk, entries in by_k.items():
            mine = [cfg for nn, cfg in entries if (nn, kk) in _user_shapes]
            ref[kk] = mine[0] if mine else min(entries, key=lambda e: (e[1].block_k, e[0]))[1]
            for nn, cfg in entries:
                if cfg.block_k != ref[kk].block_k:
                    table[(nn, kk)] = ref[kk]
        _reference = ref
    if (n, k) not in table and k in _reference:
        table[(n, k)] = _reference[k]
