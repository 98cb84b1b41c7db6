#!/usr/bin/env bash
# GPU kernel tests on a CUDA machine without network (the H200):
# installs the wheels carried in .wheels/ (fla-core, einops, pytest) into .gpu_deps/ and runs
# `pytest -m gpu tests/gpu`. Prepare the wheels here with:
#   pip download --no-deps fla-core==0.6.0 einops pytest pluggy iniconfig -d .wheels
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --target .gpu_deps .wheels/*.whl
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
exec python3 -m pytest -p no:cacheprovider -m gpu tests/gpu -v -rs "$@"
