"""The adaptive ramp-up's rule (`planning.adaptive.decide`), the rule a one-line slip would break unseen: a
lower bound exactly at the threshold counts as "at or above" it, so a trace that sits exactly on the next
accepted batch for the patience fires; one just below it never does.

The trace's values are powers of two with smoothing 0.5, so the smoothed estimate is exactly the value.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from batchpilot.planning.adaptive import AdaptiveRule, NoisePoint, decide, smoothed_estimates

ACCEPTED = [16, 32, 64, 128]
RULE = AdaptiveRule(
    start=16, target=128, smoothing=0.5, patience_samples=160, max_growth=2.0, min_stage_samples=0,
    ramp_samples=1_000_000,
)  # fmt: skip


def constant_trace(s: float, *, steps: int = 30, batch: int = 16) -> list[NoisePoint]:
    """Every step measures |G|^2 = 1 and S = `s`: B_simple = s."""
    return [NoisePoint(consumed_samples=(k + 1) * batch, g2=1.0, s=s) for k in range(steps)]


@pytest.mark.parametrize("confidence", [0.0, 2.0])  # k = 2: a constant trace has no standard error
def test_a_trace_exactly_at_the_threshold_fires(confidence):
    rule = dataclasses.replace(RULE, confidence=confidence)
    trace = constant_trace(32.0)
    assert smoothed_estimates(trace, smoothing=rule.smoothing)[-1] == 32.0
    decision = decide(trace, rule=rule, current=16, stage_start=0, accepted=ACCEPTED)
    assert decision.threshold == 32 and decision.lower_bound == 32.0
    assert decision.fired and decision.reason == "noise_scale" and decision.next_batch == 32
    # At or above since the stage's start (k = 0), or since its third step (k = 2: a standard error needs
    # 3 points, so the first two steps have no lower bound); either way the patience passed long ago.
    assert decision.above_since == (0 if confidence == 0 else 2 * 16)


def test_a_trace_just_below_the_threshold_never_fires():
    trace = constant_trace(math.nextafter(32.0, 0.0))
    decision = decide(trace, rule=RULE, current=16, stage_start=0, accepted=ACCEPTED)
    assert not decision.fired and decision.above_since is None
