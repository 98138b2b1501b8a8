#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, format check, type check, then every test.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for a quick loop.
# Then the XLA runtime's tests (tests/xla) in their own venv, .venv-xla (torch/torch_xla 2.9.0 on CPU:
# about 2.5 minutes to install once, about 2.5 to run); BATCHPILOT_XLA_TESTS=0 leaves them out of a quick loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/pytest --durations=25 "$@"
if [ "${BATCHPILOT_XLA_TESTS:-1}" != "0" ]; then
  echo "== XLA runtime: scripts/setup_xla.sh, then pytest tests/xla in .venv-xla (PJRT_DEVICE=CPU)"
  bash scripts/setup_xla.sh
  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -p no:cacheprovider -q --durations=0 tests/xla
fi
