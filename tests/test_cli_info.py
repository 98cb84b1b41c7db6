"""`vllm-bi info` names every setting a server and its trainer must share, and a bad value as refused."""

from vllm_bi.cli import _cmd_info


def test_info_prints_the_gemm_tiles_and_graph_settings(monkeypatch, capsys):
    from vllm_bi.ops.gemm_configs import table_digest

    monkeypatch.setenv("VLLM_BI_PRESET", "auto")
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    monkeypatch.setenv("VLLM_BI_CUDA_GRAPHS", "decode")
    _cmd_info(None)
    out = capsys.readouterr().out
    assert f"gemm_configs {table_digest()}" in out and "VLLM_BI_CUDA_GRAPHS = 'decode' (env)" in out
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "no-such-table")
    monkeypatch.delenv("VLLM_BI_CUDA_GRAPHS")
    _cmd_info(None)
    out = capsys.readouterr().out
    assert "arithmetic on cuda: refused (" in out and "no-such-table" in out  # CPU: the float64 GEMM, no tiles
    assert "VLLM_BI_CUDA_GRAPHS = 'auto' (default)" in out
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "fastest")
    _cmd_info(None)
    assert "settings: refused (VLLM_BI_GDN_MODE='fastest' is not a setting" in capsys.readouterr().out


def test_info_prints_every_setting_and_the_arithmetic_dict(monkeypatch, capsys):
    from vllm_bi.settings import SETTINGS, current

    monkeypatch.setenv("VLLM_BI_PRESET", "fast")
    monkeypatch.setenv("VLLM_BI_GEMM", "fp64")
    monkeypatch.setenv("VLLM_BI_DIGEST", "triton")
    _cmd_info(None)
    out = capsys.readouterr().out
    for spec in SETTINGS:
        assert f"  {spec.env} = " in out, spec.env
    assert "VLLM_BI_DIGEST = 'triton' (env)" in out
    assert "VLLM_BI_GEMM = 'fp64' (env)" in out and "VLLM_BI_CUDA_GRAPHS = 'decode' (preset)" in out
    assert "VLLM_BI_GDN_MODE = 'recurrent' (default)" in out
    cpu = ", ".join(f"{k} {v}" for k, v in current().arithmetic("cpu").items())
    assert f"  arithmetic on cpu: {cpu}" in out


def test_info_prints_the_gpu_gate_status(capsys):
    from vllm_bi.gpu_gate import load_record, status

    _cmd_info(None)
    out = capsys.readouterr().out
    assert f"GPU gate: {status(load_record())[1]}" in out
