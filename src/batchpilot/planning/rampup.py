"""Global batch size as a pure function of consumed_samples, in the three ramp-up forms.

Every form becomes one `BatchSchedule`: thresholds (in samples) at which the global batch size changes.
A training step that starts at `consumed` uses `batch_at(consumed)`; because a step may overshoot a
threshold, the batch changes at the first step that starts at or after it (Megatron/NeMo semantics).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import raise_problems
from batchpilot.planning.units import parse_count, parse_threshold


@dataclass(frozen=True)
class BatchSchedule:
    """Piecewise-constant global batch size over consumed samples.

    Attributes:
        thresholds: first consumed sample of each level; starts at 0, strictly increasing.
        batch_sizes: the global batch size of each level; strictly increasing, the last is the target.
    """

    thresholds: tuple[int, ...]
    batch_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.thresholds and self.thresholds[0] == 0, self.thresholds
        assert len(self.thresholds) == len(self.batch_sizes)
        assert all(a < b for a, b in zip(self.thresholds, self.thresholds[1:], strict=False))
        assert all(a < b for a, b in zip(self.batch_sizes, self.batch_sizes[1:], strict=False))
        assert self.batch_sizes[0] > 0

    @property
    def target(self) -> int:
        """The final (largest) global batch size."""
        return self.batch_sizes[-1]

    @property
    def ramp_end_sample(self) -> int:
        """The consumed-sample threshold from which the target batch applies."""
        return self.thresholds[-1]

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch size of a step that starts at `consumed_samples`."""
        assert consumed_samples >= 0
        return self.batch_sizes[bisect.bisect_right(self.thresholds, consumed_samples) - 1]

    def next_change_after(self, consumed_samples: int) -> int | None:
        """The first threshold strictly after `consumed_samples`, or None once at the target."""
        index = bisect.bisect_right(self.thresholds, consumed_samples)
        return self.thresholds[index] if index < len(self.thresholds) else None


def constant_schedule(global_batch_size: int) -> BatchSchedule:
    """No ramp-up: the target batch from sample 0."""
    return BatchSchedule(thresholds=(0,), batch_sizes=(global_batch_size,))


MAX_RAMP_LEVELS = 10_000
"""The most batch sizes a ramp-up may step through before it is refused outright (the stage limit,
`planning.stages.MAX_STAGES`, is checked on the stages they make; this bound keeps that check instant)."""


def _check_increments(*, start: int, increment: int, target: int, field: str) -> int:
    if start <= 0 or increment <= 0:
        raise BatchpilotError(field, f"start ({start}) and increment ({increment}) must be positive")
    if start >= target:
        raise BatchpilotError(
            field,
            f"start ({start}) must be smaller than the target global batch size ({target})",
            "lower the start or remove the ramp-up",
        )
    if (target - start) % increment:
        lower = target - ((target - start) // increment) * increment
        raise BatchpilotError(
            field,
            f"(target {target} - start {start}) is not a multiple of increment {increment}",
            f"use a start such as {lower} or an increment that divides {target - start}",
        )
    levels = (target - start) // increment + 1
    if levels > MAX_RAMP_LEVELS:
        raise BatchpilotError(
            field,
            f"steps from {start:,} to {target:,} by {increment:,}: {levels:,} batch sizes, each a stage of its own "
            f"(every stage resizes the pool, launches and checkpoints)",
            "use a larger increment (a ramp of a few to a few dozen stages is usual)",
        )
    return (target - start) // increment


def megatron_rampup(*, start: int, increment: int, ramp_samples: int, target: int) -> BatchSchedule:
    """NeMo/Megatron `rampup_batch_size=[start, increment, ramp_samples]`.

    `batch(consumed) = start + floor(consumed / (ramp_samples / num_increments)) * increment`, capped at
    target. Thresholds are computed exactly (integers), so no floating-point drift.
    """
    field = "batch.rampup"
    num_increments = _check_increments(start=start, increment=increment, target=target, field=field)
    if ramp_samples <= 0:
        raise BatchpilotError(
            f"{field}.samples", "must be positive", "give the ramp length in samples, e.g. 10M"
        )
    levels: dict[int, int] = {0: start}
    for k in range(1, num_increments + 1):
        # smallest consumed with floor(consumed * n / R) >= k
        levels[-(-k * ramp_samples // num_increments)] = start + k * increment
    ordered = sorted(levels.items())
    return BatchSchedule(tuple(t for t, _ in ordered), tuple(b for _, b in ordered))


def seesaw_growth_cuts(*, start: int, factor: int, cuts: Sequence[int], target: int) -> int:
    """How many of Seesaw's cuts grow the batch: k with `start x factor^k == target` (the later cuts divide the
    LR by `factor`, a step decay's cuts once the batch is at its largest).

    Raises:
        BatchpilotError: cuts not increasing from above 0, or no k <= len(cuts) that ends at the target.
    """
    field = "batch.rampup.seesaw"
    if not cuts or cuts[0] <= 0 or any(a >= b for a, b in itertools.pairwise(cuts)):
        raise BatchpilotError(
            f"{field}.cuts",
            f"must be consumed-sample points in increasing order above 0, not {list(cuts)}",
            "list where a step-decay schedule would cut the LR, e.g. [10M, 20M, 30M]",
        )
    batch = start
    for k in range(len(cuts) + 1):
        if batch == target:
            return k
        batch *= factor
    reachable = [start * factor**k for k in range(len(cuts) + 1)]
    raise BatchpilotError(
        field,
        f"grows the batch from {start} by {factor} at each cut ({', '.join(map(str, reachable))} with "
        f"{len(cuts)} cut(s)), which never reaches the target global_batch_size {target}",
        f"set batch.global_batch_size to one of {', '.join(map(str, reachable[1:]))}, or a start that reaches "
        f"{target}",
    )


def seesaw_rampup(*, start: int, factor: int, cuts: Sequence[int], target: int) -> BatchSchedule:
    """Seesaw (Meterez et al., arXiv 2510.14717): where a step-decay schedule would divide the LR by `factor`,
    the batch is multiplied by `factor` instead and the LR divided by its square root (`LRSchedule` scaling
    `seesaw`), until the batch is the target: `start x factor^k` from the k-th cut on; the cuts after that
    divide the LR by `factor` (`LRSchedule.lr_cuts`).

    Raises:
        BatchpilotError: see `seesaw_growth_cuts`.
    """
    grows = seesaw_growth_cuts(start=start, factor=factor, cuts=cuts, target=target)
    if grows == 0:
        raise BatchpilotError(
            "batch.rampup.seesaw.start", f"is the target global_batch_size ({target}): nothing to grow",
            "start below the target, or remove the ramp-up",
        )  # fmt: skip
    return BatchSchedule((0, *cuts[:grows]), tuple(start * factor**k for k in range(grows + 1)))


def _per_device_to_global(value: Fraction, num_devices: int, *, field: str) -> int:
    total = value * num_devices
    if total.denominator != 1:
        raise BatchpilotError(
            field, f"{value} per device x {num_devices} devices is not a whole number of samples"
        )
    return int(total)


def maxtext_rampup(
    *,
    per_device_start: Fraction,
    per_device_increment: Fraction,
    ramp_samples: int,
    target: int,
    num_devices: int,
) -> BatchSchedule:
    """MaxText per-device ramp-up (`per_device_batch_size_start/_increment`, `global_rampup_samples`).

    Each level trains `samples_per_increment = ramp_samples / num_increments` samples, rounded up to whole
    steps of that level, before the batch grows (MaxText's RampupBatchManager). The target per-device size
    is `target / num_devices` where `num_devices` is the device count of the target stage.
    """
    field = "batch.rampup"
    start = _per_device_to_global(per_device_start, num_devices, field=f"{field}.per_device_start")
    increment = _per_device_to_global(
        per_device_increment, num_devices, field=f"{field}.per_device_increment"
    )
    num_increments = _check_increments(start=start, increment=increment, target=target, field=field)
    if ramp_samples <= 0:
        raise BatchpilotError(f"{field}.samples", "must be positive")
    samples_per_increment = Fraction(ramp_samples, num_increments)
    thresholds, batches, consumed = [0], [start], 0
    for k in range(num_increments):
        level_batch = start + k * increment
        consumed += math.ceil(samples_per_increment / level_batch) * level_batch
        thresholds.append(consumed)
        batches.append(level_batch + increment)
    return BatchSchedule(tuple(thresholds), tuple(batches))


def parse_schedule(text: str, *, seq_len: int) -> list[tuple[str, int, int]]:
    """The entries of an explicit schedule as (threshold as written, threshold in samples, batch).

    Raises:
        BatchpilotError: one line per entry that does not parse (`Problems` when several do not).
    """
    field = "batch.schedule"
    entries: list[tuple[str, int, int]] = []
    problems: list[BatchpilotError] = []
    for entry in text.split():
        try:
            if entry.count(":") != 1:
                raise BatchpilotError(field, f"entry {entry!r} is not THRESHOLD:BATCH", 'write e.g. "5M:512"')
            raw_threshold, raw_batch = entry.split(":")
            value, is_tokens = parse_threshold(raw_threshold, field=f"{field} ({entry})")
            batch = parse_count(raw_batch, field=f"{field} ({entry})")
            if batch <= 0:
                raise BatchpilotError(f"{field} ({entry})", "batch sizes must be positive")
            entries.append((raw_threshold, -(-value // seq_len) if is_tokens else value, batch))
        except BatchpilotError as error:
            problems.append(error)
    raise_problems(problems)
    return entries


def format_schedule(entries: Sequence[tuple[str, int]]) -> str:
    """`THRESHOLD:BATCH ...` from (threshold as written, batch) pairs."""
    return " ".join(f"{threshold}:{batch}" for threshold, batch in entries)


def explicit_schedule(text: str, *, target: int, seq_len: int) -> BatchSchedule:
    """An explicit schedule such as `"0:256 5M:512 10M:1024"`.

    Thresholds are samples (`K/M/B/T` suffixes allowed) or tokens with a `t` suffix (`20Mt`); a token
    threshold becomes the first sample index at which that many tokens have been consumed.

    Raises:
        BatchpilotError: one line per problem (`Problems` when there are several); an order problem
            suggests the schedule with its thresholds and batch sizes each in increasing order.
    """
    field = "batch.schedule"
    if not text.split():
        raise BatchpilotError(field, "is empty", 'write e.g. "0:256 5M:512 10M:1024"')
    entries = parse_schedule(text, seq_len=seq_len)
    problems: list[BatchpilotError] = []
    written = [f"{raw}:{batch}" for raw, _, batch in entries]
    if entries[0][1] != 0:
        problems.append(
            BatchpilotError(field, f"must start at 0, starts at {written[0]!r}", 'begin with "0:<batch>"')
        )
    ordered = _ordered(entries)
    for i in range(1, len(entries)):
        if entries[i][1] <= entries[i - 1][1] or entries[i][2] <= entries[i - 1][2]:
            problems.append(
                BatchpilotError(
                    field,
                    f"{written[i]!r} must come after {written[i - 1]!r} with a larger threshold and batch",
                    f'list thresholds and batch sizes in increasing order, e.g. schedule: "{ordered}"',
                )
            )
    if entries[-1][2] != target:
        problems.append(
            BatchpilotError(
                field,
                f"ends at batch {entries[-1][2]} but batch.global_batch_size is {target}",
                "make the last entry's batch the global_batch_size",
            )
        )
    raise_problems(problems)
    return BatchSchedule(tuple(t for _, t, _ in entries), tuple(b for _, _, b in entries))


def _ordered(entries: Sequence[tuple[str, int, int]]) -> str:
    """The entries with thresholds and batch sizes each sorted, repeats dropped: the likely intent."""
    thresholds = sorted({(value, raw) for raw, value, _ in entries})
    batches = sorted({batch for _, _, batch in entries})
    return format_schedule([(raw, batch) for (_, raw), batch in zip(thresholds, batches, strict=False)])


MAX_INCREMENT_SCAN = 100_000
"""`nearest_ramp` tries every multiple of its step as the increment up to this many; beyond (a target of
10^12 samples), only those nearest the given increment and each level count."""


def nearest_ramp(
    *,
    start: Fraction,
    increment: Fraction,
    target: int,
    max_levels: int,
    step: int,
    accept: Callable[[int, int], bool],
    max_tries: int = 2000,
) -> tuple[int, int] | None:
    """The linear ramp `(start, increment)` to `target` closest to the given one that `accept` takes.

    Candidates have an increment that is a multiple of `step`, `target - start` a multiple of it (so
    the ramp ends exactly at the target) and at most `max_levels` levels; they are tried from the closest
    (the sum of |log ratio| of start and increment) until `accept` takes one, at most `max_tries` times.
    """
    candidates: set[tuple[int, int]] = set()
    if target // step <= MAX_INCREMENT_SCAN:
        increments: Iterable[int] = range(step, target, step)
    else:  # too many multiples of `step` to try each: those nearest the given increment and each level count
        near = {increment, *((target - start) / k for k in range(1, max_levels))}
        increments = {
            m for value in near for m in (math.floor(value / step) * step, math.ceil(value / step) * step)
        }
        increments = sorted(m for m in increments if step <= m < target)
    for inc in increments:
        ideal = (target - start) / inc
        for k in (math.floor(ideal), math.ceil(ideal)):
            k = min(max(k, 1), max_levels - 1)
            if target - k * inc > 0:
                candidates.add((target - k * inc, inc))
    ranked = sorted(
        candidates,
        key=lambda c: (abs(math.log(c[0] / start)) + abs(math.log(c[1] / increment)), c),
    )
    return next((c for c in ranked[:max_tries] if accept(*c)), None)
