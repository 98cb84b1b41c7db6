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
