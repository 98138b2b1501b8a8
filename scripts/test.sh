#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, format check, type check, then every test.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for a quick loop.
# And the XLA runtime's tests (tests/xla) in their own venv, .venv-xla (torch/torch_xla 2.9.0 on CPU: about
# 2.5 minutes to install once, about 3.5 to run alone); BATCHPILOT_XLA_TESTS=0 leaves them out of a quick loop.
# The XLA venv is installed, then its tests run, in the background while the main tests run, at a lower CPU
# priority (nice 10): they take the CPU the main tests leave idle (about a sixth of 2 cores: the main tests
# wait on trainer processes, servers and simulators) and the tail where one pytest worker has finished, so
# they cost the main tests little and the whole run about their length less than running them after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
xla=${BATCHPILOT_XLA_TESTS:-1}
if [ "$xla" != "0" ]; then
  xla_log=$(mktemp -t batchpilot-setup-xla.XXXXXX)
  xla_test_log=$(mktemp -t batchpilot-xla-tests.XXXXXX)
  echo "== scripts/setup_xla.sh, then pytest tests/xla in .venv-xla (PJRT_DEVICE=CPU, nice 10), in the background"
  echo "   (outputs: $xla_log, $xla_test_log)"
  (
    bash scripts/setup_xla.sh > "$xla_log" 2>&1 || exit 3
    PJRT_DEVICE=CPU exec nice -n 10 .venv-xla/bin/python -m pytest -p no:cacheprovider -q --durations=0 \
      tests/xla > "$xla_test_log" 2>&1
  ) &
  xla_job=$!
  trap 'pkill -P "$xla_job" 2>/dev/null || true; kill "$xla_job" 2>/dev/null || true' EXIT
fi
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
# Two pytest workers (pytest-xdist), each taking whole files (a module's fixtures run once): most tests wait on
# trainer processes, servers and simulators, so two streams fill 2 cores; BATCHPILOT_TEST_WORKERS=0 runs serially.
workers=${BATCHPILOT_TEST_WORKERS:-2}
echo "== pytest ($workers worker(s))"
main=0
.venv/bin/pytest -n "$workers" --dist loadfile --durations=25 "$@" || main=$?
if [ "$xla" != "0" ]; then
  echo "== XLA runtime: waiting for its tests in the background (scripts/setup_xla.sh, then pytest tests/xla)"
  xla_code=0
  wait "$xla_job" || xla_code=$?
  trap - EXIT
  if [ "$xla_code" = "3" ]; then
    cat "$xla_log"
    echo "scripts/setup_xla.sh failed (its output above)" >&2
    exit 1
  fi
  tail -n 3 "$xla_log"
  cat "$xla_test_log"
  if [ "$xla_code" != "0" ]; then
    echo "the XLA runtime's tests failed (pytest tests/xla in .venv-xla: exit $xla_code, its output above)" >&2
    [ "$main" != "0" ] || main=$xla_code
  fi
fi
exit "$main"
