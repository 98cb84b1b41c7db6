"""The randomized-schedule fuzz (``scripts/fuzz_schedules.py``) as a CI smoke, through its command line.

60 cases (5 batches) on a batch-invariant CPU ``vllm serve`` of the tiny qwen3-next small-blocks model with the
``preempt`` profile (a KV cache of 18 blocks: running requests are preempted and recomputed) must all be bitwise
equal to their alone runs, with at least one preemption; the same script on stock vLLM (the negative control, the
same profile and prompts, greedy) must find a mismatch and exit 1. The two runs go at once (their servers start side
by side). A rerun of the BI selection resumes from its results file: nothing to run, nothing appended.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "fuzz_schedules.py")
BI_CASES = 60  # 5 whole batches of 12 targets, drawn from one pool of 32
STOCK_CASES = 24


def command(out, *args):
    return [sys.executable, SCRIPT, "--quiet", "--profiles", "preempt", "--out", str(out), *args]


def records(out):
    return [json.loads(line) for line in open(out)] if os.path.exists(out) else []


def per_batch(recs, key):
    """A batch counter summed over the batches (every case of a batch records its batch's counters)."""
    return sum({r["batch"]: r["batch_counters"][key] for r in recs}.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    jobs = {"bi": ["--cases", str(BI_CASES)], "stock": ["--stock", "--cases", str(STOCK_CASES)]}
    procs = {}
    for name, args in jobs.items():
        log = open(d / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(command(d / f"{name}.jsonl", *args), stdout=log, stderr=subprocess.STDOUT,
                                        text=True), log)
    out = {}
    for name, (p, log) in procs.items():
        try:
            rc = p.wait(timeout=900)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
        out[name] = {"rc": rc, "log": (d / f"{name}.log").read_text(), "out": d / f"{name}.jsonl",
                     "recs": records(d / f"{name}.jsonl")}
    return out


def test_fuzz_bi_cases_equal_alone_with_forced_preemption(runs):
    r = runs["bi"]
    recs = r["recs"]
    assert r["rc"] == 0, r["log"][-4000:]
    assert len(recs) == BI_CASES and len({x["id"] for x in recs}) == BI_CASES, r["log"][-2000:]
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


def test_fuzz_rerun_resumes_from_the_results_file(runs):
    out = runs["bi"]["out"]
    before = out.read_text()
    r = subprocess.run(command(out, "--cases", str(BI_CASES)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert f"{BI_CASES} already in" in r.stderr and "0 to run" in r.stderr, r.stderr[-2000:]
    assert out.read_text() == before


def test_fuzz_negative_control_stock_finds_mismatches(runs):
    r = runs["stock"]
    recs = r["recs"]
    assert r["rc"] == 1, f"stock vLLM: exit {r['rc']}, expected 1 (mismatches found)\n{r['log'][-4000:]}"
    assert len(recs) == STOCK_CASES and all(not x["bi"] for x in recs)
    assert any(not x["equal"] for x in recs), r["log"][-2000:]
    assert "negative control: stock vLLM gave" in r["log"]
