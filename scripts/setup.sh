#!/usr/bin/env bash
# Creates ./.venv and installs batchpilot with every extra and the dev tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first, pinned to the CPU build: a bare `torch` requirement can pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import batchpilot, torch, kfp; print('batchpilot', batchpilot.__version__, 'ready in .venv (torch', torch.__version__ + ')')"
