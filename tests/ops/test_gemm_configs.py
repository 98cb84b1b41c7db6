"""The Triton GEMM mode's tuned tiles (``vllm_bi.ops.gemm_configs``): a table file is checked (each bad entry
named), installed into vLLM 0.32's batch-invariant matmul table so vLLM's own config lookup returns its tiles per
M bucket, and named by a digest that the trainer compares with the server's. Speed and the GPU's bits:
``benchmarks/bi_gemm_tune.py`` and ``tests/gpu/test_ops_cuda.py``."""

import json
import os

import pytest

from vllm_bi.ops import gemm_configs as G

TABLE = {"format": 1, "arch": "hopper", "device": "test", "command": "test",
         "shapes": {"12288x4096": {"block_k": 64, "m_buckets": [[1, 16, 128, 8, 3], [64, 32, 64, 4, 4],
                                                                [2048, 128, 128, 8, 3]]}}}


def write(tmp_path, doc, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_install_puts_the_tiles_in_vllms_lookup(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    C = pytest.importorskip("vllm.model_executor.determinism.batch_invariant_configs")
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", write(tmp_path, TABLE))
    saved = dict(C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS.get("hopper", {}))
    try:
        digest = G.install_gemm_configs()
        assert digest == G.table_digest() and len(digest) == 16
        monkeypatch.setattr(C, "_get_tuned_matmul_arch_family", lambda cap: "hopper")
        monkeypatch.setattr(C.current_platform, "is_cuda", lambda: True, raising=False)
        monkeypatch.setattr(C.current_platform, "get_device_capability", lambda: None, raising=False)
        default = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                   "num_stages": 3, "num_warps": 8}
        C._TUNED_MATMUL_CONFIGS_RESOLVED = False
        got = {m: C._get_matmul_config(m, 12288, 4096, torch.bfloat16, default) for m in (1, 2, 64, 65, 9000)}
        assert (got[1]["BLOCK_SIZE_M"], got[1]["BLOCK_SIZE_N"], got[1]["num_warps"]) == (16, 128, 8)
        assert (got[2]["BLOCK_SIZE_M"], got[64]["BLOCK_SIZE_M"], got[64]["num_stages"]) == (32, 32, 4)
        assert got[65]["BLOCK_SIZE_M"] == 128 and got[9000]["BLOCK_SIZE_M"] == 128  # the last bucket: larger M
        assert {g["BLOCK_SIZE_K"] for g in got.values()} == {64}  # one BLOCK_K per shape: the K loop is fixed
        assert C._get_matmul_config(1, 4096, 4096, torch.bfloat16, default) == default  # not in the table
    finally:
        C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"] = saved
        C._TUNED_MATMUL_CONFIGS_RESOLVED = False
        G._installed.clear()


def test_digest_names_the_file_and_none_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "vllm")  # vLLM's own tiles
    assert G.table_digest() == "none" and G.install_gemm_configs() == "none"
    monkeypatch.delenv("VLLM_BI_GEMM_CONFIGS")  # unset: the shipped table (auto)
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    shipped = G.table_digest()
    monkeypatch.delenv("VLLM_BI_GEMM_CONFIGS")
    assert G.table_digest() == shipped != "none"
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", write(tmp_path, TABLE, "a.json"))
    a = G.table_digest()
    other = dict(TABLE, device="other")
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", write(tmp_path, other, "b.json"))
    assert G.table_digest() != a
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read it"):
        G.table_digest()


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(format=2), "format-1"),
    (lambda d: d.update(arch="volta"), "unknown arch"),
    (lambda d: d["shapes"].update({"12288": {"block_k": 64, "m_buckets": [[1, 16, 16, 4, 3]]}}), "NxK"),
    (lambda d: d["shapes"]["12288x4096"].update(block_k=48), "power of two"),
    (lambda d: d["shapes"]["12288x4096"]["m_buckets"].append([8, 16, 64, 4, 3]), "must increase"),
    (lambda d: d["shapes"]["12288x4096"]["m_buckets"].append([9999, 16, 64, 4]), "is not"),
    (lambda d: d.update(shapes={}), "no shapes"),
])
def test_bad_tables_are_refused_by_name(tmp_path, change, match):
    doc = json.loads(json.dumps(TABLE))
    change(doc)
    with pytest.raises(ValueError, match=match):
        G.load_table(write(tmp_path, doc))


def test_trainer_refuses_a_server_with_other_tiles(tmp_path, monkeypatch):
    from vllm_bi.parity import settings_mismatch

    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", write(tmp_path, TABLE))
    info = {"gdn_mode": "recurrent", "gemm": "triton", "ops": "vllm_bi", "gemm_configs": "none", "device": "cuda"}
    assert "VLLM_BI_GEMM_CONFIGS" in settings_mismatch(info)
    assert settings_mismatch(dict(info, gemm_configs=G.table_digest())) is None


def _device_table(monkeypatch, C, table):
    monkeypatch.setattr(C, "_TUNED_MATMUL_CONFIGS_FOR_DEVICE", table)
    monkeypatch.setattr(C, "_TUNED_MATMUL_CONFIGS_RESOLVED", True)
    monkeypatch.setattr(G, "_reference", None)
    monkeypatch.setattr(G, "_user_shapes", set())


DEFAULT = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3,
           "num_warps": 8}


def _block_k(C, n, k, torch):
    ks = {C._get_matmul_config(m, n, k, torch.bfloat16, DEFAULT)["BLOCK_SIZE_K"] for m in (1, 16, 300, 9000)}
    assert len(ks) == 1  # one BLOCK_K per shape, whatever M
    return ks.pop()


@pytest.mark.parametrize("arch", ["hopper", "blackwell", "sm120", "ada"])
def test_one_block_k_per_k_so_fused_layers_give_their_parts_bits(arch, monkeypatch):
    """vLLM's own tables give a fused product and its parts different BLOCK_Ks (Hopper: its (12288, 2048) shape 128,
    a (6144, 2048) part the default 64; Blackwell and sm120 mix them within one K). After consistent_tiles every
    shape with one K, in the table or not, has the same BLOCK_K."""
    torch = pytest.importorskip("torch")
    C = pytest.importorskip("vllm.model_executor.determinism.batch_invariant_configs")
    table = dict(C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS[arch])
    _device_table(monkeypatch, C, table)
    ks = sorted({k for _, k in table})
    parts = [(n // 2, k) for n, k in table] + [(n, k) for n, k in table] + [(777, k) for k in ks] + [(512, 4000)]
    if arch == "hopper":  # the trap as vLLM ships it: a fused MLP's shape and one of its halves
        assert _block_k(C, 12288, 2048, torch) == 128 and _block_k(C, 6144, 2048, torch) == 64
    for n, k in parts:
        G.consistent_tiles(n, k)
    for k in ks:
        assert len({_block_k(C, n, kk, torch) for n, kk in parts if kk == k}) == 1, k
    assert _block_k(C, 512, 4000, torch) == 64 and (512, 4000) not in table  # a K vLLM has no tiles for: default


def test_the_table_files_block_k_is_the_reference_for_its_k(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    C = pytest.importorskip("vllm.model_executor.determinism.batch_invariant_configs")
    doc = {"format": 1, "arch": "hopper", "device": "t", "command": "t",
           "shapes": {"4096x2048": {"block_k": 32, "m_buckets": [[1, 16, 64, 4, 3], [4096, 64, 64, 4, 3]]}}}
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", write(tmp_path, doc))
    saved = dict(C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"])
    try:
        G._installed.clear()
        G.install_gemm_configs()
        _device_table(monkeypatch, C, C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"])
        monkeypatch.setattr(G, "_user_shapes", {(4096, 2048)})
        for n in (12288, 6144, 2048, 4096):
            G.consistent_tiles(n, 2048)
        assert {_block_k(C, n, 2048, torch) for n in (12288, 6144, 2048, 4096)} == {32}
        assert C._get_matmul_config(1, 12288, 2048, torch.bfloat16, DEFAULT)["BLOCK_SIZE_N"] == 64  # the file's tiles
        assert _block_k(C, 2048, 6144, torch) == 128  # another K keeps vLLM's
    finally:
        C._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS["hopper"] = saved
        G._installed.clear()


def test_a_table_mixing_block_k_for_one_k_is_refused(tmp_path):
    doc = json.loads(json.dumps(TABLE))
    doc["shapes"]["4096x4096"] = {"block_k": 128, "m_buckets": [[1, 16, 64, 4, 3]]}
    with pytest.raises(ValueError, match="same K must share one block_k"):
        G.load_table(write(tmp_path, doc))


def test_a_shipped_table_is_named_and_checked(monkeypatch):
    """``VLLM_BI_GEMM_CONFIGS=h200-qwen3.5-9b`` names the table tuned on the H200 (shipped in the
    package): it passes the file checks (one BLOCK_K per K, increasing buckets) and covers Qwen3.5-9B's six linear
    shapes; its digest is its file's. An unknown name is refused with the names there are."""
    assert "h200-qwen3.5-9b" in G.builtin_tables()
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    path = G.table_path()
    assert path == os.path.join(G.BUILTIN_DIR, "h200-qwen3.5-9b.json") and os.path.isfile(path)
    arch, shapes = G.load_table(path)
    assert arch == "hopper"
    assert set(shapes) == {(10240, 4096), (4096, 4096), (12288, 4096), (64, 4096), (24576, 4096), (4096, 12288)}
    digest = G.table_digest()
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", path)
    assert G.table_digest() == digest
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "a100-nothing")
    with pytest.raises(ValueError, match=r"neither a table file .*\(h100-qwen3.5-9b, h200-qwen3.5-9b\)"):
        G.table_digest()


def test_the_h100_table_covers_the_lm_head_and_names_its_device(monkeypatch):
    """``h100-qwen3.5-9b``, tuned on an H100: Qwen3.5-9B's six linear shapes and the 248,320-row lm_head, one BLOCK_K
    per K, its ``device`` the name CUDA gives the card (what a tuning server on that card takes as its head start),
    and a digest of its own (other tiles: other bits than the H200 table's)."""
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h100-qwen3.5-9b")
    path = G.table_path()
    arch, shapes = G.load_table(path)
    assert arch == "hopper"
    assert set(shapes) == {(10240, 4096), (4096, 4096), (12288, 4096), (64, 4096), (24576, 4096), (4096, 12288),
                           (248320, 4096)}
    with open(path) as f:
        assert json.load(f)["device"] == "NVIDIA H100 80GB HBM3"
    h100 = G.table_digest()
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    assert G.table_digest() != h100


def test_a_named_table_is_resolved_once_per_settings(monkeypatch):
    """The Triton GEMM asks for its table before every product: a table name (``auto``, ``card``, a shipped name) is
    resolved through the file system once per settings object, then without touching it."""
    from vllm_bi import settings as S

    for value in ("auto", S.CARD, "h200-qwen3.5-9b"):
        s = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": value})
        path = s.gemm_table_path()
        assert os.path.isfile(path)
        with monkeypatch.context() as m:
            def no_file_system(*a, **k):
                raise AssertionError(f"{value}: the file system was read again")

            m.setattr(os, "listdir", no_file_system)
            m.setattr(os.path, "exists", no_file_system)
            assert s.gemm_table_path() == path
            fresh = S.Settings.from_env({"VLLM_BI_GEMM_CONFIGS": value})
            with pytest.raises(AssertionError, match="read again"):  # the control: a new object resolves anew
                fresh.gemm_table_path()
