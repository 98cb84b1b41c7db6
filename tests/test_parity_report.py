"""`vllm-bi parity`'s report says how the server ran: its CUDA-graph mode from ``vllm_bi_info``."""

import json

from vllm_bi.parity import ParityReport, server_execution


def test_server_line_names_the_cuda_graph_mode():
    assert server_execution(None) == "" and server_execution({"gdn_mode": "recurrent"}) == ""  # an older server
    assert server_execution({"cuda_graphs": "NONE"}) == "eager (no CUDA graphs)"
    assert server_execution({"cuda_graphs": "FULL_DECODE_ONLY"}) == "CUDA graphs FULL_DECODE_ONLY"
    rep = ParityReport("m", "vllm_bi", 1, 2, 2, 0.0, 0.0, None, "GDN recurrent", "CUDA graphs FULL_DECODE_ONLY")
    assert "server" in rep.table() and "CUDA graphs FULL_DECODE_ONLY" in rep.table()
    assert json.loads(rep.to_json())["server"] == "CUDA graphs FULL_DECODE_ONLY"
    hf = ParityReport("m", "hf", 1, 2, 2, 0.0, 0.0, None).table()
    assert not any(ln.startswith("server ") for ln in hf.splitlines())


def test_trainer_refuses_a_server_with_another_moe_path(monkeypatch):
    from vllm_bi.parity import settings_mismatch, trainer_settings

    info = {"gdn_mode": "recurrent", "gemm": "fp64", "device": "cuda", "attention": "triton", "moe": "triton"}
    monkeypatch.setenv("VLLM_BI_MOE", "loop")
    monkeypatch.setenv("VLLM_BI_PRESET", "portable")  # the server's float64 GEMM on CUDA
    for k in ("VLLM_BI_GDN_MODE", "VLLM_BI_GEMM", "VLLM_BI_ATTENTION"):
        monkeypatch.delenv(k, raising=False)
    why = settings_mismatch(info)
    assert why == ("the server's MoE experts path is 'triton', this trainer's 'loop'; set VLLM_BI_MOE to the same "
                   "value on both sides")
    monkeypatch.delenv("VLLM_BI_MOE")  # triton is the default on CUDA
    assert settings_mismatch(info) is None
    monkeypatch.setenv("VLLM_BI_MOE", "triton")
    assert settings_mismatch(info) is None
    assert "MoE experts triton" in trainer_settings("cuda")
    # the float64 grouped kernels give the loop's bits (under the float64 GEMM): either side may use either
    monkeypatch.setenv("VLLM_BI_MOE", "exact")
    assert settings_mismatch(dict(info, moe="loop")) is None and settings_mismatch(info)


def test_trainer_settings_line_names_the_gdn_state_tile_and_gates(monkeypatch):
    """The parity report's settings line says which GDN state, tile and gates decided the trainer's bits: a bf16-state
    run must not read like an fp32 one."""
    from vllm_bi.parity import trainer_settings
    from vllm_bi.settings import reload

    for k in ("VLLM_BI_GDN_STATE", "VLLM_BI_GDN_TILE", "VLLM_BI_GDN_GATES", "VLLM_BI_GDN_MODE", "VLLM_BI_PRESET"):
        monkeypatch.delenv(k, raising=False)
    reload()
    assert "GDN recurrent (state fp32, gates torch)" in trainer_settings("cpu")
    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    monkeypatch.setenv("VLLM_BI_GDN_TILE", "32x2x3")
    reload()
    try:
        assert "(state bf16, tile 32x2x3, gates triton)" in trainer_settings("cuda")
    finally:
        monkeypatch.undo()
        reload()
