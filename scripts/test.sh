#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Reinstall the working tree's vllm_bi (vLLM's worker processes import the installed copy).
rm -rf build  # setuptools keeps removed modules in build/lib and would install them again
.venv/bin/pip install -q --no-deps --force-reinstall .
# Whether the CUDA sources are the ones the last GPU gate ran (CI cannot run them: no GPU there)
.venv/bin/python -m vllm_bi.gpu_gate
# The package's layering and acyclicity (import-linter contracts in pyproject.toml)
.venv/bin/lint-imports
# The tiers: `bash scripts/test.sh -m "not server"` skips every test that starts a vLLM engine (minutes, not most
# of an hour); `-m extended` runs the served checks too slow for CI's budget; CI runs everything else.
rm -f test-durations.txt* test-durations.shard-*
rc=0
if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest tests -v "$@" || rc=$?
else
  # The whole suite in two pytest processes at once: most of its time is vLLM engines starting and serving, and
  # vLLM binds a CPU engine's compute threads to core 0 by default; so each shard's engines get a core of their own
  # (VLLM_CPU_OMP_THREADS_BIND; the tensor-parallel test sets its two ranks' cores itself). Shard A holds the
  # serving, tensor-parallel, CLI, parity-CLI, weight-reload, TRL, benchmark and non-finite-guard modules, shard B
  # the rest (about half the time each); the logs are printed one after the other when both are done.
  A=(tests/e2e/test_serving_qwen3_next.py tests/e2e/test_serving_qwen3_5.py tests/e2e/test_tensor_parallel.py
     tests/e2e/test_cli.py tests/e2e/test_chunk_mode.py tests/e2e/test_diag.py
     tests/test_patch_ledger.py tests/e2e/test_weight_reload.py tests/e2e/test_speculative.py
     tests/integrations/test_trl_grpo.py tests/e2e/test_parity_cli.py tests/e2e/test_benchmarks.py
     tests/e2e/test_nonfinite_guard.py)
  B=(); for f in "${A[@]}"; do B+=(--ignore "$f"); done
  # Each shard's pytest process (and what it starts) on that core too: a shard's own torch work (the trainer's
  # recomputes, the interpreter kernels) spread over both cores slowed the other shard's engine down.
  on_core() { local c="$1"; shift; if command -v taskset >/dev/null; then taskset -c "$c" "$@"; else "$@"; fi; }
  echo "running the suite in two shards (logs: test-shard-a.log, test-shard-b.log) ..."
  tmp=$(mktemp -d)  # each shard its own pytest temp root: neither cleans up the other's folders
  trap 'rm -rf "$tmp"' EXIT  # about 1.6 GB of models and logs a run: left behind, runs fill the machine's disk
  VLLM_CPU_OMP_THREADS_BIND=0 TEST_DURATIONS_FILE=test-durations.shard-a on_core 0 .venv/bin/python -m pytest "${A[@]}" -v -m "not extended" --basetemp "$tmp/a" \
    > test-shard-a.log 2>&1 &
  pa=$!
  VLLM_CPU_OMP_THREADS_BIND=1 TEST_DURATIONS_FILE=test-durations.shard-b on_core 1 .venv/bin/python -m pytest tests "${B[@]}" -v -m "not extended" --basetemp "$tmp/b" \
    > test-shard-b.log 2>&1 &
  pb=$!
  wait $pa || rc=$?
  wait $pb || rc=$?
  for s in a b; do echo "===== shard $s ====="; cat "test-shard-$s.log"; done
  .venv/bin/python - <<'PY'
import json, os, sys
sys.path.insert(0, "tests")
from conftest import write_durations
merged = {}
for s in ("a", "b"):
    path = f"test-durations.shard-{s}.json"
    if os.path.exists(path):
        merged.update(json.load(open(path)))
if merged:
    write_durations(merged, "test-durations.txt")
PY
fi
[ -f test-durations.txt ] && cat test-durations.txt
exit $rc
