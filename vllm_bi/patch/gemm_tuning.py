"""``VLLM_BI_GEMM_CONFIGS=tune`` in a CUDA server: once the model is loaded, the Triton GEMM's tile table for this
device and the model's linear shapes (every linear layer and the LM head) is loaded from the cache, or tuned and
cached on the first start (:mod:`vllm_bi.ops.gemm_tune`), and installed before the first product. The worker's
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
    """This process's tuned table for ``shapes`` on its CUDA device: the cached file, or one tuned now (a progress
    bar, then one log line), made this process's (:func:`vllm_bi.settings.use_tuned_table`) and installed.
    Returns its digest."""
    from vllm_bi.ops import gemm_tune as T
    from vllm_bi.ops.gemm_configs import install_gemm_configs
    from vllm_bi.settings import current, use_tuned_table

    key = T.device_key(shapes)
    cache_dir = current().cache_root()

    def tune() -> dict:
        from tqdm import tqdm

        bench = T.PersistentGemmBench()
        bar = tqdm(total=T.plan_size(shapes), unit="tile", desc="vllm_bi: tuning the Triton GEMM tiles (first start "
                   "for this device and model)")
        try:
            res = T.tune_shapes(shapes, bench.time_reference, bench.time_tiles, bench.product,
                                tick=lambda: bar.update(1), done_shape=bench.done_shape)
        finally:
            bar.close()
            bench.restore()
        if not res.entries:
            raise RuntimeError(f"vllm_bi: VLLM_BI_GEMM_CONFIGS=tune: no shape could be tuned ({res.failed}); set "
                               "VLLM_BI_GEMM_CONFIGS=vllm (vLLM's tiles) or a table file")
        return T.table_doc(res, bench.arch, device=key["device"], command="VLLM_BI_GEMM_CONFIGS=tune",
                           failed=[f"{n}x{k}: {why}" for n, k, why in res.failed])

    t0 = time.perf_counter()
    path, tuned_s = T.cached_or_tuned(key, cache_dir, tune)
    digest = use_tuned_table(path)
    install_gemm_configs()
    with open(path) as f:
        n_shapes = len(json.load(f)["shapes"])
    if tuned_s is None:
        logger.info("vllm_bi: Triton GEMM tiles for %d shapes (table %s) loaded from the cache %s in %.1f s",
                    n_shapes, digest, path, time.perf_counter() - t0)
    else:
        logger.warning("vllm_bi: first start for this device, model and versions: tuned the Triton GEMM tiles of %d "
                       "shapes in %.0f s (table %s), cached at %s; later starts load it", n_shapes, tuned_s, digest,
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
