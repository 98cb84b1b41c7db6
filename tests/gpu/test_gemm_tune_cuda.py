"""``VLLM_BI_GEMM_CONFIGS=tune`` on CUDA: the tuner with the real measurements (vLLM's persistent matmul against
cuBLAS) gives a table ``load_table`` accepts whose rows are equal in every batch size checked; a server started
with it tunes the model's shapes on its first start, the trainer takes its table and agrees bit for bit, and a
second start loads the cached file without tuning.

On the device: `scripts/gpu_run.sh pytest tests/gpu/test_gemm_tune_cuda.py ;` (a few minutes: two server starts,
the first one tuning).
"""

import glob
import hashlib
import json
import os

import pytest
from gpu_env import require_cuda_vllm_fla

pytestmark = [pytest.mark.gpu]

require_cuda_vllm_fla()

from vllm_bi import settings as S  # noqa: E402
from vllm_bi.ops import gemm_configs as G  # noqa: E402
from vllm_bi.ops import gemm_tune as T  # noqa: E402


def test_the_tuner_gives_a_loadable_table_of_bucket_invariant_tiles(tmp_path):
    bench = T.PersistentGemmBench(reps=1, rows=300)
    shapes = [(256, 512), (1024, 512), (64, 1024)]
    try:
        res = T.tune_shapes(shapes, bench.time_reference, bench.time_tiles, bench.product, buckets=(1, 64, 256),
                            block_ks=(64, 128), check_ms=(1, 3, 17, 100, 300), done_shape=bench.done_shape)
    finally:
        bench.restore()
    print(res.timings, res.rejected)
    assert res.failed == [] and sorted(res.entries) == sorted(shapes)
    assert res.entries[(256, 512)][0] == res.entries[(1024, 512)][0]  # one BLOCK_K per K
    path = tmp_path / "t.json"
    path.write_text(json.dumps(T.table_doc(res, bench.arch, device="test")))
    arch, table = G.load_table(str(path))
    assert arch == bench.arch and sorted(table) == sorted(shapes)


@pytest.mark.server
def test_a_tune_server_and_its_trainer_agree_and_a_second_start_loads_the_cache(tmp_path, monkeypatch):
    from vllm_bi.parity import run_parity
    from vllm_bi.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3.5", str(tmp_path / "qwen3.5"))
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    monkeypatch.setenv("VLLM_BI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(S, "_TUNED", None)
    S.reload()
    try:
        rep = run_parity(model, n=2, max_tokens=16, trainer_device="cuda", show_progress=False, log=print)
        print(rep.table())
        assert rep.ok, rep.table()
        (cached,) = glob.glob(str(tmp_path / "cache" / "gemm_tiles" / "*.json"))  # the server's tuned table
        with open(cached, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        assert S.tuned_table()[1] == digest  # the trainer runs the server's table
        stamp = os.stat(cached).st_mtime_ns
        monkeypatch.setattr(S, "_TUNED", None)
        rep = run_parity(model, n=2, max_tokens=16, trainer_device="cuda", show_progress=False, log=print)
        assert rep.ok, rep.table()
        assert os.stat(cached).st_mtime_ns == stamp and S.tuned_table()[1] == digest  # loaded, not tuned again
    finally:
        S.reload()
        G._installed.clear()
