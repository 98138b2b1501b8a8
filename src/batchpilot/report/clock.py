"""The run's wall clock, from what its records say: the canary's canary.json and explore's explore.json
(`started_at`, `finished_at`: unix seconds) and each metrics record's `time` (a step's end). The run begins
with its first task that left a time and ends at its last record; what the tasks and the steps leave of
that time went to planning, launches, resizes, checkpoints and evaluation."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from batchpilot.planning.units import format_duration


@dataclass(frozen=True)
class Span:
    """One part of the run that recorded its start and end (unix seconds)."""

    name: str
    """How the wall-time card names it: `the canary`, `explore`, `training steps`."""
    start: float
    end: float


@dataclass(frozen=True)
class RunClock:
    """When the run began and ended, and the parts that say how long they took."""

    tasks: tuple[Span, ...]
    """The canary and explore, when their files recorded their times, in the order they ran."""
    steps: Span | None
    """From the first step's start to the last step's end; None before a step or without `time`."""
    trained_s: float
    """The sum of the step times: training alone."""
    steps_unclocked: bool
    """Steps ran whose records carry no wall clock (records of a batchpilot before `time`)."""

    @property
    def started_at(self) -> float | None:
        starts = [t.start for t in self.tasks] + ([self.steps.start] if self.steps else [])
        return min(starts, default=None)

    @property
    def ended_at(self) -> float | None:
        """The run's last record: the last step's end, else the last task's."""
        if self.steps_unclocked:
            return None
        ends = [t.end for t in self.tasks] + ([self.steps.end] if self.steps else [])
        return max(ends, default=None)

    @property
    def wall_s(self) -> float | None:
        start, end = self.started_at, self.ended_at
        return None if start is None or end is None else end - start

    def first(self) -> Span | None:
        """The part that began the run."""
        parts = [*self.tasks, *([self.steps] if self.steps else [])]
        return min(parts, key=lambda span: span.start, default=None)


def _task_span(name: str, record: dict[str, Any] | None) -> Span | None:
    if not record or record.get("started_at") is None or record.get("finished_at") is None:
        return None
    return Span(name, float(record["started_at"]), float(record["finished_at"]))


def run_clock(
    *, records: list[dict[str, Any]], canary: dict[str, Any] | None, explore: dict[str, Any] | None
) -> RunClock:
    """The run's clock from its canary.json, its explore.json and its metrics records (any may be None or
    empty: a run that stopped early, or files written before they recorded a time)."""
    tasks = [span for span in (_task_span("the canary", canary), _task_span("explore", explore)) if span]
    trained_s = sum(float(r.get("step_time_s") or 0.0) for r in records)
    clocked = [r for r in records if r.get("time") is not None]
    steps = None
    if records and len(clocked) == len(records):
        first = records[0]
        steps = Span(
            "training steps",
            float(first["time"]) - float(first.get("step_time_s") or 0.0),
            max(float(r["time"]) for r in records),
        )
    return RunClock(
        tasks=tuple(sorted(tasks, key=lambda span: span.start)),
        steps=steps,
        trained_s=trained_s,
        steps_unclocked=bool(records) and steps is None,
    )


def wall_detail(clock: RunClock) -> str:
    """What the wall time covers, its parts adding up to it: `from the canary's start to the last step: the
    canary 7.5 s, explore 59 s, training steps 33 s and 20 s of planning, launches, resizes, checkpoints
    and evaluation`."""
    wall = clock.wall_s
    assert wall is not None
    if not clock.tasks:
        between = max(0.0, wall - clock.trained_s)
        return f"first step to last; {format_duration(between)} of it launches, resizes, checkpoints and evaluation"
    first = clock.first()
    assert first is not None
    start = f"{first.name}'s start" if first.name != "training steps" else "the first step"
    end = "the last step" if clock.steps else "the last record"
    parts = [f"{t.name} {format_duration(t.end - t.start)}" for t in clock.tasks]
    if clock.steps:
        parts.append(f"training steps {format_duration(clock.trained_s)}")
    rest = format_duration(max(0.0, wall - sum(t.end - t.start for t in clock.tasks) - clock.trained_s))
    if not clock.steps:
        return f"from {start} to {end}: {', '.join(parts)} and {rest} between them"
    return (
        f"from {start} to {end}: {', '.join(parts)} and {rest} of planning, launches, resizes, checkpoints "
        "and evaluation"
    )


def local_time(unix_s: float) -> str:
    """`2026-11-27T17:38:26+01:00`: the time in this machine's time zone, with its UTC offset."""
    return datetime.datetime.fromtimestamp(unix_s, tz=datetime.UTC).astimezone().isoformat(timespec="seconds")
