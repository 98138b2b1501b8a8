"""Logging: library modules log through `logging.getLogger(__name__)`; entry points decide what shows.

Every batchpilot logger lives under the `batchpilot` logger. `configure_console` (called by the CLI and
by each pipeline component) prints its INFO lines as `[batchpilot] message` on stdout, the form that
`batchpilot run --local` picks out of a task's output for the console.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

PREFIX = "[batchpilot] "
"""Every console line of batchpilot's loggers starts with this."""

_HANDLER_NAME = "batchpilot-console"


class _ConsoleHandler(logging.StreamHandler):
    """Writes to `stream`, or to whatever `sys.stdout` / `sys.stderr` is at the time of each record
    (redirections and test captures replace them)."""

    def __init__(self, stream: TextIO | None, *, stderr: bool = False) -> None:
        super().__init__(stream or (sys.stderr if stderr else sys.stdout))
        self._follow = None if stream is not None else ("stderr" if stderr else "stdout")

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow is not None:
            self.stream = getattr(sys, self._follow)
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # The reader went away (`batchpilot ... | head`): drop the line without logging's traceback; the
        # command's next print meets the same closed pipe and `batchpilot.cli` ends it quietly.
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            return
        super().handleError(record)


def configure_console(*, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Prints the `batchpilot` loggers' records at `level` and above: INFO as `[batchpilot] message` on
    `stream` (default: stdout), warnings and errors as `[batchpilot] warning: message` on stderr.

    Idempotent: a second call replaces the handlers instead of adding more.
    """
    root = logging.getLogger("batchpilot")
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)
    info = _ConsoleHandler(stream)
    info.addFilter(lambda record: record.levelno < logging.WARNING)
    info.setFormatter(logging.Formatter(PREFIX + "%(message)s"))
    problems = _ConsoleHandler(None, stderr=True)
    problems.setLevel(logging.WARNING)
    problems.setFormatter(_LevelFormatter(PREFIX + "%(levelname_lower)s: %(message)s"))
    for handler in (info, problems):
        handler.set_name(_HANDLER_NAME)
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


class _LevelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.levelname_lower = record.levelname.lower()
        return super().format(record)
