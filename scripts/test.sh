#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Reinstall the working tree's vllm_bi (vLLM's worker processes import the installed copy).
.venv/bin/pip install -q --no-deps --force-reinstall .
# Whether the CUDA sources are the ones the last GPU gate ran (CI cannot run them: no GPU there)
.venv/bin/python -m vllm_bi.gpu_gate
exec .venv/bin/python -m pytest tests -v --durations=15 "$@"
