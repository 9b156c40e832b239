#!/usr/bin/env bash
# Set up .venv from a clean state: the CPU build of PyTorch first (so that no CUDA build is pulled in),
# then ntkgp in editable mode with its test, example and docs extras. Pip's output goes to .venv/bootstrap.log
# and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/bootstrap.log
: > "$log"
step() {
  if ! "$@" >> "$log" 2>&1; then
    cat "$log" >&2
    echo "bootstrap: failed: $*" >&2
    exit 1
  fi
}
step .venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # On the project's machines a CPU wheel of torch 2.13.0 lies on disk; elsewhere pip resolves torch>=2.2.
  .venv/bin/python -m pip install -q "torch==2.13.0" >> "$log" 2>&1 || step .venv/bin/python -m pip install -q "torch>=2.2"
fi
step .venv/bin/python -m pip install -q -e ".[test,examples,docs]"
.venv/bin/python -c "import ntkgp, torch, gpytorch; print(f'ntkgp {ntkgp.__version__}, torch {torch.__version__}, gpytorch {gpytorch.__version__}')"
