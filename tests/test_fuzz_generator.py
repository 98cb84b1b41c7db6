"""The case generator and bookkeeping of ``scripts/fuzz_schedules.py``, without a server: a case is a pure function
of (seed, profile, index); every request fits its profile's max_model_len; the stock control gets the BI cases'
prompts, greedy; shards partition the cases; ids round-trip; the first difference is found where it is."""

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "fuzz_schedules.py")
_spec = importlib.util.spec_from_file_location("fuzz_schedules", _PATH)
fz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_schedules"] = fz
_spec.loader.exec_module(fz)


def _flat(batch):
    return [(s.role, s.req, s.delay, s.slot, s.chunks, s.timeout) for s in batch.sent], batch.warm


@pytest.mark.parametrize("name", list(fz.PROFILES))
def test_batches_are_deterministic_and_fit_the_profile(name):
    prof = fz.PROFILES[name]
    roles, modes, lengths = set(), set(), []
    for b in range(0, 400, 7):
        batch = fz.make_batch(3, prof, b, 1024, stock=False)
        assert _flat(batch) == _flat(fz.make_batch(3, prof, b, 1024, stock=False))
        assert [t.slot for t in batch.targets()] == list(range(fz.TARGETS_PER_BATCH))
        for s in batch.sent:
            assert 1 <= len(s.req.prompt) and len(s.req.prompt) + s.req.max_tokens <= prof.max_model_len
            assert all(3 <= t < 1024 for t in s.req.prompt)
            roles.add(s.role)
            modes.add(s.req.mode)
            lengths.append(len(s.req.prompt))
        for w in batch.warm:
            assert len(w.prompt) + w.max_tokens <= prof.max_model_len
    assert roles == {"target", "mate", "abort-stream", "abort-timeout"}
    assert modes == {"greedy", "seeded", "n"}
    assert min(lengths) <= 16 and max(lengths) > prof.mnbt or prof.mnbt >= 2048
    # another seed, another batch; another profile, another batch
    assert _flat(fz.make_batch(4, prof, 0, 1024, stock=False)) != _flat(fz.make_batch(3, prof, 0, 1024, stock=False))


def test_prefix_caching_profiles_warm_shared_prefixes():
    prof = fz.PROFILES["mnbt64"]
    warmed = [fz.make_batch(0, prof, b, 1024, stock=False).warm for b in range(40)]
    assert sum(map(len, warmed)) > 0
    assert all(not fz.make_batch(0, fz.PROFILES["preempt"], b, 1024, stock=False).warm for b in range(40))


def test_stock_control_gets_the_same_prompts_greedy():
    prof = fz.PROFILES["preempt"]
    for b in range(20):
        bi, st = fz.make_batch(0, prof, b, 1024, stock=False), fz.make_batch(0, prof, b, 1024, stock=True)
        assert [(s.role, s.req.prompt, s.req.max_tokens, s.delay) for s in bi.sent] == \
               [(s.role, s.req.prompt, s.req.max_tokens, s.delay) for s in st.sent]
        assert all(s.req.mode == "greedy" and s.req.n == 1 and s.req.seed is None for s in st.sent)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_partition_the_cases(n):
    names = ["mnbt32", "preempt", "mnbt2048"]
    seen = set()
    for i in range(n):
        p = fz.plan(names, 100, (i, n))
        ids = {fz.case_id(False, name, 0, b * fz.TARGETS_PER_BATCH + s)
               for name, bs in p.items() for b, ss in bs.items() for s in ss}
        assert len(ids) == 100
        assert all(b % n == i for bs in p.values() for b in bs)
        assert not ids & seen
        seen |= ids
    counts = {name: sum(len(ss) for ss in bs.values()) for name, bs in fz.plan(names, 100, (0, 1)).items()}
    assert counts == {"mnbt32": 34, "preempt": 33, "mnbt2048": 33}


def test_case_ids_round_trip_and_bad_ids_are_usage_errors():
    assert fz.parse_case_id(fz.case_id(True, "preempt", 7, 1234)) == (True, "preempt", 7, 1234)
    for bad in ("bi/preempt/0", "gpu/preempt/0/1", "bi/nope/0/1", "bi/preempt/x/1"):
        with pytest.raises(fz.UsageError):
            fz.parse_case_id(bad)


def test_first_diff_finds_the_first_token_or_logprob_that_differs():
    a = [([1, 2, 3], [-1.0, -2.0, -3.0]), ([4, 5], [-0.5, -0.25])]
    assert fz.first_diff(a, [(list(t), list(l)) for t, l in a]) is None
    b = [([1, 2, 3], [-1.0, -2.0, -3.0]), ([4, 5], [-0.5, -0.25000001])]
    assert fz.first_diff(a, b) == {"choice": 1, "pos": 1, "what": "logprob", "alone": [5, -0.25],
                                   "busy": [5, -0.25000001]}
    c = [([1, 9, 3], [-1.0, -2.0, -3.0]), a[1]]
    assert fz.first_diff(a, c)["what"] == "token" and fz.first_diff(a, c)["pos"] == 1
    assert fz.first_diff(a, a[:1])["what"] == "choices"


def test_usage_errors_exit_2_in_one_line(tmp_path, capsys):
    for argv in (["--shard", "2/2"], ["--profiles", "nope"], ["--server", "http://x"], ["--replay", "bi/x/0/1"],
                 ["--out", str(tmp_path / "missing" / "f.jsonl")], ["--cases", "-3"],
                 ["--server", "http://x", "--profile", "mnbt64", "--server-args=--enforce-eager"]):
        assert fz.main(argv) == fz.EXIT_USAGE, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, (argv, err)


@pytest.mark.parametrize("name", list(fz.PROFILES))
def test_a_profile_asks_for_no_more_sequences_than_its_kv_cache_has_blocks(name):
    # a decode step captured in a CUDA graph needs one state block per sequence (vLLM refuses to start otherwise)
    prof = fz.PROFILES[name]
    for blocks in (None, 4, 14, 40):
        args = prof.server_args(blocks)
        seqs = int(args[args.index("--max-num-seqs") + 1])
        if prof.forces_preemption:
            n = int(args[args.index("--num-gpu-blocks-override") + 1])
            assert n == (blocks or prof.kv_blocks) and seqs == min(fz.MAX_SEQS, n)
        else:
            assert "--num-gpu-blocks-override" not in args and seqs == fz.MAX_SEQS


def test_server_args_follow_the_profile_s_own(tmp_path):
    args = fz.parse_args(["--server-args", "--gdn-prefill-backend triton", "--out", str(tmp_path / "f.jsonl")])
    prof = fz.PROFILES["preempt"]
    assert fz.serve_args(args, prof, False) == prof.server_args() + ["--gdn-prefill-backend", "triton"]
    assert fz.serve_args(args, prof, True)[-3:] == ["--enforce-eager", "--gdn-prefill-backend", "triton"]
