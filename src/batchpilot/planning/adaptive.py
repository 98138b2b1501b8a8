"""Adaptive ramp-up: the decision that ends a stage when the measured critical batch says so.

The trainer measures, every step, single-step unbiased estimates of |G|^2 and S (McCandlish et al. 2018;
`batchpilot.train.noise`); their ratio S/|G|^2 is the simple noise scale B_simple, an estimate of the
critical batch size, which grows as training progresses. The rule here is a pure function of that trace
and the config, so it can be tested on synthetic traces and replayed from `metrics.jsonl`:

- smooth |G|^2 and S separately with bias-corrected exponential moving averages (`smoothing` is the
  decay per step) and take the ratio, as the trainer's `NoiseScaleEMA` does;
- the *estimate* at a step is that ratio times `scale` (1 by default; a calibration of B_simple against
  the critical batch measured by branched trials, docs/planning.md);
- its uncertainty is the jackknife standard error of the ratio of the means of S and |G|^2 over the
  stage's last `window` steps up to that step (the EMA's effective length; only points of the current
  stage, none when it has fewer than 3), times `scale`;
- the *lower bound* at a step is `estimate - confidence * stderr` (both scaled, so `scale * (ratio - k *
  the ratio's jackknife standard error)`): with `confidence` k = 2 a noise scale that is in truth well
  below the threshold rarely lifts it there; a step without a standard error has no lower bound when
  k > 0 (with k = 0 the bound is the estimate itself);
- the *threshold* is the next batch size the node schedule accepts above the current batch;
- the stage ends when the lower bound has stayed at or above the threshold at every step for
  `patience_samples` samples in a row (and the stage has trained at least `min_stage_samples`): the rule
  decides on evidence, not on an estimate that noise lifted above the threshold;
- the next batch is the smallest accepted size at least the (scaled) estimate, at most
  `max_growth` x the current batch and the target, never below the threshold;
- when the stage reaches `ramp_samples` without firing, the next stage trains at the target: the ramp-up
  has a bounded length whatever the noise does (reason `ramp_end`); so does a firing on the last ramp
  stage the pipeline has a slot for (`max_stages`).

A decision reports the estimate, its standard error, the lower bound and k after the last point.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from batchpilot.planning.rampup import BatchSchedule


@dataclass(frozen=True)
class AdaptiveRule:
    """`batch.rampup: {adaptive: {...}}` with the target resolved.

    Attributes:
        start: the first stage's global batch.
        target: the final stage's global batch (the largest the ramp reaches).
        smoothing: EMA decay per step of |G|^2 and S (0.9: about the last 10 steps weigh most).
        patience_samples: samples the smoothed estimate must stay at or above the threshold.
        max_growth: the next batch is at most this times the current one.
        min_stage_samples: no stage ends before training this many samples.
        ramp_samples: the stage that reaches this sample without firing hands over to the target.
        confidence: k, the standard errors the lower bound keeps below the estimate (0: the estimate alone).
        scale: the multiplier on the measured B_simple (calibrated against branched trials).
    """

    start: int
    target: int
    smoothing: float
    patience_samples: int
    max_growth: float
    min_stage_samples: int
    ramp_samples: int
    confidence: float = 2.0
    scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NoisePoint:
    """One step's measurement: consumed samples after the step and the single-step estimates."""

    consumed_samples: int
    g2: float
    s: float


Reason = Literal["noise_scale", "ramp_end", "at_target", "continue"]


@dataclass(frozen=True)
class Decision:
    """What the rule says after the last point of a trace.

    Attributes:
        fired: whether the stage ends here.
        next_batch: the next stage's global batch when fired, else None.
        reason: `noise_scale` (the lower bound stayed above the threshold), `ramp_end` (ramp_samples
            reached), `at_target` (the current batch is the target: the rule never fires) or `continue`.
        estimate: the smoothed B_simple times the rule's scale after the last point (None until measurable).
        stderr: its jackknife standard error over the stage's last `window` steps, times the scale (None
            with fewer than 3 points in the stage).
        threshold: the next accepted batch above the current one (None at the target).
        above_since: the sample from which the lower bound has stayed at or above the threshold (None:
            below).
        stage_samples: samples the stage has trained.
        consumed_samples: samples consumed in all (the trace's last point).
        lower_bound: the estimate less `confidence` standard errors after the last point (None: unmeasured,
            and in decisions recorded before the rule had one).
        confidence: the rule's k (None in decisions recorded before the rule had one).
    """

    fired: bool
    next_batch: int | None
    reason: Reason
    estimate: float | None
    stderr: float | None
    threshold: int | None
    above_since: int | None
    stage_samples: int
    consumed_samples: int
    lower_bound: float | None = None
    confidence: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def measured(self) -> str:
        """The estimate as a phrase: "estimate 812.3 +- 40.1 (lower bound 732.1 at k=2)"."""
        estimate = "unmeasured" if self.estimate is None else f"{self.estimate:,.1f}"
        error = "" if self.stderr is None else f" +- {self.stderr:,.1f}"
        bound = (
            ""
            if self.lower_bound is None or self.confidence is None
            else f" (lower bound {self.lower_bound:,.1f} at k={self.confidence:g})"
        )
        return f"estimate {estimate}{error}{bound}"

    def describe(self) -> str:
        """One line for logs and the report."""
        if not self.fired:
            return f"keep going: {self.measured()}, threshold {self.threshold}"
        # Decisions recorded before the rule had a lower bound (confidence None) fired on the estimate.
        evidence = "the estimate" if self.confidence is None else "the lower bound"
        if self.reason == "noise_scale" and self.above_since is not None:
            why = (
                f"{evidence} stayed >= {self.threshold} since sample {self.above_since:,}: {self.measured()}"
            )
        elif self.reason == "ramp_end":
            why = f"the ramp ends at {self.consumed_samples:,} samples ({self.measured()})"
        else:
            why = self.reason
        return f"next batch {self.next_batch}: {why}; {self.stage_samples:,} samples in this stage"


def smoothed_estimates(trace: Sequence[NoisePoint], *, smoothing: float) -> list[float | None]:
    """B_simple after each point: the ratio of bias-corrected EMAs of S and |G|^2 (None while either is
    not positive)."""
    g2 = s = weight = 0.0
    values: list[float | None] = []
    for point in trace:
        g2 = smoothing * g2 + (1 - smoothing) * point.g2
        s = smoothing * s + (1 - smoothing) * point.s
        weight = smoothing * weight + (1 - smoothing)
        values.append((s / weight) / (g2 / weight) if g2 > 0 and s > 0 else None)
    return values


def jackknife_stderr(trace: Sequence[NoisePoint]) -> float | None:
    """Standard error of mean(S) / mean(|G|^2) by the leave-one-out jackknife (None: fewer than 3 points or
    a non-positive mean)."""
    n = len(trace)
    if n < 3:
        return None
    total_g2 = sum(point.g2 for point in trace)
    total_s = sum(point.s for point in trace)
    if total_g2 <= 0 or total_s <= 0:
        return None
    leave_one_out = []
    for point in trace:
        g2 = total_g2 - point.g2
        if g2 <= 0:
            return None
        leave_one_out.append((total_s - point.s) / g2)
    mean = sum(leave_one_out) / n
    return math.sqrt((n - 1) / n * sum((value - mean) ** 2 for value in leave_one_out))


def window(smoothing: float) -> int:
    """The EMA's effective number of steps, for the uncertainty: 2 / (1 - decay) - 1."""
    return max(3, round(2 / (1 - smoothing) - 1))


def next_accepted(accepted: Sequence[int], above: int) -> int | None:
    """The smallest accepted size strictly above `above` (None: none)."""
    index = bisect.bisect_right(accepted, above)
    return accepted[index] if index < len(accepted) else None


def decide(
    trace: Sequence[NoisePoint],
    *,
    rule: AdaptiveRule,
    current: int,
    stage_start: int,
    accepted: Sequence[int],
    last_ramp_stage: bool = False,
) -> Decision:
    """The rule after the last point of `trace` (every measurement of the run so far, oldest first; the
    EMAs run over all of it, the standard errors, the patience and the stage's samples count from
    `stage_start`).

    `accepted` are the global batch sizes the node schedule accepts (ascending; the target among them).
    On the `last_ramp_stage` (the pipeline has no slot for another ramp stage) a firing rule goes straight
    to the target, above `max_growth` if need be.
    """
    if list(accepted) != sorted(set(accepted)) or rule.target not in accepted:
        raise ValueError(
            f"accepted sizes {list(accepted)} must be ascending, distinct and include the target"
        )
    consumed = trace[-1].consumed_samples if trace else stage_start
    stage_samples = consumed - stage_start
    evidence = _Evidence(trace, rule=rule, stage_start=stage_start)
    last = len(trace) - 1
    estimate = evidence.estimate(last) if trace else None
    stderr = evidence.stderr(last) if trace else None
    threshold = next_accepted([size for size in accepted if size <= rule.target], current)

    def decision(fired: bool, next_batch: int | None, reason: Reason, above_since: int | None) -> Decision:
        return Decision(
            fired=fired,
            next_batch=next_batch,
            reason=reason,
            estimate=estimate,
            stderr=stderr,
            threshold=threshold,
            above_since=above_since,
            stage_samples=stage_samples,
            consumed_samples=consumed,
            lower_bound=evidence.lower_bound(last) if trace else None,
            confidence=rule.confidence,
        )

    if threshold is None or current >= rule.target:
        return decision(False, None, "at_target", None)
    above_since = evidence.above_since(threshold)
    if consumed >= rule.ramp_samples:
        return decision(True, rule.target, "ramp_end", above_since)
    if (
        above_since is not None
        and estimate is not None
        and stage_samples >= rule.min_stage_samples
        and consumed - above_since >= rule.patience_samples
    ):
        cap = min(rule.target, math.floor(current * rule.max_growth))
        wanted = next((size for size in accepted if size >= estimate), rule.target)
        within = [size for size in accepted if threshold <= size <= max(cap, threshold)]
        next_batch = max(size for size in within if size <= max(wanted, threshold))
        return decision(True, rule.target if last_ramp_stage else next_batch, "noise_scale", above_since)
    return decision(False, None, "continue", above_since)


class _Evidence:
    """The scaled estimate, standard error and lower bound at each point of a trace (by index), the
    standard error over the current stage's points only."""

    def __init__(self, trace: Sequence[NoisePoint], *, rule: AdaptiveRule, stage_start: int) -> None:
        self.trace = trace
        self.rule = rule
        self.stage_start = stage_start
        self.estimates = smoothed_estimates(trace, smoothing=rule.smoothing)
        # The stage's first point: the trace is ordered by consumed samples.
        self.first = next(
            (index for index, point in enumerate(trace) if point.consumed_samples > stage_start), len(trace)
        )

    def estimate(self, index: int) -> float | None:
        value = self.estimates[index]
        return None if value is None else self.rule.scale * value

    def stderr(self, index: int) -> float | None:
        if index < self.first:
            return None
        recent = self.trace[max(self.first, index + 1 - window(self.rule.smoothing)) : index + 1]
        value = jackknife_stderr(recent)
        return None if value is None else self.rule.scale * value

    def lower_bound(self, index: int) -> float | None:
        """`scale * (estimate - k * stderr)`; without a standard error, the estimate only when k = 0."""
        estimate = self.estimate(index)
        if estimate is None:
            return None
        if self.rule.confidence == 0:
            return estimate
        stderr = self.stderr(index)
        return None if stderr is None else estimate - self.rule.confidence * stderr

    def above_since(self, threshold: int) -> int | None:
        """The consumed samples before the first step of the stage's trailing run of lower bounds at or
        above `threshold` (None when the last one is below it or unmeasured). Walks back from the last
        point: the standard errors of the trailing run only are computed, not of the whole stage."""
        since: int | None = None
        for index in range(len(self.trace) - 1, self.first - 1, -1):
            bound = self.lower_bound(index)
            if bound is None or bound < threshold:
                break
            since = self.trace[index - 1].consumed_samples if index > self.first else self.stage_start
        return since


@dataclass(frozen=True)
class StageDecision:
    """A decision taken: stage `stage` ended at `end_sample` and the next trains at `next_batch`."""

    stage: int
    end_sample: int
    next_batch: int
    decision: Decision

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "end_sample": self.end_sample,
            "next_batch": self.next_batch,
            **{
                key: value
                for key, value in self.decision.to_dict().items()
                if key not in ("fired", "next_batch")
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageDecision:
        fields = {
            key: value for key, value in data.items() if key not in ("stage", "end_sample", "next_batch")
        }
        decision = Decision(fired=True, next_batch=data["next_batch"], **fields)
        return cls(
            stage=data["stage"],
            end_sample=data["end_sample"],
            next_batch=data["next_batch"],
            decision=decision,
        )


def adaptive_schedule(
    *, start: int, target: int, ramp_samples: int, decisions: Sequence[StageDecision]
) -> BatchSchedule:
    """The batch schedule known after `decisions`: the decided stages, then the open stage at the last
    decided batch (or `start`) until `ramp_samples`, then the target. Once a decision reached the target,
    no open stage is left.

    Raises:
        ValueError: decisions out of order (stages, samples or batches not increasing, past the ramp end).
    """
    thresholds, batches = [0], [start]
    for k, taken in enumerate(decisions):
        if taken.stage != k or taken.end_sample <= thresholds[-1] or taken.next_batch <= batches[-1]:
            raise ValueError(f"decision {k} ({taken.to_dict()}) does not follow the ones before it")
        if taken.next_batch > target:
            raise ValueError(f"decision {k} goes to {taken.next_batch}, above the target {target}")
        thresholds.append(taken.end_sample)
        batches.append(taken.next_batch)
    if batches[-1] != target:
        if ramp_samples <= thresholds[-1]:
            raise ValueError(f"the open stage starts at {thresholds[-1]}, after the ramp end {ramp_samples}")
        thresholds.append(ramp_samples)
        batches.append(target)
    return BatchSchedule(thresholds=tuple(thresholds), batch_sizes=tuple(batches))


@dataclass(frozen=True)
class AdaptiveRun:
    """What a trainer of an adaptive ramp-up needs: the rule, the batch sizes the node schedule accepts,
    the pipeline's stage limit and the decisions taken before this launch."""

    rule: AdaptiveRule
    accepted: tuple[int, ...]
    max_stages: int
    decisions: tuple[StageDecision, ...]

    def open_stage(self) -> int:
        """The index of the stage whose end the rule decides (the one after the last decision)."""
        return len(self.decisions)
