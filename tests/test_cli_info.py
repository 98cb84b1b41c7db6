"""`vllm-bi info` names every setting a server and its trainer must share, and a bad value as refused."""

from vllm_bi.cli import _cmd_info


def test_info_prints_the_gemm_tiles_and_graph_settings(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    monkeypatch.setenv("VLLM_BI_CUDA_GRAPHS", "decode")
    _cmd_info(None)
    out = capsys.readouterr().out
    assert "gemm_tiles/h200-qwen3.5-9b.json" in out and "CUDA graphs (VLLM_BI_CUDA_GRAPHS): decode" in out
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "no-such-table")
    monkeypatch.delenv("VLLM_BI_CUDA_GRAPHS")
    _cmd_info(None)
    out = capsys.readouterr().out
    assert "GEMM tiles (VLLM_BI_GEMM_CONFIGS): refused (" in out and "no-such-table" in out
    assert "CUDA graphs (VLLM_BI_CUDA_GRAPHS): off" in out
