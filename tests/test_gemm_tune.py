"""``VLLM_BI_GEMM_CONFIGS=tune`` (``vllm_bi.ops.gemm_tune``, ``vllm_bi.patch.gemm_tuning``): the tuner's choices from
fake timings (deterministic, one ``BLOCK_K`` per ``K``), the bucket-invariance check rejecting a candidate whose
rows change with ``M``, the on-disk cache (its key, atomic writes, hits without tuning), the setting, and the
trainer's side: it installs the server's table from ``vllm_bi_info`` and refuses a resumed run whose table differs.
All on CPU with fakes: no GPU, no vLLM engine."""

import hashlib
import json
import os

import pytest
import torch

from vllm_bi import settings as S
from vllm_bi.ops import gemm_tune as T
from vllm_bi.ops.gemm_configs import load_table

BUCKETS = (1, 16, 64)
CHECK = (1, 3, 17, 40)


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    """Every test starts without a tuned table and re-reads its environment."""
    monkeypatch.setattr(S, "_TUNED", None)
    for var in [v for v in os.environ if v.startswith("VLLM_BI_")]:
        monkeypatch.delenv(var)
    S.reload()
    yield
    S.reload()


def fake_ms(n, k, m, bk, tile):
    """A deterministic cost: BLOCK_K 64 is cheap for K = 64 shapes but dear for N = 128 alone; BLOCK_N 128 and 4
    warps are best; 3 stages slightly better than 4."""
    bm, bn, warps, stages = tile
    cost = 1.0 + abs(bn - 128) / 128 + (warps == 8) * 0.3 + (stages == 4) * 0.01 + abs(bm - min(m, 64)) / 256
    if k == 64:
        cost += {64: 0.0, 128: 0.2}[bk] if n != 128 else {64: 0.1, 128: 0.0}[bk]
    return cost


def plain_product(n, k, bk, m_buckets, m):
    """Small integers in float64: exact sums, so the rows do not depend on ``m`` (as CPU BLAS's would)."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randint(-8, 8, (n, k), generator=g).double()
    x = torch.randint(-8, 8, (max(max(BUCKETS), max(CHECK)), k), generator=g).double()
    return x[:m] @ w.t()


def tile_for(m_buckets, m):
    return next((t for mx, t in m_buckets if m <= mx), m_buckets[-1][1])


def tune(shapes, time_tiles=fake_ms, product=plain_product, **kw):
    return T.tune_shapes(shapes, lambda n, k, m: 1.0, time_tiles, product, buckets=BUCKETS, check_ms=CHECK, **kw)


def test_the_fastest_tiles_are_picked_with_one_block_k_per_k(tmp_path):
    shapes = [(256, 64), (128, 64), (512, 96)]
    ticks = []
    res = tune(shapes, tick=lambda: ticks.append(1))
    assert len(ticks) == T.plan_size(shapes, BUCKETS)
    # K = 64: BLOCK_K 64 costs 0.0 + 0.1 per bucket over the two shapes, 128 costs 0.2 + 0.0: 64 wins for both
    assert res.block_k == {64: 64, 96: 64}
    assert {s: e[0] for s, e in res.entries.items()} == {(128, 64): 64, (256, 64): 64, (512, 96): 64}
    for (n, k), (bk, m_buckets) in res.entries.items():
        assert [m for m, _ in m_buckets] == list(BUCKETS)
        for m, tile in m_buckets:  # the cheapest candidate of each bucket, and nothing was rejected
            assert tile == min(T.candidates(m), key=lambda t: (fake_ms(n, k, m, bk, t), t))
            assert tile[1:] == (128, 4, 3)
    assert res.rejected == [] and res.failed == []
    assert tune(shapes).entries == res.entries  # the same timings, the same table
    # the table is a format-1 file that load_table accepts, with every shape's buckets
    path = tmp_path / "t.json"
    path.write_text(json.dumps(T.table_doc(res, "hopper", device="fake")))
    arch, table = load_table(str(path))
    assert arch == "hopper" and sorted(table) == sorted(shapes)
    assert table[(512, 96)] == (64, [(m, *t) for m, t in res.entries[(512, 96)][1]])


def test_a_block_k_that_fails_a_bucket_of_one_shape_is_no_k_wide_choice():
    def ms(n, k, m, bk, tile):  # BLOCK_K 64 is the cheapest, but (256, 64) cannot run it at M <= 16
        if (n, bk) == (256, 64) and m == 16:
            return None
        return fake_ms(n, k, m, bk, tile) - (0.5 if bk == 64 else 0.0)

    res = tune([(256, 64), (128, 64)], time_tiles=ms)
    assert res.block_k == {64: 128} and {e[0] for e in res.entries.values()} == {128}
    none = tune([(256, 64)], time_tiles=lambda *a: None)  # nothing runs: the shape is left out, and said so
    assert none.entries == {} and none.failed == [(256, 64, "no BLOCK_K ran every bucket")]


BAD = (16, 128, 4, 3)  # the cheapest tile of the M <= 16 bucket under fake_ms


def varying_product(bad_tiles):
    """The plain product, but a tile in ``bad_tiles`` gives rows that depend on the batch size."""
    def product(n, k, bk, m_buckets, m):
        y = plain_product(n, k, bk, m_buckets, m)
        return y + m * 0.5 if tile_for(m_buckets, m) in bad_tiles else y
    return product


def test_a_candidate_whose_rows_change_with_m_is_rejected():
    assert min(T.candidates(16), key=lambda t: (fake_ms(512, 96, 16, 64, t), t)) == BAD
    res = tune([(512, 96)], product=varying_product({BAD}))
    bk, m_buckets = res.entries[(512, 96)]
    assert (512, 96, 16, BAD) in res.rejected
    # BAD also wins the M <= 1 bucket (BLOCK_M 16 is the only choice there): rejected there too
    assert (512, 96, 1, BAD) in res.rejected
    runner_up = sorted(T.candidates(16), key=lambda t: (fake_ms(512, 96, 16, bk, t), t))[1]
    assert dict(m_buckets)[16] == runner_up and BAD not in dict(m_buckets).values()
    assert res.failed == []
    # the control: the same timings with a product that does not vary keep BAD
    assert dict(tune([(512, 96)]).entries[(512, 96)][1])[16] == BAD


def test_a_largest_bucket_tile_that_varies_is_rejected_and_the_reference_recomputed():
    top = min(T.candidates(64), key=lambda t: (fake_ms(512, 96, 64, 64, t), t))
    res = tune([(512, 96)], product=varying_product({top}))
    assert (512, 96, 64, top) in res.rejected and dict(res.entries[(512, 96)][1])[64] != top


def test_a_shape_with_no_invariant_candidate_in_a_bucket_is_left_out():
    every = set(T.candidates(16))
    res = tune([(512, 96), (256, 64)], product=lambda n, k, bk, mb, m: varying_product(every if n == 512 else set())(
        n, k, bk, mb, m))
    assert (512, 96) not in res.entries and (256, 64) in res.entries
    assert res.failed == [(512, 96, "rows differ by M with every candidate of a bucket")]


def test_the_candidates_keep_load_tables_rules():
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    for m in T.SERVER_BUCKETS + T.BUCKETS:
        for bm, bn, warps, stages in T.candidates(m):
            assert pow2(bm) and pow2(bn) and pow2(warps) and stages >= 1
    assert all(pow2(bk) for bk in T.BLOCK_KS)


# ---------------------------------------------------------------------------------------------------- the cache
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "vllm": "0.32.0", "vllm_bi": "0.1"}


def key(**change):
    args = dict(device="NVIDIA H200", capability=(9, 0), versions=VERSIONS, shapes=[(256, 64), (512, 96)])
    args.update(change)
    return T.cache_key(**args)


def test_the_cache_key_names_device_versions_and_shapes(tmp_path):
    base = T.cache_file(str(tmp_path), key())
    assert base == T.cache_file(str(tmp_path), key(shapes=[(512, 96), (256, 64), (256, 64)]))  # a set of shapes
    assert os.path.dirname(base) == str(tmp_path / "gemm_tiles") and os.path.basename(base).startswith("nvidia-h200-")
    others = [key(device="NVIDIA H100"), key(capability=(9, 1)), key(shapes=[(256, 64)]),
              *(key(versions=dict(VERSIONS, **{name: "other"})) for name in VERSIONS)]
    paths = {T.cache_file(str(tmp_path), k) for k in others}
    assert base not in paths and len(paths) == len(others)


def small_table(entries=None):
    res = T.TuneResult(entries=entries or {(256, 64): (64, [(1, (16, 128, 4, 3)), (64, (64, 128, 4, 3))])})
    return T.table_doc(res, "hopper", device="fake")


def test_a_cached_table_is_loaded_without_tuning_and_a_new_key_tunes(tmp_path):
    calls = []

    def tuner():
        calls.append(1)
        return small_table()

    path, secs = T.cached_or_tuned(key(), str(tmp_path), tuner)
    assert calls == [1] and secs is not None and load_table(path)[1] == {(256, 64): (64, [(1, 16, 128, 4, 3),
                                                                                          (64, 64, 128, 4, 3)])}
    with open(path) as f:
        assert json.load(f)["key"] == key()
    again, secs = T.cached_or_tuned(key(), str(tmp_path), lambda: pytest.fail("a cache hit must not tune"))
    assert (again, secs) == (path, None)
    other, _ = T.cached_or_tuned(key(versions=dict(VERSIONS, vllm="0.33.0")), str(tmp_path), tuner)
    assert other != path and calls == [1, 1]
    with open(path, "w") as f:  # a truncated file (a crash of a writer that did not write atomically) is tuned anew
        f.write('{"format": 1, "arch": "hop')
    T.cached_or_tuned(key(), str(tmp_path), tuner)
    assert calls == [1, 1, 1] and T.read_cached(path, key())


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "d" / "t.json")
    T.write_text_atomic(path, "old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(T.os, "replace", crash)
    with pytest.raises(OSError):
        T.write_text_atomic(path, "new")
    with open(path) as f:
        assert f.read() == "old"
    assert os.listdir(tmp_path / "d") == ["t.json"]  # no temporary file left behind
    monkeypatch.undo()
    T.write_text_atomic(path, "new")
    with open(path) as f:
        assert f.read() == "new"


def test_model_shapes_are_the_16_bit_linear_weights():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1000, 32, dtype=torch.bfloat16))

    model = torch.nn.Sequential(torch.nn.Linear(32, 96, dtype=torch.bfloat16), torch.nn.Linear(96, 32).half(),
                                torch.nn.Linear(32, 32), Head(), torch.nn.Embedding(7, 32, dtype=torch.bfloat16))
    assert T.model_shapes(model, (torch.nn.Linear, Head)) == [(32, 96), (96, 32), (1000, 32)]


# ---------------------------------------------------------------------------------------------------- the setting
def test_the_tune_setting(monkeypatch, tmp_path):
    for raw in ("tune", " TUNE "):
        s = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": raw})
        assert s.gemm_configs == S.TUNE and s.source("gemm_configs") == "env"
    s = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "tune"})
    assert s.tunes_gemm("cuda") and not s.tunes_gemm("cpu")
    assert not S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "tune", "VLLM_BI_PRESET": "portable"}).tunes_gemm("cuda")
    assert s.arithmetic("cpu")["gemm_configs"] == "none"  # CPU: the float64 GEMM, no table (the server warns)
    assert s.arithmetic("cuda")["gemm_configs"] == S.TUNE_PENDING and s.gemm_table_path() is None
    assert S.Settings.from_env({}).gemm_configs == "auto" and not S.Settings.from_env({}).tunes_gemm("cuda")
    table = tmp_path / "t.json"
    table.write_text(json.dumps(small_table()))
    digest = S.use_tuned_table(str(table))
    assert digest == hashlib.sha256(table.read_bytes()).hexdigest()[:16]
    assert s.arithmetic("cuda")["gemm_configs"] == digest and s.gemm_table_path() == str(table)
    assert S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": str(table)}).gemm_tiles() == digest  # the same bits
    assert "VLLM_BI_CACHE_DIR" in S.settings_table() and "tune" in S.settings_table()


def test_the_cache_dir(tmp_path):
    s = S.Settings.from_env({})
    assert s.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "vllm_bi")
    assert s.cache_root({}) == os.path.join(os.path.expanduser("~"), ".cache", "vllm_bi")
    mine = S.Settings.from_env({"VLLM_BI_CACHE_DIR": str(tmp_path / "c")})
    assert mine.cache_root({"XDG_CACHE_HOME": "/elsewhere"}) == str(tmp_path / "c")


def test_a_trainer_under_tune_without_the_servers_table_refuses_to_multiply(monkeypatch):
    from vllm_bi.ops.gemm_configs import install_gemm_configs

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    S.reload()
    with pytest.raises(RuntimeError, match="no tuned table yet"):
        install_gemm_configs()


def test_the_ledger_row_applies_under_tune_on_cuda_only():
    from vllm_bi.patch.ledger import active_rows

    target = "vllm.v1.worker.gpu_worker:Worker.load_model"
    tune = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "tune"})
    assert target in [p.target for p in active_rows("cuda", tune)]
    assert target not in [p.target for p in active_rows("cpu", tune)]
    assert target not in [p.target for p in active_rows("cuda", S.Settings.from_env({}))]


class FakeBench:
    arch = "hopper"

    def __init__(self):
        FakeBench.made += 1

    def time_reference(self, n, k, m):
        return 1.0

    def time_tiles(self, n, k, m, bk, tile):
        return fake_ms(n, k, m, bk, tile)

    def product(self, n, k, bk, m_buckets, m):
        return plain_product(n, k, bk, m_buckets, m)

    def done_shape(self, n, k):
        pass

    def restore(self):
        pass


@pytest.fixture
def tune_server(monkeypatch, tmp_path):
    """A CUDA server's side under ``VLLM_BI_GEMM_CONFIGS=tune`` with fakes: the cache in ``tmp_path/cache``, the
    device key of :func:`key`, :class:`FakeBench` for the GPU, no shipped tables (a test may set
    ``S.BUILTIN_GEMM_TABLES``); vLLM's table for Hopper restored after. Yields ``(vLLM's configs module,
    gemm_configs, gemm_tuning)``."""
    C = pytest.importorskip("vllm.model_executor.determinism.batch_invariant_configs")
    from vllm_bi.ops import gemm_configs as G
    from vllm_bi.patch import gemm_tuning

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    monkeypatch.setenv("VLLM_BI_CACHE_DIR", str(tmp_path / "cache"))
    S.reload()
    monkeypatch.setattr(S, "BUILTIN_GEMM_TABLES", str(tmp_path / "no-shipped-tables"))
    monkeypatch.setattr(T, "device_key", lambda shapes: key(shapes=shapes))
    monkeypatch.setattr(T, "PersistentGemmBench", FakeBench)
    FakeBench.made = 0
    saved = dict(C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.get("hopper", {}))
    yield C, G, gemm_tuning
    C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"] = saved
    C._TUNED_MATMUL_CONFIGS_RESOLVED = False
    G._installed.clear()


def test_a_server_tunes_on_its_first_start_and_loads_the_cache_after(tune_server, monkeypatch, tmp_path, caplog):
    C, G, gemm_tuning = tune_server
    with caplog.at_level("INFO", logger="vllm_bi"):
        digest = gemm_tuning.ensure_tuned_table([(256, 64), (512, 96)])
    assert FakeBench.made == 1 and "first start" in caplog.text and str(tmp_path / "cache") in caplog.text
    assert "taken from the shipped table" not in caplog.text
    assert S.current().arithmetic("cuda")["gemm_configs"] == digest == G.table_digest()
    assert C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"][(512, 96)].block_k == 64  # installed
    caplog.clear()
    monkeypatch.setattr(S, "_TUNED", None)
    G._installed.clear()
    with caplog.at_level("INFO", logger="vllm_bi"):
        assert gemm_tuning.ensure_tuned_table([(512, 96), (256, 64)]) == digest
    assert FakeBench.made == 1 and "loaded from the cache" in caplog.text


# ---------------------------------------------------------------------------------------------------- the trainer
def server_info(tmp_path, tamper=False):
    """A tune server's vllm_bi_info: its arithmetic with its tuned table's digest, and the table's text."""
    text = json.dumps(small_table(), indent=1) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    info = dict(S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "tune"}).arithmetic("cuda"), device="cuda",
                gemm_configs="0" * 16 if tamper else digest, gemm_table=text)
    return info, text, digest


def test_the_trainer_installs_the_servers_table(monkeypatch, tmp_path):
    from vllm_bi.parity import adopt_server_tiles, settings_mismatch

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    S.reload()
    info, text, digest = server_info(tmp_path)
    assert settings_mismatch(info) is not None  # before: this process has no table
    path = adopt_server_tiles(info, str(tmp_path / "run" / "gemm_tiles"))
    with open(path, newline="") as f:
        assert f.read() == text  # byte for byte: the same digest
    assert S.tuned_table() == (path, digest) and settings_mismatch(info) is None
    assert S.current().gemm_table_path() == path


def test_a_table_whose_digest_is_not_the_servers_is_refused(monkeypatch, tmp_path):
    from vllm_bi.errors import MISMATCH
    from vllm_bi.parity import SettingsMismatch, adopt_server_tiles
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.server import check_server

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    S.reload()
    info, _, _ = server_info(tmp_path, tamper=True)
    with pytest.raises(SettingsMismatch, match="digest"):
        adopt_server_tiles(info, str(tmp_path))

    class Client:
        url = "http://fake"

        def weight_version(self):
            return 0

        def collective_rpc(self, method):
            assert method == "vllm_bi_info"
            return [info]

    with pytest.raises(TrainerError, match="digest") as e:
        check_server(Client(), False, str(tmp_path / "tiles"))
    assert e.value.exit_code == MISMATCH
    info.update(gemm_configs=server_info(tmp_path)[2])
    check_server(Client(), False, str(tmp_path / "tiles"))  # the right digest: accepted


def test_without_tune_nothing_is_taken_from_the_server(monkeypatch, tmp_path):
    from vllm_bi.parity import adopt_server_tiles

    info, _, _ = server_info(tmp_path)
    assert adopt_server_tiles(info, str(tmp_path / "t")) is None and S.tuned_table() is None
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    monkeypatch.setenv("VLLM_BI_PRESET", "portable")  # the float64 GEMM: no table either
    S.reload()
    assert adopt_server_tiles(info, str(tmp_path / "t")) is None and not os.path.exists(tmp_path / "t")


def test_every_trainer_rank_takes_the_first_ranks_table(monkeypatch, tmp_path):
    from vllm_bi.parity import adopt_server_tiles
    from vllm_bi.trainer.server import share_server_tiles, tiles_dir

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    S.reload()
    info, text, digest = server_info(tmp_path)
    adopt_server_tiles(info, tiles_dir(str(tmp_path / "main")))
    sent = []

    class Main:
        main = True

        def broadcast(self, obj):
            sent.append(obj)
            return obj

    share_server_tiles(Main(), str(tmp_path / "main"))
    assert sent == [text]
    monkeypatch.setattr(S, "_TUNED", None)

    class Other:
        main = False

        def broadcast(self, obj):
            assert obj is None
            return text

    share_server_tiles(Other(), str(tmp_path / "other"))
    assert S.tuned_table() == (os.path.join(tiles_dir(str(tmp_path / "other")), f"{digest}.json"), digest)


def test_a_resumed_run_whose_table_is_not_the_servers_now_is_refused(monkeypatch, tmp_path):
    from vllm_bi.errors import MISMATCH
    from vllm_bi.parity import adopt_server_tiles
    from vllm_bi.trainer.checkpoint import CHECKPOINT_FORMAT, check_resume_settings, check_resumed_settings
    from vllm_bi.trainer.errors import TrainerError
    from vllm_bi.trainer.server import tiles_dir

    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "tune")
    S.reload()
    run = str(tmp_path / "run")
    now = S.current().arithmetic("cuda")
    saved = dict(now, gemm_configs="a" * 16)
    check_resume_settings(run, saved, now)  # the table is not known before the server's is taken: not compared yet
    os.makedirs(os.path.join(run, "checkpoint"))
    with open(os.path.join(run, "checkpoint", "meta.json"), "w") as f:
        json.dump({"format": CHECKPOINT_FORMAT, "settings": saved}, f)
    check_resumed_settings(run, "cuda")  # still pending: nothing to compare
    os.makedirs(tiles_dir(run))
    open(os.path.join(tiles_dir(run), "a" * 16 + ".json"), "w").close()  # the run's copy of its old table
    info, _, digest = server_info(tmp_path)
    adopt_server_tiles(info, tiles_dir(run))
    with pytest.raises(TrainerError) as e:
        check_resumed_settings(run, "cuda:0")
    msg = str(e.value)
    assert e.value.exit_code == MISMATCH and "\n" not in msg and "a" * 16 in msg and digest in msg
    assert f"VLLM_BI_GEMM_CONFIGS={os.path.join(tiles_dir(run), 'a' * 16 + '.json')}" in msg
    assert "--resume false" in msg
    with open(os.path.join(run, "checkpoint", "meta.json"), "w") as f:  # the control: the run's table is the server's
        json.dump({"format": CHECKPOINT_FORMAT, "settings": dict(now, gemm_configs=digest)}, f)
    check_resumed_settings(run, "cuda")


# ---------------------------------------------------------------------------------------------- the head start
def shipped_dir(tmp_path, device="NVIDIA H200", entries=None):
    """A folder of shipped tables: one made on ``device`` for (256, 64) with BLOCK_K 128, one for another device."""
    folder = tmp_path / "shipped"
    folder.mkdir(exist_ok=True)
    mine = T.TuneResult(entries=entries or {(256, 64): (128, [(1, (16, 64, 4, 3)), (64, (64, 64, 8, 4))])})
    (folder / "a-mine.json").write_text(json.dumps(T.table_doc(mine, "hopper", device=device)))
    other = T.TuneResult(entries={(512, 96): (64, [(64, (32, 256, 4, 3))])})
    (folder / "b-other.json").write_text(json.dumps(T.table_doc(other, "hopper", device="NVIDIA B200")))
    (folder / "notes.txt").write_text("not a table")
    return folder


def test_a_shipped_table_made_on_this_device_is_a_head_start(tmp_path):
    """The entries of a shipped table whose device is this one are taken as they are; the model's other shapes are
    tuned, those of a ``K`` the table has with its ``BLOCK_K`` only (the fake timings prefer 64 for ``K = 64``, so
    the free choice would differ); a table made on another device gives nothing (its (512, 96) is tuned here)."""
    folder = shipped_dir(tmp_path)
    shapes = [(256, 64), (512, 96), (1024, 64)]
    start = T.head_start(shapes, "NVIDIA H200", str(folder))
    assert start.name.startswith("a-mine:") and set(start.entries) == {(256, 64)} and start.block_k == {64: 128}
    assert T.to_tune(shapes, start) == [((64, 128), [(512, 96)]), ((128,), [(1024, 64)])]
    seen = []

    def tuner(group, block_ks):
        seen.append((group, block_ks))
        return tune(group, block_ks=block_ks)

    res = T.tune_with_head_start(shapes, start, tuner)
    assert seen == [([(512, 96)], (64, 128)), ([(1024, 64)], (128,))]
    assert res.entries[(256, 64)] == start.entries[(256, 64)]
    assert res.entries[(1024, 64)][0] == 128 and res.block_k[64] == 128
    assert tune([(1024, 64)]).entries[(1024, 64)][0] == 64  # without the head start K = 64 would take 64
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(T.table_doc(res, "hopper", device="NVIDIA H200")))
    assert set(load_table(str(path))[1]) == set(shapes)  # one BLOCK_K per K holds across the merged table
    # control: no table made on this device, or none with one of the shapes
    assert T.head_start(shapes, "NVIDIA H100 80GB HBM3", str(folder)) is None
    assert T.head_start([(8, 8)], "NVIDIA H200", str(folder)) is None
    assert T.head_start(shapes, "NVIDIA H200", str(tmp_path / "missing")) is None
    assert T.to_tune(shapes, None) == [((64, 128), [(256, 64), (512, 96), (1024, 64)])]


def test_a_server_takes_a_shipped_table_covering_its_shapes_without_tuning(tune_server, monkeypatch, tmp_path,
                                                                           caplog):
    """Every shape in a shipped table made on this device: no benchmark is made, the table's entries are this
    server's (a cache entry keyed by the shipped table too), and the one log line says where they came from."""
    C, _, gemm_tuning = tune_server
    folder = shipped_dir(tmp_path, entries={(256, 64): (64, [(1, (16, 128, 4, 3))]),
                                            (512, 96): (64, [(64, (32, 64, 4, 3))])})
    monkeypatch.setattr(S, "BUILTIN_GEMM_TABLES", str(folder))
    with caplog.at_level("INFO", logger="vllm_bi"):
        digest = gemm_tuning.ensure_tuned_table([(256, 64), (512, 96)])
    assert FakeBench.made == 0 and "taken from the shipped table a-mine" in caplog.text
    assert S.current().arithmetic("cuda")["gemm_configs"] == digest
    with open(S.tuned_table()[0]) as f:
        doc = json.load(f)
    assert doc["key"]["head_start"].startswith("a-mine:") and doc["head_start"] == doc["key"]["head_start"]
    assert C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"][(512, 96)].block_k == 64  # installed


def test_a_server_tunes_only_what_the_shipped_table_lacks(tune_server, monkeypatch, tmp_path, caplog):
    """A shipped table made on this device with one of two shapes of one ``K``: the server benchmarks once, for the
    other shape, under the table's ``BLOCK_K``, and its table holds both."""
    _, _, gemm_tuning = tune_server
    monkeypatch.setattr(S, "BUILTIN_GEMM_TABLES", str(shipped_dir(tmp_path)))
    with caplog.at_level("INFO", logger="vllm_bi"):
        gemm_tuning.ensure_tuned_table([(256, 64), (1024, 64)])
    assert FakeBench.made == 1 and "1 taken from the shipped table a-mine" in caplog.text
    assert load_table(S.tuned_table()[0])[1][(1024, 64)][0] == 128 == load_table(S.tuned_table()[0])[1][(256, 64)][0]


def test_processes_starting_at_once_tune_once(tmp_path):
    """Two first starts of one key at the same time: one tunes while holding the lock, the other waits and reads its
    table (control: without the lock file both would tune, as the second finds no table when it starts)."""
    import threading
    import time

    calls, waited, paths = [], [], []

    def tuner():
        calls.append(1)
        time.sleep(0.5)
        return small_table()

    def start():
        paths.append(T.cached_or_tuned(key(), str(tmp_path), tuner, waiting=waited.append)[0])

    threads = [threading.Thread(target=start) for _ in range(2)]
    threads[0].start()
    time.sleep(0.1)
    assert not T.read_cached(T.cache_file(str(tmp_path), key()), key())  # the second starts before a table exists
    threads[1].start()
    for t in threads:
        t.join()
    assert calls == [1] and len(waited) == 1 and paths[0] == paths[1]


def test_auto_tunes_where_the_auto_table_is_tune(monkeypatch):
    """``GEMM_CONFIGS_AUTO_CUDA``: ``shipped`` (auto names the default shipped table on every card), ``card`` (the
    shipped table of the card) or ``tune`` (auto tunes on CUDA as ``tune`` does, CPU untouched); an explicit table
    name or ``vllm`` is kept either way."""
    assert S.GEMM_CONFIGS_AUTO_CUDA in ("shipped", S.CARD, S.TUNE)
    monkeypatch.setattr(S, "cuda_device_name", lambda: "NVIDIA H100 80GB HBM3")
    tiles = {name: S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": name}).gemm_tiles() for name in S.builtin_tables()}
    monkeypatch.setattr(S, "GEMM_CONFIGS_AUTO_CUDA", "shipped")
    auto = S.Settings.from_env({})  # a settings object resolves its table once: one per constant
    assert not auto.tunes_gemm("cuda") and auto.gemm_tiles() == tiles[S.DEFAULT_GEMM_TABLE]
    assert auto.gemm_table_name() == S.DEFAULT_GEMM_TABLE
    monkeypatch.setattr(S, "GEMM_CONFIGS_AUTO_CUDA", S.CARD)
    auto = S.Settings.from_env({})
    assert auto.gemm_tiles() == tiles["h100-qwen3.5-9b"] != tiles[S.DEFAULT_GEMM_TABLE]
    assert auto.gemm_table_name() == "h100-qwen3.5-9b"
    monkeypatch.setattr(S, "GEMM_CONFIGS_AUTO_CUDA", S.TUNE)
    auto = S.Settings.from_env({})
    assert auto.tunes_gemm("cuda") and not auto.tunes_gemm("cpu") and auto.gemm_table_name() == S.TUNE
    assert auto.arithmetic("cuda")["gemm_configs"] == S.TUNE_PENDING and auto.arithmetic("cpu")["gemm_configs"] == "none"
    named = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": S.DEFAULT_GEMM_TABLE})
    assert not named.tunes_gemm("cuda") and named.gemm_tiles() != S.TUNE_PENDING
    assert not S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "vllm"}).tunes_gemm("cuda")
    assert not S.Settings.from_env({"VLLM_BI_PRESET": "portable"}).tunes_gemm("cuda")  # float64 GEMM: no table


def test_card_names_the_shipped_table_made_on_this_card(monkeypatch):
    """``card`` (and ``auto`` under ``GEMM_CONFIGS_AUTO_CUDA = card``) takes the shipped table whose recorded device
    is this process's CUDA device: the H100 table on an H100, the H200 table on an H200, and the default table on a
    card without one and without CUDA (the controls). Its digest is that table's, so server and trainer on one card
    agree and an H100 and an H200 do not; the start-up line names the table. At most one shipped table per card."""
    monkeypatch.setattr(S, "GEMM_CONFIGS_AUTO_CUDA", S.CARD)
    digest = {name: S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": name}).gemm_tiles() for name in S.builtin_tables()}
    expect = {"NVIDIA H100 80GB HBM3": "h100-qwen3.5-9b", "NVIDIA H200": "h200-qwen3.5-9b",
              "NVIDIA A100-SXM4-80GB": S.DEFAULT_GEMM_TABLE, None: S.DEFAULT_GEMM_TABLE}
    for device, table in expect.items():
        monkeypatch.setattr(S, "cuda_device_name", lambda device=device: device)
        for value in ("auto", S.CARD):
            s = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": value})
            assert s.gemm_table_path() == os.path.join(S.BUILTIN_GEMM_TABLES, table + ".json"), (device, value)
            assert s.arithmetic("cuda")["gemm_configs"] == digest[table] and s.gemm_table_name() == table
        assert S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": "h200-qwen3.5-9b"}).gemm_table_name() == "h200-qwen3.5-9b"
    assert digest["h100-qwen3.5-9b"] != digest["h200-qwen3.5-9b"]
    made_on = [d for d in S.shipped_table_devices().values()]
    assert all(made_on) and len(set(made_on)) == len(made_on), made_on


def test_the_shipped_tables_are_the_head_starts_of_their_cards():
    """With the tables shipped in the package, a tuning server for Qwen3.5-9B's seven GEMM shapes (the lm_head
    included) tunes nothing on an H100 (its table has all seven) and only the lm_head on an H200, with the ``BLOCK_K``
    of that table's ``K`` = 4096; a card without a shipped table tunes all seven with every ``BLOCK_K``."""
    from vllm_bi.settings import BUILTIN_GEMM_TABLES

    shapes = [(10240, 4096), (4096, 4096), (12288, 4096), (64, 4096), (24576, 4096), (4096, 12288), (248320, 4096)]
    h100 = T.head_start(shapes, "NVIDIA H100 80GB HBM3", BUILTIN_GEMM_TABLES)
    assert h100.name.startswith("h100-qwen3.5-9b:") and set(h100.entries) == set(shapes)
    assert T.to_tune(shapes, h100) == []
    h200 = T.head_start(shapes, "NVIDIA H200", BUILTIN_GEMM_TABLES)
    assert h200.name.startswith("h200-qwen3.5-9b:") and len(h200.entries) == 6
    assert T.to_tune(shapes, h200) == [((h200.block_k[4096],), [(248320, 4096)])]
    assert T.head_start(shapes, "NVIDIA B200", BUILTIN_GEMM_TABLES) is None
    assert T.to_tune(shapes, None) == [(T.BLOCK_KS, sorted(shapes))]
