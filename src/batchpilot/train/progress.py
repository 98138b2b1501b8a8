"""The main trainer's progress record, read while it trains by the task that asks for the next launch's nodes
ahead of time (`workflow.ahead`, `planning.ahead`): the samples consumed, when, and the recent rate.

Written at most every `EVERY_S` seconds, from a thread (a write to a bucket must not hold up the steps), one in
flight at a time; the first once a rate is measured (two steps). Not part of a checkpoint: a resumed job
writes its own from its first steps.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from batchpilot import runstate

EVERY_S = 10.0
"""How often the record is written (a small object: cheap on a bucket; its reader polls about as often)."""
WINDOW_STEPS = 20
"""The rate is measured over at most this many recent steps."""


class ProgressWriter:
    """Takes every step record of the main process; writes the launch's progress now and then."""

    def __init__(self, checkpoint_uri: str, *, stages: Sequence[int], every_s: float = EVERY_S) -> None:
        self.checkpoint_uri, self.stages, self.every_s = checkpoint_uri, list(stages), every_s
        self._recent: deque[tuple[float, int]] = deque(maxlen=WINDOW_STEPS)
        self._written_s = float("-inf")
        self._writing: threading.Thread | None = None

    def note(self, *, consumed: int, at_s: float) -> None:
        self._recent.append((at_s, consumed))
        if len(self._recent) < 2 or time.monotonic() - self._written_s < self.every_s:
            return
        if self._writing is not None and self._writing.is_alive():
            return
        (first_s, first), (last_s, last) = self._recent[0], self._recent[-1]
        if last_s <= first_s or last <= first:
            return
        progress = {"consumed": last, "at_s": last_s, "samples_per_s": (last - first) / (last_s - first_s)}
        self._written_s = time.monotonic()
        self._writing = threading.Thread(
            target=runstate.write_progress,
            args=(self.checkpoint_uri,),
            kwargs={"stages": self.stages, "progress": progress},
            name="progress-writer",
            daemon=True,
        )
        self._writing.start()
