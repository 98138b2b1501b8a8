"""Issue #15: the adaptive ramp-up's decision is a pure function of the noise-scale trace and the config,
checked on synthetic traces: steady growth, noise, a plateau, a trace that never reaches the next size."""

from __future__ import annotations

import dataclasses
import random

import pytest

from batchpilot.planning.adaptive import (
    AdaptiveRule,
    NoisePoint,
    decide,
    jackknife_stderr,
    smoothed_estimates,
)

ACCEPTED = [16, 32, 48, 64, 96, 128]
RULE = AdaptiveRule(
    start=16,
    target=128,
    smoothing=0.9,
    patience_samples=320,
    max_growth=2.0,
    min_stage_samples=0,
    ramp_samples=1_000_000,
)


def trace_of(critical: list[float], *, batch: int = 16, start: int = 0, noise: float = 0.0, seed: int = 0):
    """Points whose |G|^2 is 1 and S the wanted critical batch, with multiplicative noise on both."""
    rng = random.Random(seed)
    points = []
    for k, value in enumerate(critical):
        g2 = 1.0 * (1 + noise * rng.gauss(0, 1))
        s = value * (1 + noise * rng.gauss(0, 1))
        points.append(NoisePoint(consumed_samples=start + (k + 1) * batch, g2=g2, s=s))
    return points


def first_firing(trace, *, rule=RULE, current=16, stage_start=0, accepted=ACCEPTED):
    """The first prefix of `trace` at which the rule fires, and its decision (else None and the whole trace's)."""
    for end in range(1, len(trace) + 1):
        decision = decide(trace[:end], rule=rule, current=current, stage_start=stage_start, accepted=accepted)
        if decision.fired:
            return end, decision
    return None, decide(trace, rule=rule, current=current, stage_start=stage_start, accepted=accepted)


def test_steady_growth_fires_after_the_patience_at_the_next_size():
    # The critical batch grows 1 per step from 10: it crosses 32 (the next size above 16) at step 23.
    trace = trace_of([10 + k for k in range(100)])
    end, decision = first_firing(trace)
    assert decision.fired and decision.reason == "noise_scale"
    assert decision.threshold == 32
    # The smoothed estimate lags the trace; once above 32 it must stay there for 320 samples (20 steps).
    assert decision.consumed_samples - decision.above_since >= RULE.patience_samples
    assert decision.consumed_samples - decision.above_since < RULE.patience_samples + 16
    # The estimate (about 50) asks for 64, but one stage grows at most max_growth = 2x: 32.
    assert decision.estimate > 48 and decision.next_batch == 32
    assert end < len(trace)


def test_the_next_batch_is_the_smallest_accepted_size_at_least_the_estimate():
    # A critical batch of 40 from the start: the next size at least 40 is 48 (within 4 x 16 = 64).
    rule = AdaptiveRule(**{**RULE.to_dict(), "max_growth": 4.0})
    _, decision = first_firing(trace_of([40.0] * 40), rule=rule, current=16)
    assert decision.fired and decision.next_batch == 48
    assert decision.estimate == pytest.approx(40.0)


def test_growth_is_capped_per_stage_and_by_the_target():
    trace = trace_of([1000.0] * 40)
    _, decision = first_firing(trace, current=16)
    assert decision.next_batch == 32  # 2 x 16, although the estimate asks for more than the target
    _, decision = first_firing(trace_of([1000.0] * 40, batch=96), current=96)
    assert decision.next_batch == 128  # the target caps 192


def test_a_plateau_below_the_next_size_never_fires():
    trace = trace_of([30.0] * 200)  # just under 32
    end, decision = first_firing(trace)
    assert end is None and not decision.fired and decision.reason == "continue"
    assert decision.above_since is None and decision.estimate == pytest.approx(30.0)


def test_a_trace_that_never_reaches_the_next_size_hands_over_to_the_target_at_the_ramp_end():
    rule = AdaptiveRule(**{**RULE.to_dict(), "ramp_samples": 1600})
    end, decision = first_firing(trace_of([5.0] * 200), rule=rule)
    assert decision.fired and decision.reason == "ramp_end" and decision.next_batch == 128
    assert decision.consumed_samples == 1600 and end == 100


def test_noise_that_dips_below_the_threshold_restarts_the_patience():
    # 40 throughout but one step at 13 with a large |G|^2: the patience that had begun restarts after it.
    critical = [40.0] * 100
    trace = trace_of(critical)
    dip = 12
    trace[dip] = NoisePoint(trace[dip].consumed_samples, g2=50.0, s=0.0)
    _, decision = first_firing(trace)
    assert decision.fired
    assert decision.above_since > trace[dip].consumed_samples


def test_noisy_traces_fire_near_where_the_clean_trace_does():
    clean_end, clean = first_firing(trace_of([10 + k for k in range(100)]))
    ends = []
    for seed in range(20):
        end, decision = first_firing(trace_of([10 + k for k in range(100)], noise=0.3, seed=seed))
        assert decision.fired and decision.reason == "noise_scale"
        assert decision.stderr is not None and decision.stderr > 0
        ends.append(end)
    assert abs(sorted(ends)[10] - clean_end) <= 8  # the median lands within 8 steps
    assert clean.reason == "noise_scale"


def test_min_stage_samples_delays_the_decision():
    rule = AdaptiveRule(**{**RULE.to_dict(), "min_stage_samples": 2000})
    end, decision = first_firing(trace_of([40.0] * 200), rule=rule)
    assert decision.fired and decision.stage_samples >= 2000 and end == 125


def test_at_the_target_the_rule_never_fires():
    decision = decide(
        trace_of([1000.0] * 10, batch=128), rule=RULE, current=128, stage_start=0, accepted=ACCEPTED
    )
    assert not decision.fired and decision.reason == "at_target" and decision.threshold is None


def test_patience_counts_from_the_stage_start():
    # The estimate was above 32 long before this stage began at sample 1600: the stage must still wait.
    # Its standard error counts the stage's points only, and needs 3 of them: the lower bound exists (and
    # the patience begins) after the stage's second step, at 1632; on the estimate alone (k = 0), at 1600.
    trace = trace_of([40.0] * 100) + trace_of([40.0] * 10, start=1600)
    decision = decide(trace, rule=RULE, current=16, stage_start=1600, accepted=ACCEPTED)
    assert not decision.fired and decision.above_since == 1632
    on_estimate = AdaptiveRule(**{**RULE.to_dict(), "confidence": 0.0})
    decision = decide(trace, rule=on_estimate, current=16, stage_start=1600, accepted=ACCEPTED)
    assert not decision.fired and decision.above_since == 1600


def test_smoothing_and_uncertainty():
    trace = trace_of([10.0, 20.0, 30.0])
    values = smoothed_estimates(trace, smoothing=0.5)
    assert values[0] == pytest.approx(10.0)
    assert values[-1] == pytest.approx((0.25 * 10 + 0.5 * 20 + 1.0 * 30) / 1.75)  # weights 1/4, 1/2, 1
    assert jackknife_stderr(trace[:2]) is None
    assert jackknife_stderr(trace_of([7.0] * 5)) == pytest.approx(0.0)
    assert jackknife_stderr(trace_of([7.0] * 50, noise=0.2, seed=1)) > 0


def test_accepted_sizes_must_include_the_target():
    with pytest.raises(ValueError, match="include the target"):
        decide(trace_of([1.0]), rule=RULE, current=16, stage_start=0, accepted=[16, 32])


def test_the_last_ramp_stage_hands_over_to_the_target():
    trace = trace_of([40.0] * 40)
    decision = decide(trace, rule=RULE, current=16, stage_start=0, accepted=ACCEPTED, last_ramp_stage=True)
    assert decision.fired and decision.next_batch == 128


def test_the_schedule_after_decisions_has_the_open_stage_then_the_target():
    from batchpilot.planning.adaptive import StageDecision, adaptive_schedule

    def taken(stage, end, batch):
        decision = decide(trace_of([40.0] * 40), rule=RULE, current=16, stage_start=0, accepted=ACCEPTED)
        decision = dataclasses.replace(decision, next_batch=batch)
        return StageDecision(stage=stage, end_sample=end, next_batch=batch, decision=decision)

    schedule = adaptive_schedule(start=16, target=128, ramp_samples=10_000, decisions=[])
    assert (schedule.thresholds, schedule.batch_sizes) == ((0, 10_000), (16, 128))
    decided = [taken(0, 640, 32), taken(1, 1600, 64)]
    schedule = adaptive_schedule(start=16, target=128, ramp_samples=10_000, decisions=decided)
    assert (schedule.thresholds, schedule.batch_sizes) == ((0, 640, 1600, 10_000), (16, 32, 64, 128))
    done = [*decided, taken(2, 3200, 128)]
    schedule = adaptive_schedule(start=16, target=128, ramp_samples=10_000, decisions=done)
    assert (schedule.thresholds, schedule.batch_sizes) == ((0, 640, 1600, 3200), (16, 32, 64, 128))
    assert StageDecision.from_dict(done[1].to_dict()) == done[1]
    with pytest.raises(ValueError, match="does not follow"):
        adaptive_schedule(start=16, target=128, ramp_samples=10_000, decisions=[taken(0, 640, 16)])
