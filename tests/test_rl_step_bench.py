"""``benchmarks/rl_step.py``'s pure parts: the median of each part of a step over the steps after the warm-up, and
the table's ratio the right way round (vllm_bi / stock)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("rl_step", os.path.join(ROOT, "benchmarks", "rl_step.py"))
RS = importlib.util.module_from_spec(spec)
spec.loader.exec_module(RS)


def _row(gen, fb, opt, sync, step, gap=0.0):
    return {"time/generate_s": gen, "time/forward_backward_s": fb, "time/optimizer_s": opt,
            "time/sync_save_s": sync / 2, "time/sync_swap_s": sync / 2, "time/sync_verify_s": 0.0,
            "time/step_s": step, "bit_wise/logprob_diff/max": gap}


def test_medians_skip_the_warm_up_and_sum_the_push():
    rows = [_row(100, 100, 100, 100, 100, 0.5), _row(1, 2, 3, 4, 10), _row(3, 2, 1, 6, 12), _row(2, 2, 2, 5, 11)]
    m = RS.medians(rows)
    assert m["rollout (generate)"] == 2 and m["optimizer"] == 2 and m["weight push (save + swap + verify)"] == 5
    assert m["whole step"] == 11 and m["steps timed"] == 3 and m["max logprob gap"] == 0.5
    assert RS.medians(rows[:1])["steps timed"] == 1  # one step only: it is all there is


def test_table_ratio_is_vllm_bi_over_stock():
    stock = RS.medians([_row(9, 9, 9, 9, 9), _row(1, 2, 1, 1, 5, 0.01)])
    bi = RS.medians([_row(9, 9, 9, 9, 9), _row(1.5, 2.2, 1, 1, 5.7)])
    text = "\n".join(RS.table({"stock": stock, "vllm_bi": bi}))
    assert "| rollout (generate) | 1.000 | 1.500 | 1.50x |" in text
    assert "| whole step | 5.000 | 5.700 | 1.14x |" in text
    assert "| max logprob gap | 0.01 | 0 | |" in text


def test_peak_memory_row_is_the_max_over_all_steps_and_absent_without_it():
    """The trainer's peak GPU memory (CUDA runs write ``memory/peak_allocated_gib``) is the max over every step, the
    warm-up included (the first AdamW update allocates the moments); a run without it (CPU) has no such row."""
    rows = [dict(_row(9, 9, 9, 9, 9), **{RS.PEAK: 40.5}), dict(_row(1, 2, 1, 1, 5), **{RS.PEAK: 38.0})]
    bi = RS.medians(rows)
    stock = RS.medians([_row(9, 9, 9, 9, 9), _row(1, 2, 1, 1, 5)])
    assert bi["trainer peak memory"] == 40.5 and stock["trainer peak memory"] is None
    text = "\n".join(RS.table({"stock": stock, "vllm_bi": bi}))
    assert f"| {RS.PEAK_LABEL} |  | 40.5 | |" in text
    assert RS.PEAK_LABEL in "\n".join(RS.one_side({"vllm_bi": bi}))
    assert RS.PEAK_LABEL not in "\n".join(RS.table({"stock": stock, "vllm_bi": stock}))
    assert RS.PEAK_LABEL not in "\n".join(RS.one_side({"stock": stock}))


def test_one_side_table_holds_that_side_only():
    bi = RS.medians([_row(9, 9, 9, 9, 9), _row(1.5, 2.2, 1, 3, 5.7)])
    text = "\n".join(RS.one_side({"vllm_bi": bi}))
    assert "| part (median s per step) | vllm_bi |" in text and "stock" not in text
    assert "| weight push (save + swap + verify) | 3.000 |" in text and "| steps timed | 1 |" in text


def _write(path, rows):
    import json
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_reuse_reads_an_earlier_side_and_runs_the_other(tmp_path, monkeypatch, capsys):
    """Both sides of a step that does not fit one call: the stock side's metrics from an earlier call on the same
    machine (its --run-root), the vllm_bi side run now; the table holds both."""
    import sys
    root = tmp_path / "rl"
    _write(str(root / "stock" / "metrics.jsonl"), [_row(9, 9, 9, 9, 9), _row(1, 2, 1, 1, 5, 0.3)])
    (root / "stock" / RS.COMMAND_FILE).write_text("python -m vllm_bi.trainer --arithmetic stock --x 0.25\n")
    ran = []

    def fake_run(side, model, steps, run_root, extra):
        ran.append(side)
        path = os.path.join(run_root, side, "metrics.jsonl")
        _write(path, [_row(9, 9, 9, 9, 9), _row(1.5, 2.2, 1, 1, 5.7)])
        return path

    monkeypatch.setattr(RS, "run_side", fake_run)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    out = tmp_path / "rl_step.md"
    monkeypatch.setattr(sys, "argv", ["rl_step.py", "--model", "m", "--steps", "2", "--run-root", str(root),
                                      "--sides", "vllm_bi", "--reuse", "stock", "--out", str(out)])
    assert RS.main() == 0
    assert ran == ["vllm_bi"]
    text = out.read_text()
    assert "| whole step | 5.000 | 5.700 | 1.14x |" in text and "| max logprob gap | 0.3 | 0 | |" in text
    # each side's own command: the reused side's from its run dir (the fake run here wrote none)
    assert "stock: python -m vllm_bi.trainer --arithmetic stock --x 0.25\n" in text
    assert "vllm_bi: (not recorded)\n" in text


def test_a_side_records_its_trainer_command(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(RS.subprocess, "run", lambda cmd, check: ran.append(cmd))
    path = RS.run_side("vllm_bi", "/m", 3, str(tmp_path), ["--server-args", "--gpu-memory-utilization 0.2"])
    assert path == os.path.join(str(tmp_path), "vllm_bi", "metrics.jsonl") and len(ran) == 1
    recorded = (tmp_path / "vllm_bi" / RS.COMMAND_FILE).read_text()
    assert recorded.endswith("--server-args '--gpu-memory-utilization 0.2'\n") and "--arithmetic vllm_bi" in recorded


def test_reuse_without_the_earlier_run_is_refused(tmp_path, monkeypatch, capsys):
    import sys
    import pytest
    monkeypatch.setattr(sys, "argv", ["rl_step.py", "--model", "m", "--run-root", str(tmp_path), "--sides",
                                      "vllm_bi", "--reuse", "stock"])
    with pytest.raises(SystemExit) as e:
        RS.main()
    assert e.value.code == 2 and "no " in capsys.readouterr().err
