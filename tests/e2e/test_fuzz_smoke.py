"""The randomized-schedule fuzz (``scripts/fuzz_schedules.py``) as a CI smoke, through its command line.

200 cases on a batch-invariant CPU ``vllm serve`` of the tiny qwen3-next small-blocks model with the ``preempt``
profile (a KV cache of 16 blocks: running requests are preempted and recomputed) must all be bitwise equal to their
alone runs, with at least one preemption; the same script on stock vLLM (the negative control, same profile) must
find a mismatch. A rerun of the same selection is resumed from the results file: nothing to run, nothing appended.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "fuzz_schedules.py")
BI_CASES = 200
STOCK_CASES = 48


def fuzz(out, *args, timeout=600):
    r = subprocess.run([sys.executable, SCRIPT, "--quiet", "--profiles", "preempt", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout)
    recs = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    return r, recs


def per_batch(recs, key):
    """A batch counter summed over the batches (every case of a batch records its batch's counters)."""
    return sum({r["batch"]: r["batch_counters"][key] for r in recs}.values())


def test_fuzz_bi_cases_equal_alone_with_forced_preemption(tmp_path):
    out = tmp_path / "bi.jsonl"
    r, recs = fuzz(out, "--cases", str(BI_CASES))
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert len(recs) == BI_CASES and len({x["id"] for x in recs}) == BI_CASES, log[-2000:]
    assert all(x["bi"] and x["profile"] == "preempt" for x in recs)
    bad = [x for x in recs if not x["equal"]]
    assert not bad, f"{len(bad)} cases differ from their alone run; first: {json.dumps(bad[0])}"
    assert per_batch(recs, "preemptions") > 0, "no request was preempted: the preempt profile tested nothing"
    # what the batches held: the mechanisms the cases are meant to exercise did happen
    modes = {x["spec"]["mode"] for x in recs}
    assert modes == {"greedy", "seeded", "n"}, modes
    assert per_batch(recs, "aborted") > 0, "no neighbour was aborted by the server"
    assert any(x["batch_requests"]["mates"] for x in recs)
    assert any(x["spec"]["prompt_len"] > 64 for x in recs), "no prompt was split by max_num_batched_tokens 64"

    # resumed: every selected case is recorded, so nothing runs (no server) and nothing is appended
    r2, recs2 = fuzz(out, "--cases", str(BI_CASES), timeout=120)
    assert r2.returncode == 0, (r2.stdout + r2.stderr)[-2000:]
    assert len(recs2) == BI_CASES
    assert f"{BI_CASES} already in" in r2.stderr and "0 to run" in r2.stderr, r2.stderr[-2000:]


def test_fuzz_negative_control_stock_finds_mismatches(tmp_path):
    out = tmp_path / "stock.jsonl"
    r, recs = fuzz(out, "--stock", "--cases", str(STOCK_CASES))
    log = r.stdout + r.stderr
    assert r.returncode == 1, f"stock vLLM: exit {r.returncode}, expected 1 (mismatches found)\n{log[-4000:]}"
    assert len(recs) == STOCK_CASES and all(not x["bi"] for x in recs)
    assert any(not x["equal"] for x in recs), log[-2000:]
    assert "negative control" in r.stdout
