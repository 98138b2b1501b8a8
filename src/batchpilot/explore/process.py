"""Runs one probe (or the study) in a fresh Python process with a timeout, and reads its one JSON line.

Whatever happens in the child (a crash, a kill by the kernel, a hang, garbage on stdout) becomes a
result here; only a problem with the user's input (`user_error`) is raised, by the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from batchpilot.explore.records import RESULT_MARKER, ProbeRequest, ProbeResult


def run_child(*, module: str, payload: str, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """Runs `python -m module` with `payload` on stdin.

    Returns:
        (the decoded result line or None, a one-line reason when there is no result).
    """
    # A new session, so a timeout kills the child and anything it started (compile workers, loaders).
    process = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.communicate()
        return None, f"timed out after {timeout_s:.0f} s (explore.probe_timeout_s)"
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            try:
                return json.loads(line[len(RESULT_MARKER) + 1 :]), ""
            except ValueError:
                break
    return None, _crash_reason(process.returncode, stderr)


def _kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _crash_reason(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's out-of-memory killer?)" if name == "SIGKILL" else ""
        return f"the probe process was killed by {name}{hint}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    return f"the probe process exited with {returncode}: {last.strip()[:300]}"


def run_probe(*, request: ProbeRequest, timeout_s: float) -> ProbeResult:
    """One probe in a fresh process; a crash or a hang is a result that does not fit."""
    started = time.perf_counter()
    data, reason = run_child(
        module="batchpilot.explore.probe", payload=request.to_json(), timeout_s=timeout_s
    )
    result = ProbeResult.not_fitting(request, error=reason) if data is None else ProbeResult.from_dict(data)
    result.duration_s = time.perf_counter() - started
    return result
