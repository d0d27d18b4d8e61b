#!/usr/bin/env bash
# Create ./.venv and install Precision Lab with its test tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of PyTorch (a CUDA build is several GB; GPU hosts install the build that fits their driver).
python -m pip install -q "torch==${PLAB_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test]"
