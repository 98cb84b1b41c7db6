#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Reinstall the working tree's vllm_bi (vLLM's worker processes import the installed copy).
.venv/bin/pip install -q --no-deps --force-reinstall .
# Whether the CUDA sources are the ones the last GPU gate ran (CI cannot run them: no GPU there)
.venv/bin/python -m vllm_bi.gpu_gate
# The tiers: `bash scripts/test.sh -m "not server"` skips every test that starts a vLLM engine (minutes, not most
# of an hour); CI runs everything.
rm -f test-durations.txt
rc=0
.venv/bin/python -m pytest tests -v "$@" || rc=$?
[ -f test-durations.txt ] && cat test-durations.txt
exit $rc
