"""The micro-batch search: grow until it no longer fits, bisect the memory frontier, then probe where
the measured throughput curve says a faster size may still hide, and re-measure the leaders.

Pure Python (no torch, no processes): the caller measures; `next_probe` only looks at the results so far,
so the search is a function of what was measured and can be tested with a synthetic device.

Where may a faster size hide? Between two probed sizes `a < b` (throughput `f(a)`, `f(b)`):
- the time of a pass never shrinks when the micro batch grows, so `f(x) <= f(a) * x / a` for `x > a`;
- if throughput is concave in the micro batch (it rises, saturates, then may fall), `f` inside the gap
  lies below the lines that extend the neighbouring segments on both sides.
The smallest of these lines bounds each unprobed size; the search probes the middle of the gap with
the highest bound until no gap promises more than `REFINE_TOLERANCE` over the best measured size. The
same bound tells the confidence score how much faster an unprobed size could plausibly be.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot.explore.records import ProbeResult, Setting

FRONTIER_TOLERANCE = 0.25
"""Bisect the memory frontier until the largest fitting size is within 25% of the smallest that does not."""
REFINE_TOLERANCE = 0.02
"""Gaps whose bound promises less than 2% over the best measured size are not worth a probe."""
EQUIVALENCE = 0.03
"""The confidence is about being within 3% of the fastest fitting micro batch."""


@dataclass(frozen=True)
class Point:
    """All fitting probes of one (setting, micro batch), pooled.

    Attributes:
        tokens_per_s: the base probe's throughput times the median ratio to it measured pass by pass in
            the same process, when the probes had that reference; else from the median of every timed
            pass of every probe of this point.
        rel_noise: relative standard error of that throughput (within-probe spread, plus the measured
            between-process spread when repeats exist).
    """

    setting: Setting
    micro_batch_size: int
    tokens_per_s: float
    samples_per_s: float
    step_time_s: float
    rel_noise: float
    num_probes: int
    peak_memory_bytes: int


@dataclass(frozen=True)
class Candidate:
    """The next probe: a setting, a micro batch and the phase that chose it."""

    setting: Setting
    micro_batch_size: int
    phase: str


def _rel_within_noise(times_s: Sequence[float]) -> float:
    """Relative standard error of the median pass time (1.4826 MAD / median / sqrt(n))."""
    if len(times_s) < 2:
        return 0.5
    median = statistics.median(times_s)
    mad = statistics.median(abs(t - median) for t in times_s)
    return 1.4826 * mad / median / math.sqrt(len(times_s))


class SearchState:
    """The probes so far and what they say about each setting."""

    def __init__(
        self,
        *,
        settings: Sequence[Setting],
        max_micro_batch_size: int,
        seq_len: int,
        memory_budget_bytes: int | None = None,
    ) -> None:
        if not settings:
            raise ValueError("at least one setting")
        self.settings = list(settings)
        self.max_micro_batch_size = max_micro_batch_size
        self.seq_len = seq_len
        self.memory_budget_bytes = memory_budget_bytes
        """What a probe's peak may reach and still fit (CPU: explore.memory_budget_bytes), for predicting the
        memory frontier from the peaks measured; None: unknown (the frontier is bisected)."""
        self.results: list[ProbeResult] = []
        self._by_key: dict[tuple[Setting, int], list[ProbeResult]] = {}
        self._points: dict[tuple[Setting, bool], list[Point]] = {}

    def add(self, result: ProbeResult) -> None:
        self.results.append(result)
        self._by_key.setdefault((result.setting, result.micro_batch_size), []).append(result)
        self._points.clear()

    def probed(self, setting: Setting, micro: int) -> list[ProbeResult]:
        return self._by_key.get((setting, micro), [])

    def smallest_not_fitting(self, setting: Setting) -> int | None:
        sizes = [r.micro_batch_size for r in self.results if r.setting == setting and not r.fits]
        return min(sizes, default=None)

    def memory_limit(self, setting: Setting) -> int | None:
        """The smallest size taken not to fit: the smallest probed that did not, or the size after the last one
        the measured peaks predict to fit (`predicted_largest_fitting`, never below the largest that fitted),
        whichever is smaller; None while neither is known."""
        limit = self.smallest_not_fitting(setting)
        predicted = predicted_largest_fitting(self, setting)
        points = self.points(setting)
        if predicted is None or not points:
            return limit
        by_peaks = max(predicted, points[-1].micro_batch_size) + 1
        return by_peaks if limit is None else min(limit, by_peaks)

    def between_process_noise(self) -> float | None:
        """RMS relative spread of one probe's throughput between repeated probes (None: no repeats)."""
        spreads = []
        for setting in self.settings:
            for point in self.points(setting, with_between=False):
                runs = [r for r in self.probed(setting, point.micro_batch_size) if r.fits]
                if len(runs) >= 2:
                    values = self.relatives(runs) or [1 / (r.step_time_s or math.inf) for r in runs]
                    spreads.append(statistics.stdev(values) / statistics.mean(values))
        return math.sqrt(statistics.mean(s * s for s in spreads)) if spreads else None

    def base_tokens_per_s(self) -> float | None:
        """The base configuration's typical throughput: the scale of every paired estimate.

        Each paired probe also tells how fast the base ran at its moment (its own tokens/s over its
        ratio); the median over the base probe and all of those is steadier than the base probe alone.
        """
        base = self.base()
        if base is None or not base.tokens_per_s:
            return None
        implied = [
            r.tokens_per_s / r.relative_throughput
            for r in self.results
            if r.fits and r.tokens_per_s and r.relative_throughput
        ]
        return statistics.median([base.tokens_per_s, *implied])

    def relatives(self, runs: Sequence[ProbeResult]) -> list[float] | None:
        """Each run's throughput over the base probe's, measured against it in the same process (see
        ProbeResult); None unless every run has one, so paired and unpaired values are never mixed."""
        base = self.base()
        values = [1.0 if r is base else r.relative_throughput for r in runs]
        return [v for v in values if v is not None] if None not in values else None

    def points(self, setting: Setting, *, with_between: bool = True) -> list[Point]:
        """Fitting sizes of `setting` below its smallest non-fitting one, ascending."""
        key = (setting, with_between)
        if key not in self._points:
            self._points[key] = self._compute_points(setting, with_between=with_between)
        return self._points[key]

    def _compute_points(self, setting: Setting, *, with_between: bool) -> list[Point]:
        limit = self.smallest_not_fitting(setting) or math.inf
        between = self.between_process_noise() if with_between else None
        sizes = sorted({r.micro_batch_size for r in self.results if r.setting == setting and r.fits})
        points = []
        base_tokens_per_s = self.base_tokens_per_s()
        for micro in (m for m in sizes if m < limit):
            runs = [r for r in self.probed(setting, micro) if r.fits]
            times_s = [t for r in runs for t in r.step_times_s] or [r.step_time_s or 0.0 for r in runs]
            step_s = statistics.median(times_s)
            noise = _rel_within_noise(times_s)
            relatives = self.relatives(runs)
            if base_tokens_per_s and relatives:
                # Paired with the base in the same process: the machine's speed of the moment cancels.
                ratios = [x for r in runs for x in r.pair_ratios] or relatives
                step_s = micro * self.seq_len / (statistics.median(ratios) * base_tokens_per_s)
                if any(r.pair_ratios for r in runs):
                    noise = _rel_within_noise([1 / x for x in ratios])
            if between is not None:
                noise = math.sqrt(noise**2 + between**2 / len(runs))
            points.append(
                Point(
                    setting=setting,
                    micro_batch_size=micro,
                    tokens_per_s=micro * self.seq_len / step_s,
                    samples_per_s=micro / step_s,
                    step_time_s=step_s,
                    rel_noise=noise,
                    num_probes=len(runs),
                    peak_memory_bytes=max(r.peak_memory_bytes or 0 for r in runs),
                )
            )
        return points

    def all_points(self) -> list[Point]:
        return [p for s in self.settings for p in self.points(s)]

    def best(self) -> Point | None:
        return max(self.all_points(), key=lambda p: p.tokens_per_s, default=None)

    def base(self) -> ProbeResult | None:
        """The first probe that fits: the reference of every speed-up."""
        return next((r for r in self.results if r.fits), None)


def _anchor(state: SearchState, setting: Setting) -> int:
    """Where a setting's growth starts: 1 for the first setting that fits, else near that setting's frontier.

    A second setting (activation checkpointing, compile) only matters where it differs: at the first
    setting's largest fitting size and beyond, so it starts there instead of at 1. Activation checkpointing over
    the same setting without it starts at that setting's memory limit: it recomputes the forward, so it is no
    faster at any size both fit.
    """
    for primary in state.settings:
        if primary == setting:
            return 1
        points = state.points(primary)
        if points:
            limit = state.memory_limit(primary)
            if limit is not None and primary == _without_checkpointing(setting):
                return min(limit, state.max_micro_batch_size)
            return max(p.micro_batch_size for p in points)
    return 1


def _without_checkpointing(setting: Setting) -> Setting | None:
    """The same setting without activation checkpointing (None: `setting` has none)."""
    if not setting.activation_checkpointing:
        return None
    return Setting(activation_checkpointing=False, compile=setting.compile)


def _room_above(state: SearchState, setting: Setting) -> float | None:
    """The highest throughput a size above the setting's largest fitting one (and below its memory limit and the
    size cap) may reach, by the gap bound of the module docstring; None when no such size is left."""
    points = state.points(setting)
    limit = state.memory_limit(setting)
    high = min(limit if limit is not None else math.inf, state.max_micro_batch_size + 1)
    if not points or high - points[-1].micro_batch_size < 2:
        return None
    return _gap_bound(points, len(points) - 1, int(high))


def _promising(state: SearchState, bound: float | None) -> bool:
    """A bound worth a probe: above the best measured throughput by more than `margin(state)`."""
    best = state.best()
    return bound is not None and (best is None or bound > best.tokens_per_s * (1 + margin(state)))


def margin(state: SearchState) -> float:
    """How far above the best a bound must reach to be worth a probe: `REFINE_TOLERANCE`, plus twice the typical
    relative noise of one measured size (the bounds extend lines through measured points, so a probe cannot
    resolve less than that)."""
    noises = [p.rel_noise for p in state.all_points()]
    return REFINE_TOLERANCE + (2 * statistics.median(noises) if noises else 0.0)


def _grow(state: SearchState, setting: Setting) -> Candidate | None:
    points = state.points(setting)
    limit = state.smallest_not_fitting(setting)
    if not points:
        if limit is None:
            return Candidate(setting, min(_anchor(state, setting), state.max_micro_batch_size), "grow")
        return Candidate(setting, limit // 2, "grow") if limit > 1 else None
    largest = points[-1].micro_batch_size
    if limit is None and largest < state.max_micro_batch_size:
        if not _promising(state, _room_above(state, setting)):
            return None  # no size above can beat the best by what counts
        target = 2 * largest
        predicted = state.memory_limit(setting)
        if predicted is not None and largest + 1 < predicted <= target:
            target = predicted - 1  # the last size the peaks predict to fit
        best = state.best()
        if _anchor(state, setting) > 1 and best is not None and best.setting != setting:
            # A second setting is worth growing only to where one pass's time, which never shrinks with the
            # micro batch, would let it beat the best by `REFINE_TOLERANCE`: straight there (or to 2x).
            worth = (
                math.floor(best.tokens_per_s * (1 + REFINE_TOLERANCE) * largest / points[-1].tokens_per_s) + 1
            )
            if worth > state.max_micro_batch_size:
                return None
            target = max(min(worth, target), largest + 1) if worth > largest else target
        return Candidate(setting, min(target, state.max_micro_batch_size), "grow")
    return None


def predicted_largest_fitting(state: SearchState, setting: Setting) -> int | None:
    """The largest micro batch whose peak the line through the two largest fitting sizes' peaks keeps within
    the memory budget (activations grow linearly with the micro batch); None without a budget, with fewer than
    two fitting sizes, or when the peaks do not grow."""
    points = state.points(setting)
    budget = state.memory_budget_bytes
    if budget is None or len(points) < 2:
        return None
    a, b = points[-2], points[-1]
    slope = (b.peak_memory_bytes - a.peak_memory_bytes) / (b.micro_batch_size - a.micro_batch_size)
    if slope <= 0:
        return None
    return b.micro_batch_size + math.floor((budget - b.peak_memory_bytes) / slope)


def _frontier(state: SearchState, setting: Setting) -> Candidate | None:
    """Between the largest fitting size and the smallest that does not: the size the measured peaks predict
    to be the last that fits, then (a prediction that did not fit, or none) bisection to within
    `FRONTIER_TOLERANCE`. A prediction at or below the largest fitting size ends it: the next size up is
    predicted not to fit, and the failed size above confirms the line."""
    points = state.points(setting)
    limit = state.smallest_not_fitting(setting)
    if not points or limit is None:
        return None
    largest = points[-1].micro_batch_size
    if not _promising(state, _room_above(state, setting)):
        return None  # nothing between it and the limit can beat the best by what counts
    predicted = predicted_largest_fitting(state, setting)
    if predicted is not None:
        if predicted <= largest:
            return None
        if predicted < limit and not state.probed(setting, predicted):
            return Candidate(setting, predicted, "frontier")
    if limit - largest > max(1, math.ceil(largest * FRONTIER_TOLERANCE)):
        return Candidate(setting, (largest + limit) // 2, "frontier")
    return None


def _cannot_win(state: SearchState, setting: Setting) -> bool:
    """A setting that is not the leader cannot win when no size above its largest measured one may beat the best
    by `REFINE_TOLERANCE`: it is then not grown or bisected (its measured points still count, and the gaps
    between them are refined). Above its largest fitting size a pass takes no less time (that size's
    throughput scaled up bounds it) and throughput is concave in the micro batch (the line through its two
    largest sizes, extended, bounds it). Activation checkpointing recomputes the forward, so at any size it is no
    faster than the same setting without it: it matters only from that setting's memory limit up, where the
    line through that setting's two largest sizes, extended, bounds it too; a checkpointed setting whose own
    memory limit is no higher cannot win at all."""
    best = state.best()
    if best is None or best.setting == setting:
        return False
    own, limit = state.points(setting), state.memory_limit(setting)
    low = own[-1].micro_batch_size + 1 if own else 1
    high = min(limit - 1 if limit is not None else state.max_micro_batch_size, state.max_micro_batch_size)
    lines = []
    if own:
        lines.append((own[-1].tokens_per_s / own[-1].micro_batch_size, 0.0))
    if len(own) >= 2:
        a, b = own[-2], own[-1]
        lines.append(_segment(a, b))
    without = _without_checkpointing(setting)
    if without is not None and without in state.settings:
        points, without_limit = state.points(without), state.memory_limit(without)
        if len(points) >= 2 and without_limit is not None:
            if limit is not None and limit <= without_limit:
                return True
            low = max(low, without_limit)
            a, b = points[-2], points[-1]
            lines.append(_segment(a, b))
    if not lines:
        return False
    if high < low:
        return bool(own)  # no size left above its largest (a setting with no point yet still needs one)
    return _max_of_min(lines, low, high) <= best.tokens_per_s * (1 + margin(state))


def _max_of_min(lines: Sequence[tuple[float, float]], low: int, high: int) -> float:
    """The highest value the lowest of `lines` (slope, intercept) takes at a size in [low, high]: at an end or
    where two lines cross."""
    sizes = {low, high}
    for first in range(len(lines)):
        for second in range(first + 1, len(lines)):
            (s1, c1), (s2, c2) = lines[first], lines[second]
            if s1 != s2:
                crossing = (c2 - c1) / (s1 - s2)
                sizes.update({math.floor(crossing), math.ceil(crossing)})
    return max(min(s * x + c for s, c in lines) for x in sizes if low <= x <= high)


@dataclass(frozen=True)
class Gap:
    """Unprobed sizes `(low, high)` exclusive of one setting, and the highest throughput they may reach."""

    setting: Setting
    low: int
    high: int
    bound_tokens_per_s: float


def _segment(a: Point, b: Point) -> tuple[float, float]:
    """(slope, intercept) of the throughput line through two measured sizes."""
    return _line(a.micro_batch_size, a.tokens_per_s, b.micro_batch_size, b.tokens_per_s)


def _line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(slope, intercept) of the line through two points."""
    slope = (y1 - y0) / (x1 - x0)
    return slope, y0 - slope * x0


def _gap_bound(points: list[Point], index: int, high: int) -> float:
    """Highest throughput an unprobed size in (points[index], high) may have (see the module docstring)."""
    a = points[index]
    lines = [(a.tokens_per_s / a.micro_batch_size, 0.0)]  # f(x) <= f(a) x / a
    if index >= 1:
        p = points[index - 1]
        lines.append(_segment(p, a))
    if index + 2 < len(points):
        b, c = points[index + 1], points[index + 2]
        lines.append(_segment(b, c))
    return _max_of_min(lines, a.micro_batch_size + 1, high - 1)


def gaps(state: SearchState) -> list[Gap]:
    """Every range of unprobed sizes below each setting's memory limit (and the size cap), with bounds."""
    found = []
    for setting in state.settings:
        points = state.points(setting)
        limit = state.memory_limit(setting)
        cap = state.max_micro_batch_size + 1
        edges = [p.micro_batch_size for p in points] + [min(limit, cap) if limit is not None else cap]
        for index in range(len(points)):
            low, high = edges[index], edges[index + 1]
            if high - low >= 2:
                found.append(Gap(setting, low, high, _gap_bound(points, index, high)))
    return found


def _refine(state: SearchState, setting: Setting | None = None) -> Candidate | None:
    """The middle of the most promising gap (of `setting` only, when given)."""
    promising = [
        g
        for g in gaps(state)
        if (setting is None or g.setting == setting) and _promising(state, g.bound_tokens_per_s)
    ]
    if not promising:
        return None
    gap = max(promising, key=lambda g: g.bound_tokens_per_s)
    return Candidate(gap.setting, (gap.low + gap.high) // 2, "refine")


MAX_REPEATS = 2
"""Re-measurements in one search: the leader's, and one more for a runner-up or a new leader."""


def _repeat(state: SearchState) -> Candidate | None:
    """Re-measures the best point, then the runner-up when the noise leaves room for it to be faster than the
    best by more than `REFINE_TOLERANCE` (a runner-up that could only tie is as good a choice); at most
    `MAX_REPEATS` in all (on a plateau each repeat can make another size the leader)."""
    points = sorted(state.all_points(), key=lambda p: p.tokens_per_s, reverse=True)
    if not points or sum(p.num_probes - 1 for p in points) >= MAX_REPEATS:
        return None
    best = points[0]
    if best.num_probes < 2:
        return Candidate(best.setting, best.micro_batch_size, "repeat")
    for other in points[1:2]:
        spread = math.hypot(best.rel_noise, other.rel_noise)
        could_lead = other.tokens_per_s * (1 + 2 * spread) > best.tokens_per_s * (1 + REFINE_TOLERANCE)
        if could_lead and other.num_probes < 2:
            return Candidate(other.setting, other.micro_batch_size, "repeat")
    return None


def next_probe(state: SearchState) -> Candidate | None:
    """The next measurement worth making, or None when the search has converged."""
    # One setting's memory frontier and curve before the next setting's: a second setting is judged against the
    # first's whole curve (`_cannot_win`), whose two largest sizes are then close together.
    for setting in state.settings:
        if _cannot_win(state, setting):
            continue
        for phase in (_grow, _frontier, _refine):
            candidate = phase(state, setting)
            if candidate is not None:
                return candidate
    return _refine(state) or _repeat(state)
