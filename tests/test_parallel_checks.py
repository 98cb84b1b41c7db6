"""Engine-creation checks of parallel settings (``patches._check_parallelism``) and of the attention op setting on
stand-in configs."""

from types import SimpleNamespace

import pytest

from vllm_bi.patch.engine_config import BatchInvarianceConfigError, _check_parallelism

UNVERIFIED_TP_ENV = "VLLM_BI_ALLOW_UNVERIFIED_TP"


def _config(tp=1, pp=1, key_heads=2, value_heads=4, experts=0, ep=False):
    hf = SimpleNamespace(linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, num_experts=experts)
    par = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
                          use_sequence_parallel_moe=False)
    return SimpleNamespace(parallel_config=par, model_config=SimpleNamespace(hf_text_config=hf))


CPU = SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False)
CUDA = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)


def test_tp_must_divide_the_gdn_heads():
    # one GDN key head cannot be split over 2 ranks (vLLM's own warm-up then failed an assertion on the H200)
    with pytest.raises(BatchInvarianceConfigError, match="does not divide the model's GDN heads"):
        _check_parallelism(_config(tp=2, key_heads=1, value_heads=2), CPU)
    _check_parallelism(_config(tp=2, key_heads=2, value_heads=4), CPU)


def test_pipeline_parallel_refused():
    with pytest.raises(BatchInvarianceConfigError, match="pipeline parallelism"):
        _check_parallelism(_config(pp=2), CPU)


def test_the_default_under_tp_on_cuda_is_the_portable_arithmetic(monkeypatch):
    """The fast default's Triton GEMM is refused under TP: the engine config turns the default preset into the
    portable one there (in the environment its workers inherit), and leaves TP 1, CPU and a preset set by the
    user alone."""
    from vllm_bi.patch.engine_config import _auto_under_tp
    from vllm_bi.settings import current, reload

    monkeypatch.setenv("VLLM_BI_PRESET", "auto")
    monkeypatch.delenv("VLLM_BI_GEMM", raising=False)
    reload()
    for tp, platform in ((1, CUDA), (2, CPU)):
        _auto_under_tp(SimpleNamespace(tensor_parallel_size=tp), platform)
        assert current().preset == "auto" and current().gemm_on("cuda") == "triton"
    _auto_under_tp(SimpleNamespace(tensor_parallel_size=2), CUDA)
    assert current().preset == "portable" and current().gemm_on("cuda") == "fp64"
    assert current().decode_graphs() == (False, "")
    _check_parallelism(_config(tp=2), CUDA)
    monkeypatch.setenv("VLLM_BI_PRESET", "fast")  # the user's choice stays, and TP then refuses its GEMM
    reload()
    _auto_under_tp(SimpleNamespace(tensor_parallel_size=2), CUDA)
    assert current().preset == "fast"
    with pytest.raises(BatchInvarianceConfigError, match="exact float64 GEMM"):
        _check_parallelism(_config(tp=2), CUDA)


def test_tp_on_cuda_with_the_op_library_only(monkeypatch):
    # dense TP=2 with the op library (the default) was measured on 2 H200s: trainer == server, bit for bit
    monkeypatch.delenv(UNVERIFIED_TP_ENV, raising=False)
    monkeypatch.delenv("VLLM_BI_CUDA_OPS", raising=False)
    monkeypatch.setenv("VLLM_BI_PRESET", "portable")  # what the default becomes under TP on CUDA (above)
    _check_parallelism(_config(tp=2), CUDA)
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm")
    with pytest.raises(BatchInvarianceConfigError, match="op library only"):
        _check_parallelism(_config(tp=2), CUDA)
    monkeypatch.setenv(UNVERIFIED_TP_ENV, "1")
    _check_parallelism(_config(tp=2), CUDA)
    with pytest.raises(BatchInvarianceConfigError, match="MoE"):
        _check_parallelism(_config(tp=2, experts=8), CUDA)


def test_tp_with_the_triton_gemm_refused(monkeypatch):
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    with pytest.raises(BatchInvarianceConfigError, match="exact float64 GEMM"):
        _check_parallelism(_config(tp=2), CUDA)
    _check_parallelism(_config(tp=1), CUDA)
    _check_parallelism(_config(tp=2), CPU)  # CPU tensors take the float64 GEMM whatever the setting


def test_moe_with_expert_parallel_refused_on_cpu():
    _check_parallelism(_config(tp=2, experts=8), CPU)
    with pytest.raises(BatchInvarianceConfigError, match="MoE"):
        _check_parallelism(_config(tp=2, experts=8, ep=True), CPU)


def test_moe_triton_with_tp_refused(monkeypatch):
    # the grouped MoE kernels have no exact partial sums to all-reduce
    monkeypatch.setenv("VLLM_BI_MOE", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BatchInvarianceConfigError, match="VLLM_BI_MOE=loop"):
        _check_parallelism(_config(tp=2, experts=8), CPU)
    _check_parallelism(_config(tp=2), CPU)  # a dense model: no MoE layer to refuse


def test_attention_op_setting_is_checked_at_engine_creation(monkeypatch):
    from vllm_bi.patch.engine_config import _check_op_settings

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("VLLM_BI_ATTENTION", "triton")
    with pytest.raises(BatchInvarianceConfigError, match="TRITON_INTERPRET=1"):
        _check_op_settings(CPU)
    monkeypatch.setenv("VLLM_BI_ATTENTION", "fast")
    with pytest.raises(BatchInvarianceConfigError, match="use one of auto, torch, triton"):
        _check_op_settings(CPU)
    monkeypatch.setenv("VLLM_BI_ATTENTION", "torch")
    _check_op_settings(CPU)


def test_a_bad_gemm_tile_table_stops_the_engine_at_creation(tmp_path, monkeypatch):
    from vllm_bi.patch.engine_config import _check_op_settings

    monkeypatch.setenv("VLLM_BI_ATTENTION", "torch")
    bad = tmp_path / "tiles.json"
    bad.write_text('{"format": 1, "arch": "hopper", "shapes": {}}')
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", str(bad))
    with pytest.raises(BatchInvarianceConfigError, match="no shapes"):
        _check_op_settings(CPU)
    # a table shipped with vllm_bi, by name (a GPU run found the start-up check reading it as a path)
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h200-qwen3.5-9b")
    _check_op_settings(CPU)
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", "h100-nothing")
    with pytest.raises(BatchInvarianceConfigError, match="neither a table file"):
        _check_op_settings(CPU)


def test_cuda_graph_setting_is_parsed_and_its_blockers_named(monkeypatch):
    from vllm_bi.patch.engine_config import _check_graphs
    from vllm_bi.settings import current

    def cuda_graphs_requested():
        return current().cuda_graphs == "decode"

    def graph_blockers(has_moe):
        return current().graph_blockers(has_moe)

    for value, want in (("", False), ("off", False), ("0", False), ("decode", True), ("DECODE", True)):
        monkeypatch.setenv("VLLM_BI_CUDA_GRAPHS", value)
        assert cuda_graphs_requested() is want, value
    monkeypatch.setenv("VLLM_BI_CUDA_GRAPHS", "full")
    with pytest.raises(ValueError, match="VLLM_BI_CUDA_GRAPHS=.full. is not a setting; use one of auto, off, decode"):
        cuda_graphs_requested()
    monkeypatch.setenv("VLLM_BI_CUDA_GRAPHS", "decode")
    # what a captured decode step cannot run, each named with its fix
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "chunk")
    monkeypatch.setenv("VLLM_BI_CHUNK_DECODE", "host")
    monkeypatch.setenv("VLLM_BI_ATTENTION", "torch")
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm")
    monkeypatch.setenv("VLLM_BI_MOE", "loop")  # not the CUDA default (triton)
    why = graph_blockers(has_moe=True)
    assert len(why) == 4 and "use VLLM_BI_CHUNK_DECODE=padded" in why[0] and "use triton" in why[1] \
        and "MoE" in why[3], why
    with pytest.raises(BatchInvarianceConfigError, match="cannot capture a decode step with"):
        _check_graphs(_config(experts=8))
    monkeypatch.setenv("VLLM_BI_GDN_MODE", "recurrent")
    monkeypatch.setenv("VLLM_BI_ATTENTION", "triton")
    monkeypatch.delenv("VLLM_BI_CUDA_OPS")
    assert graph_blockers(has_moe=False) == []
    _check_graphs(_config())  # a dense model with the recurrent mode and the Triton attention: allowed
    for mode in ("exact", "triton"):  # MoE experts grouped on the device: capturable
        monkeypatch.setenv("VLLM_BI_MOE", mode)
        assert graph_blockers(has_moe=True) == []
    monkeypatch.delenv("VLLM_BI_MOE")  # the CUDA default, triton
    assert graph_blockers(has_moe=True) == []
