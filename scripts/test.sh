#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, format check, type check, then every test.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for a quick loop.
# Then the XLA runtime's tests (tests/xla) in their own venv, .venv-xla (torch/torch_xla 2.9.0 on CPU:
# about 2.5 minutes to install once, about 2.5 to run); BATCHPILOT_XLA_TESTS=0 leaves them out of a quick loop.
# The XLA venv is installed in the background while the main tests run (mostly downloads and unpacking),
# and waited for before its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
xla=${BATCHPILOT_XLA_TESTS:-1}
if [ "$xla" != "0" ]; then
  xla_log=$(mktemp -t batchpilot-setup-xla.XXXXXX)
  echo "== scripts/setup_xla.sh in the background (its output: $xla_log)"
  bash scripts/setup_xla.sh > "$xla_log" 2>&1 &
  xla_setup=$!
  trap 'kill "$xla_setup" 2>/dev/null || true' EXIT
fi
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
# Three pytest workers (pytest-xdist), each taking whole files (a module's fixtures run once): most tests wait on
# trainer processes, servers and simulators, and two streams left about a sixth of 2 cores idle (a clean-clone
# run, 2026-12-07: 1.68 cores busy on average); BATCHPILOT_TEST_WORKERS=0 runs serially.
workers=${BATCHPILOT_TEST_WORKERS:-3}
echo "== pytest ($workers worker(s))"; .venv/bin/pytest -n "$workers" --dist loadfile --durations=25 "$@"
if [ "$xla" != "0" ]; then
  echo "== XLA runtime: waiting for scripts/setup_xla.sh, then pytest tests/xla in .venv-xla (PJRT_DEVICE=CPU)"
  if ! wait "$xla_setup"; then
    cat "$xla_log"
    echo "scripts/setup_xla.sh failed (its output above)" >&2
    exit 1
  fi
  trap - EXIT
  cat "$xla_log"
  # two workers, whole files each: most of an XLA test is one compiling process
  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -p no:cacheprovider -q -n 2 --dist loadfile --durations=0 tests/xla
fi
