"""``VLLM_BI_GEMM_CONFIGS=tune`` in a CUDA server: once the model is loaded, the Triton GEMM's tile table for this
device and the model's linear shapes (every linear layer and the LM head) is loaded from the cache, or made and
cached on the first start (:mod:`vllm_bi.ops.gemm_tune`: a shipped table's entries where it was made on this device,
the other shapes tuned), and installed before the first product. The worker's
``vllm_bi_info`` then names the table by its digest and carries its text, which a trainer installs (it never tunes).
"""

from __future__ import annotations

import functools
import json
import logging
import time

__all__ = ["wrap_load_model", "ensure_tuned_table"]

logger = logging.getLogger("vllm_bi")


def ensure_tuned_table(shapes: list[tuple[int, int]]) -> str:
    """This process's tuned table for ``shapes`` on its CUDA device: the cached file, or one made now and cached (the
    entries of a shipped table made on this device as they are, the other shapes tuned: a progress bar, then one log
    line), made this process's (:func:`vllm_bi.settings.use_tuned_table`) and installed. Returns its digest."""
    from vllm_bi.ops import gemm_tune as T
    from vllm_bi.ops.gemm_configs import install_gemm_configs
    from vllm_bi.settings import BUILTIN_GEMM_TABLES, current, use_tuned_table

    key = T.device_key(shapes)
    start = T.head_start(shapes, key["device"], BUILTIN_GEMM_TABLES)
    if start is not None:
        key = dict(key, head_start=start.name)  # another shipped table is another cache entry
    groups = T.to_tune(shapes, start)
    cache_dir = current().cache_root()

    def tune() -> dict:
        bench = None
        if groups:
            from tqdm import tqdm

            bench = T.PersistentGemmBench()
            bar = tqdm(total=sum(T.plan_size(group, block_ks=bks) for bks, group in groups), unit="tile",
                       desc="vllm_bi: tuning the Triton GEMM tiles (first start for this device and model)")
        try:
            res = T.tune_with_head_start(shapes, start, lambda group, bks: T.tune_shapes(
                group, bench.time_reference, bench.time_tiles, bench.product, block_ks=bks,
                tick=lambda: bar.update(1), done_shape=bench.done_shape))
        finally:
            if bench is not None:
                bar.close()
                bench.restore()
        if not res.entries:
            raise RuntimeError(f"vllm_bi: VLLM_BI_GEMM_CONFIGS=tune: no shape could be tuned ({res.failed}); set "
                               "VLLM_BI_GEMM_CONFIGS=vllm (vLLM's tiles) or a table file")
        meta = {"head_start": start.name} if start is not None else {}
        return T.table_doc(res, bench.arch if bench is not None else start.arch, device=key["device"],
                           command="VLLM_BI_GEMM_CONFIGS=tune", failed=[f"{n}x{k}: {why}" for n, k, why in res.failed],
                           **meta)

    t0 = time.perf_counter()
    path, tuned_s = T.cached_or_tuned(key, cache_dir, tune, waiting=lambda p: logger.info(
        "vllm_bi: another process on this machine is making the Triton GEMM tile table %s; waiting for it", p))
    digest = use_tuned_table(path)
    install_gemm_configs()
    with open(path) as f:
        n_shapes = len(json.load(f)["shapes"])
    taken = (f"; {len(start.entries)} taken from the shipped table {start.name.split(':')[0]}"
             if start is not None else "")
    if tuned_s is None:
        logger.info("vllm_bi: Triton GEMM tiles for %d shapes (table %s) loaded from the cache %s in %.1f s",
                    n_shapes, digest, path, time.perf_counter() - t0)
    else:
        logger.warning("vllm_bi: first start for this device, model and versions: Triton GEMM tiles for %d shapes in "
                       "%.0f s (table %s%s), cached at %s; later starts load it", n_shapes, tuned_s, digest, taken,
                       path)
    return digest


def wrap_load_model(orig):
    """``Worker.load_model``, then the tuned table for the loaded model (:func:`ensure_tuned_table`)."""

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from vllm_bi.ops.gemm_tune import model_shapes

        ensure_tuned_table(model_shapes(self.model_runner.get_model(), (LinearBase, ParallelLMHead)))
        return result

    return load_model
