"""The bad-input suite: each command's realistic mistakes, run as a user runs them.

Every case asserts the same contract (`Mistake.assert_refused`): exit status 2, exactly one error line on
stderr naming the problem (argparse's usage block aside), no traceback, and no debris: the folders the
command could write to are unchanged (no new, removed or modified file, no lock file left).

`run_cli` calls `batchpilot.cli.main` in this process (fast: no interpreter start per case);
`run_process` starts `python -m batchpilot` for the cases that need a real process (a broken pipe, a signal).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from batchpilot.cli import main


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        """stderr without argparse's usage block (its `usage:` line and the lines it wraps onto)."""
        lines = self.stderr.splitlines()
        kept: list[str] = []
        in_usage = False
        for line in lines:
            if line.startswith("usage:"):
                in_usage = True
                continue
            if in_usage and line.startswith(" "):
                continue
            in_usage = False
            if line.strip():
                kept.append(line)
        return kept

    def assert_refused(self, *fragments: str, code: int = 2) -> str:
        """Exit `code`, one error line containing every fragment (case-insensitive), no traceback.
        Returns that line."""
        assert "Traceback" not in self.stderr + self.stdout, self.stderr
        assert self.code == code, (self.code, self.stdout[-2000:], self.stderr[-2000:])
        lines = self.error_lines()
        assert len(lines) == 1, lines
        (line,) = lines
        assert "error" in line.lower(), line
        for fragment in fragments:
            assert fragment.lower() in line.lower(), (fragment, line)
        assert "\x1b[" not in line, repr(line)
        return line


def run_cli(*argv: str) -> Outcome:
    """`batchpilot ARGV` in this process; SystemExit (argparse) becomes the exit code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return Outcome(code, out.getvalue(), err.getvalue())


def run_process(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> Outcome:
    """`python -m batchpilot ARGV` in a real process."""
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return Outcome(result.returncode, result.stdout, result.stderr)


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folders`: path -> (size, mtime_ns); folders have size -1."""
    state: dict[str, tuple[int, int]] = {}
    for folder in folders:
        if not folder.exists():
            continue
        for path in [folder, *folder.rglob("*")]:
            stat = path.stat()
            state[str(path)] = (-1 if path.is_dir() else stat.st_size, stat.st_mtime_ns)
    return state


@contextlib.contextmanager
def no_debris(*folders: Path) -> Iterable[None]:
    """Asserts that the body leaves `folders` exactly as it found them."""
    before = snapshot(*folders)
    yield
    after = snapshot(*folders)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p] and before[p][0] != -1)
    assert not (added or removed or changed), {"added": added, "removed": removed, "changed": changed}


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` of a process a test Ctrl-Cs: SIGINT back to its default. A process started in the
    background of a non-interactive shell (CI scripts, `cmd &`) inherits SIGINT ignored, and Python then
    installs no KeyboardInterrupt handler, so the test's Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
