"""Runs one probe (or the study) as fresh Python processes with a timeout, and reads their JSON lines.

A probe is one process, or under fsdp/hsdp one process per device of a node joined in a process group
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` on loopback, as
torchrun sets them). All of a probe's processes form one process group of their own: whatever ends the
probe (the last rank's result, a rank that ran out of memory while the others wait in its collectives, a
crash, the timeout) kills that whole group, so no rank, compile worker or data reader is left behind.

Whatever happens in the children (a crash, a kill by the kernel, a hang, garbage on stdout) becomes a
result here; only a problem with the user's input (`user_error`) is raised, by the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot.explore.records import RESULT_MARKER, ProbeRequest, ProbeResult, merge_ranks

POLL_INTERVAL_S = 0.02


@dataclass
class Ranks:
    """What the processes of one probe or study reported.

    Attributes:
        results: each reporting rank's result line, by rank.
        reason: why a rank has no result (a crash, a signal, the timeout); empty when none failed so.
    """

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    reason: str = ""


def rank_env(*, rank: int, processes: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of a one-node job of `processes` processes."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(processes),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(
    *,
    module: str,
    payload: str,
    timeout_s: float,
    processes: int = 1,
    failed: Callable[[dict[str, Any]], bool] = lambda _: False,
    timeout_field: str = "explore.probe_timeout_s",
) -> Ranks:
    """Runs `python -m module` as `processes` ranks, each with `payload` on stdin.

    Returns as soon as every rank reported, one rank exited without a result, a rank reported a result
    that `failed` (its peers may be waiting for it in a collective), or `timeout_s` passed; then kills
    the probe's process group.
    """
    from batchpilot.ports import free_port

    with tempfile.TemporaryDirectory(prefix="batchpilot-probe-") as name:
        folder = Path(name)
        (folder / "request.json").write_text(payload)
        port = free_port()
        children: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(processes):
                group = children[0].pid if children else 0  # rank 0 leads a new group; the others join it
                children.append(
                    _start(module, folder, rank, rank_env(rank=rank, processes=processes, port=port), group)
                )
            deadline_s = time.monotonic() + timeout_s
            return _wait(
                children,
                folder,
                deadline_s=deadline_s,
                failed=failed,
                timeout_message=(f"timed out after {timeout_s:.0f} s ({timeout_field})"),
            )
        finally:
            if children:
                _kill_group(children[0].pid)
            for child in children:
                child.wait()


def _start(module: str, folder: Path, rank: int, env: dict[str, str], group: int) -> subprocess.Popen[bytes]:
    with (
        (folder / "request.json").open("rb") as stdin,
        (folder / f"rank{rank}.out").open("wb") as stdout,
        (folder / f"rank{rank}.err").open("wb") as stderr,
    ):
        return subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, **env},
            process_group=group,
        )


def _wait(
    children: list[subprocess.Popen[bytes]],
    folder: Path,
    *,
    deadline_s: float,
    failed: Callable[[dict[str, Any]], bool],
    timeout_message: str,
) -> Ranks:
    ranks = Ranks()
    running = set(range(len(children)))
    while running:
        if time.monotonic() > deadline_s:
            ranks.reason = timeout_message
            return ranks
        for rank in sorted(running):
            returncode = children[rank].poll()
            if returncode is None:
                continue
            running.discard(rank)
            result = result_line((folder / f"rank{rank}.out").read_text(errors="replace"))
            if result is None:
                stderr = (folder / f"rank{rank}.err").read_text(errors="replace")
                who = "the probe process" if len(children) == 1 else f"probe rank {rank} of {len(children)}"
                ranks.reason = crash_reason(who, returncode, stderr)
                return ranks
            ranks.results[rank] = result
            if failed(result):
                return ranks
        time.sleep(POLL_INTERVAL_S)
    return ranks


def result_line(stdout: str) -> dict[str, Any] | None:
    """The decoded `RESULT_MARKER {json}` line (the last one), or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            try:
                data = json.loads(line[len(RESULT_MARKER) + 1 :])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def crash_reason(who: str, returncode: int, stderr: str) -> str:
    """`the probe process was killed by SIGKILL (...)`, `... exited with 3: <its last stderr line>`."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's out-of-memory killer?)" if name == "SIGKILL" else ""
        return f"{who} was killed by {name}{hint}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    return f"{who} exited with {returncode}: {last.strip()[:300]}"


def _probe_failed(result: dict[str, Any]) -> bool:
    return not result.get("fits") or bool(result.get("user_error"))


def run_probe(*, request: ProbeRequest, timeout_s: float) -> ProbeResult:
    """One probe as `request.processes` fresh processes; a crash, a hang or any rank out of memory is a
    result that does not fit."""
    started = time.perf_counter()
    ranks = run_ranks(
        module="batchpilot.explore.probe",
        payload=request.to_json(),
        timeout_s=timeout_s,
        processes=request.processes,
        failed=_probe_failed,
    )
    result = merge_ranks(request, results=ranks.results, reason=ranks.reason)
    result.duration_s = time.perf_counter() - started
    return result
