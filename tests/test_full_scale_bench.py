"""``benchmarks/full_scale.py``'s pure parts: it reads the KV-cache line vLLM 0.32 logs at start-up, and its table
puts each ratio the right way round (throughputs: how many times slower; capacity: the share of stock's)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("full_scale", os.path.join(ROOT, "benchmarks", "full_scale.py"))
FS = importlib.util.module_from_spec(spec)
spec.loader.exec_module(FS)


def test_reads_vllms_kv_cache_line():
    # the format string of vllm/v1/core/kv_cache_utils.py (update_kv_cache_capacity), filled in
    line = "(EngineCore pid=1) INFO 12-03 kv_cache_utils.py:1] GPU KV cache size: 1,234,567 tokens, " \
           "Maximum concurrency for 4,096 tokens per request: 301.41x"
    m = FS._KV.search(line)
    assert m and (m[1], m[2], m[3]) == ("1,234,567", "4,096", "301.41")
    assert FS._KV.search("GPU KV cache size: 12 tokens") is None


def test_table_ratios():
    rows = [{"side": "stock", "prefill": {"tok_s": 1000.0}, "decode64": {"tok_s": 500.0, "tpot_ms": 10.0},
             "max_concurrency": 100.0},
            {"side": "vllm_bi", "prefill": {"tok_s": 800.0}, "decode64": {"tok_s": 450.0, "tpot_ms": 11.0},
             "max_concurrency": 80.0}]
    text = "\n".join(FS.serve_table(rows))
    assert "| prefill tok/s (64 clients, 1K prompts) | 1,000 | 800 | 1.25x slower |" in text
    assert "| TPOT ms at 64 | 10.00 | 11.00 | 1.10x |" in text
    assert "| max concurrency at max-model-len | 100 | 80.00 | 0.80x of stock |" in text
    assert "| generation tok/s at 256 | n/a | n/a |  |" in text  # a phase not measured stays empty


def test_sides_name_their_settings_and_get_a_column_each():
    import pytest

    assert FS.parse_side("stock") == (False, {})
    assert FS.parse_side("vllm_bi") == (True, {})
    assert FS.parse_side("vllm_bi:VLLM_BI_GDN_MODE=chunk:VLLM_BI_CHUNK_DECODE=padded") == (
        True, {"VLLM_BI_GDN_MODE": "chunk", "VLLM_BI_CHUNK_DECODE": "padded"})
    for bad in ("stock:VLLM_BI_GDN_MODE=chunk", "vllm_bi:GDN_MODE=chunk", "vllm_bi:VLLM_BI_GDN_MODE", "bi"):
        with pytest.raises(ValueError, match="side"):
            FS.parse_side(bad)
    rows = [{"side": "stock", "prefill": {"tok_s": 1000.0}}, {"side": "vllm_bi", "prefill": {"tok_s": 800.0}},
            {"side": "vllm_bi:VLLM_BI_GDN_MODE=chunk", "prefill": {"tok_s": 900.0}}]
    text = "\n".join(FS.serve_table(rows))
    assert "| metric | stock | vllm_bi | vllm_bi cost | vllm_bi:VLLM_BI_GDN_MODE=chunk | " in text
    assert "| prefill tok/s (64 clients, 1K prompts) | 1,000 | 800 | 1.25x slower | 900 | 1.11x slower |" in text


def test_profile_parts_and_decode_difference(tmp_path):
    # kernel names as they appear in H200 traces: cuBLAS, vLLM's persistent matmul, FlashAttention, fla-core
    assert FS.part_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "GEMM"
    assert FS.part_of("matmul_kernel_persistent") == "GEMM"
    assert FS.part_of("flash_fwd_splitkv_kernel") == "attention"
    assert FS.part_of("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "GDN"
    assert FS.part_of("fused_add_rms_norm_kernel") == "norms + pointwise"
    assert FS.part_of("void at::native::elementwise_kernel<128, 4>") == "norms + pointwise"
    assert FS.part_of("_step_in_slots") == "GDN"
    assert FS.part_of("_topk_log_softmax_kernel") == "sampling + logprobs"
    assert FS.part_of("some_new_kernel") == "other"
    # a trace as vLLM's torch profiler writes it: the decode bill is the second load minus the first
    import gzip
    import json
    import time
    since = time.time() - 1
    doc = {"traceEvents": [{"cat": "kernel", "name": "matmul_kernel_persistent", "dur": 3000},
                           {"cat": "cpu_op", "name": "aten::mm", "dur": 99000},
                           {"cat": "kernel", "name": "flash_fwd_kernel", "dur": 1000}]}
    with gzip.open(tmp_path / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump(doc, f)
    k, _ = FS._trace_summary(str(tmp_path), since)
    assert k == {"matmul_kernel_persistent": 3.0, "flash_fwd_kernel": 1.0}
    rows = [{"side": "stock", "prefill": {"kernels": {"gemm_a": 10.0}},
             "prefill+decode": {"kernels": {"gemm_a": 14.0, "flash_fwd": 2.0}}},
            {"side": "vllm_bi", "prefill": {"kernels": {"matmul_kernel_persistent": 20.0}},
             "prefill+decode": {"kernels": {"matmul_kernel_persistent": 32.0, "flash_fwd": 2.0}}}]
    text = "\n".join(FS.profile_table(rows))
    assert "| GEMM | 10.0 | 20.0 | 2.00x | 4.0 | 12.0 | 3.00x |" in text
    assert "| total | 10.0 | 20.0 | 2.00x | 6.0 | 14.0 | 2.33x |" in text


def test_kernel_sites_follow_the_launch_to_the_innermost_vllm_bi_frames(tmp_path):
    """A kernel is charged to the two innermost vllm_bi frames around its launch (by correlation id, on the launch's
    thread), a kernel launched outside vllm_bi to vLLM; the table lists the small kernels' sites."""
    import gzip
    import json
    import time

    def frame(name, ts, dur, tid=7):
        return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid=7, cat="cuda_runtime"):
        return {"cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid, "args": {"correlation": corr}}

    def kernel(name, corr, dur):
        return {"cat": "kernel", "name": name, "ts": 0, "dur": dur, "args": {"correlation": corr}}

    since = time.time() - 1
    events = [
        frame("/site/vllm/model_executor/models/qwen3_next.py(500): forward", 0, 1000),
        frame("/site/vllm_bi/model_executor/gdn.py(160): bi_gdn_core", 10, 500),
        frame("/site/vllm_bi/gdn/layer.py(300): gdn_varlen", 20, 100),
        frame("/site/torch/nn/functional.py(10): pad", 30, 20),
        launch(1, 35),  # inside pad < gdn_varlen < bi_gdn_core
        frame("/site/vllm_bi/ops/layout.py(39): canonical_rows", 200, 50),
        launch(2, 210, cat="cuda_driver"),  # inside canonical_rows < bi_gdn_core (gdn_varlen has ended)
        launch(3, 700),  # inside vLLM's forward only
        launch(4, 40, tid=8),  # another thread without frames
        kernel("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", 1, 2000),
        kernel("void at::native::index_elementwise_kernel<index_put_kernel_impl>", 2, 3000),
        kernel("rms_norm_kernel", 3, 500),
        kernel("matmul_kernel_persistent", 4, 9000),
    ]
    with gzip.open(tmp_path / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels, sites = FS._trace_summary(str(tmp_path), since)
    assert kernels["matmul_kernel_persistent"] == 9.0
    assert sites == {"norms + pointwise | gdn/layer.py:gdn_varlen < model_executor/gdn.py:bi_gdn_core": 2.0,
                     "norms + pointwise | ops/layout.py:canonical_rows < model_executor/gdn.py:bi_gdn_core": 3.0,
                     "norms + pointwise | vLLM": 0.5, "GEMM | vLLM": 9.0}
    rows = [{"side": s, "prefill": {"kernels": kernels}, "prefill+decode": {"kernels": kernels, "sites": sites}}
            for s in ("stock", "vllm_bi")]
    text = "\n".join(FS.profile_table(rows))
    assert "- 3.0 norms + pointwise | ops/layout.py:canonical_rows < model_executor/gdn.py:bi_gdn_core" in text
    assert "GEMM | vLLM" not in text  # the site list is the small kernels'


def test_parity_part_runs_once_per_vllm_bi_side_with_its_settings(tmp_path, monkeypatch):
    import json
    import sys

    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 2,
                                                   "hidden_size": 64, "vocab_size": 512}))
    calls = []

    def fake_parity(model_dir, out_dir, extra_server_args="", settings=None, log_name="parity.log"):
        calls.append((settings, log_name))
        return {"tokens": 8, "bitwise_equal": 8, "exit": 0}

    monkeypatch.setattr(FS, "parity_part", fake_parity)
    out = tmp_path / "fs.md"
    monkeypatch.setattr(sys, "argv", ["full_scale.py", "--model", str(model), "--part", "parity", "--out", str(out),
                                      "--sides", "stock,vllm_bi,vllm_bi:VLLM_BI_GDN_STATE=bf16"])
    assert FS.main() == 0
    assert calls == [({}, "parity-vllm_bi.log"),
                     ({"VLLM_BI_GDN_STATE": "bf16"}, "parity-vllm_bi_VLLM_BI_GDN_STATE_bf16.log")]
    text = out.read_text()
    assert "side vllm_bi," in text and "side vllm_bi:VLLM_BI_GDN_STATE=bf16," in text
    assert set(json.loads((tmp_path / "fs.json").read_text())["parity"]) == {"vllm_bi", "vllm_bi:VLLM_BI_GDN_STATE=bf16"}


def test_rl_wave_counts_its_own_prefix_hits_and_the_block_is_read_from_the_log():
    """The RL wave's prefix-hit share comes from vLLM's counters over the wave alone (not the server's lifetime rate),
    and the attention block from the start-up line that sets it."""

    class Srv:
        def __init__(self):
            self.c = {"vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 1000.0}

        def metric_sum(self, name):
            return self.c[name]

        def complete_many(self, reqs):
            self.c["vllm:prefix_cache_hits_total"] += 272 * 7 * 2  # 2 prompts, 7 siblings each hit one block
            self.c["vllm:prefix_cache_queries_total"] += 512 * len(reqs)

            class C:
                token_ids = [1, 2]
            return [C() for _ in reqs]

    r = FS.rl_wave(Srv(), 2, 8, 512, 2, 1000, seed=0)
    assert abs(r["prefix_hit_pct"] - 100 * 272 * 14 / (512 * 16)) < 1e-9 and r["tokens"] == 32
    line = "(EngineCore pid=1) INFO 12-07 [interface.py:1096] Setting attention block size to 528 tokens to ensure"
    assert FS._BLOCK.search(line)[1] == "528"
    rows = [{"side": "stock", "rl": {"prefix_hit_pct": 16.1}, "block_tokens": 272},
            {"side": "vllm_bi", "rl": {"prefix_hit_pct": 0.0}, "block_tokens": 528}]
    text = "\n".join(FS.serve_table(rows))
    assert "| RL wave prompt tokens from the prefix cache % | 16.10 | 0.00 |  |" in text
    assert "| attention block tokens (the prefix cache's grain) | 272 | 528 |  |" in text
