"""``benchmarks/spec_decode.py``'s pure parts: the sides it takes, and its table's speed-ups, ratios and acceptance
the right way round."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the benchmark imports full_scale and common, as run there
spec = importlib.util.spec_from_file_location("spec_decode", os.path.join(ROOT, "benchmarks", "spec_decode.py"))
SD = importlib.util.module_from_spec(spec)
spec.loader.exec_module(SD)


def test_sides():
    assert SD.parse_sides("stock, vllm_bi+mtp") == ["stock", "vllm_bi+mtp"]
    with pytest.raises(ValueError, match="choose among stock, stock\\+mtp, vllm_bi, vllm_bi\\+mtp"):
        SD.parse_sides("vllm_bi+eagle")
    fused = "vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused"
    assert SD.parse_sides(f"vllm_bi+mtp,{fused}") == ["vllm_bi+mtp", fused]
    assert SD.split_side(fused) == ("vllm_bi+mtp", "vllm_bi:VLLM_BI_SPEC_VERIFY=fused")
    assert SD.plain_of(fused) == "vllm_bi"
    for bad in ("stock+mtp:VLLM_BI_GDN_MODE=chunk", "vllm_bi:GDN_MODE=chunk", "vllm_bi,vllm_bi"):
        with pytest.raises(ValueError):
            SD.parse_sides(bad)
    assert SD.spec_args(2) == ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']


def _phase(tok_s, tpot, drafted=0.0, accepted=0.0, steps=0.0):
    return {"tok_s": tok_s, "tpot_ms": tpot, "drafted": drafted, "accepted": accepted, "verify_steps": steps}


def test_table_speed_ups_and_acceptance():
    rows = [{"side": "stock", "greedy1": _phase(100.0, 10.0), "t11": _phase(90.0, 11.0)},
            {"side": "stock+mtp", "greedy1": _phase(200.0, 5.0, 300, 150, 100), "t11": _phase(90.0, 11.0, 300, 0, 100)},
            {"side": "vllm_bi", "greedy1": _phase(80.0, 12.5), "t11": _phase(72.0, 13.9)},
            {"side": "vllm_bi+mtp", "greedy1": _phase(120.0, 8.3, 300, 150, 100), "t11": _phase(72.0, 13.9)},
            {"side": "vllm_bi", "error": "never started"}]
    text = "\n".join(SD.table(rows, [1]))
    greedy = next(line for line in text.splitlines() if line.startswith("| greedy | 1 |"))
    cells = [c.strip() for c in greedy.strip("|").split("|")]
    # tok/s (TPOT, acceptance) per side; speed-up of each speculative side over the same side without drafts;
    # vllm_bi / stock as time (stock tok/s over vllm_bi tok/s)
    assert cells[2:6] == ["100 (10.00)", "200 (5.00, 50% kept)", "80.00 (12.50)", "120 (8.30, 50% kept)"]
    assert cells[6:] == ["2.00x", "1.50x", "1.25x", "1.67x"]
    assert "stock+mtp: 150 of 600 drafts kept (25.0%), 1.75 tokens per verify step" in text
    assert "vllm_bi: failed: never started" in text
    # a side with settings: compared with the side without drafts and with stock+mtp, like its name
    rows.append({"side": "vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused", "greedy1": _phase(160.0, 6.2, 300, 150, 100),
                 "t11": _phase(72.0, 13.9)})
    text = "\n".join(SD.table(rows, [1]))
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    greedy = next(line for line in text.splitlines() if line.startswith("| greedy | 1 |"))
    cells = dict(zip(head, (c.strip() for c in greedy.strip("|").split("|"))))
    assert cells["vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused tok/s (TPOT ms)"] == "160 (6.20, 50% kept)"
    assert cells["vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused speed-up"] == "2.00x"
    assert cells["vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused / stock+mtp time"] == "1.25x"
    assert cells["vllm_bi+mtp speed-up"] == "1.50x"  # the side without settings unchanged


def test_a_phase_counts_the_tokens_and_the_drafts_of_its_window():
    """``phase`` on a stand-in server: every client request's tokens counted, seeded at a temperature (a seed per
    request), and the draft counters taken as the difference over the window."""
    import threading
    import types

    class Server:
        def __init__(self):
            self.lock, self.calls, self.drafts = threading.Lock(), [], 0.0

        def complete(self, prompt, max_tokens, temperature, seed):
            with self.lock:
                self.calls.append((len(prompt), max_tokens, temperature, seed))
                self.drafts += 3
            return types.SimpleNamespace(token_ids=[1] * max_tokens)

        def metric_sum(self, name):
            return {"vllm:spec_decode_num_draft_tokens_total": self.drafts,
                    "vllm:spec_decode_num_accepted_tokens_total": self.drafts / 3,
                    "vllm:spec_decode_num_drafts_total": self.drafts / 3}.get(name, 0.0)

    srv = Server()
    srv.drafts = 30.0  # counted before the window: not this phase's
    m = SD.phase(srv, clients=2, window=0.05, vocab=1000, seed=5, temperature=1.0)
    n = len(srv.calls)
    assert n >= 2 and m["requests"] == n and m["tokens"] == n * SD.MAX_TOKENS
    assert m["drafted"] == 3 * n and m["accepted"] == n and m["verify_steps"] == n
    assert all(c[0] == SD.PROMPT_LEN and c[2] == 1.0 and c[3] is not None for c in srv.calls)
    assert len({c[3] for c in srv.calls}) == n  # a seed per request
