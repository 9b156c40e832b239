#!/usr/bin/env bash
# Set up .venv from a clean state: the CPU build of PyTorch first (so that no CUDA build is pulled in),
# then ntkgp in editable mode with its test and example extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # On the project's machines a CPU wheel of torch 2.13.0 lies on disk; elsewhere pip resolves torch>=2.2.
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null || .venv/bin/python -m pip install -q "torch>=2.2"
fi
.venv/bin/python -m pip install -q -e ".[test,examples]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import ntkgp, torch, gpytorch; print(f'ntkgp {ntkgp.__version__}, torch {torch.__version__}, gpytorch {gpytorch.__version__}')"
