"""Learning rate driven by samples, scaled per stage; cost estimate per stage."""

import math

import pytest

from batchpilot.planning import LRSchedule, estimate_cost, megatron_rampup, plan_stages


def schedule(**overrides):
    values = dict(
        lr=1e-3,
        scaling="none",
        reference_batch=64,
        warmup_samples=100,
        decay="cosine",
        decay_end_samples=1100,
        min_lr_ratio=0.1,
    )
    values.update(overrides)
    return LRSchedule(**values)


def test_scaling_rules():
    assert schedule(scaling="none").peak(256) == pytest.approx(1e-3)
    assert schedule(scaling="linear").peak(256) == pytest.approx(4e-3)
    assert schedule(scaling="sqrt").peak(256) == pytest.approx(2e-3)
    assert schedule(scaling="sqrt").peak(16) == pytest.approx(5e-4)


def test_warmup_then_cosine_in_samples():
    lr = schedule()
    assert lr.at(consumed_samples=0, global_batch_size=64) == pytest.approx(1e-5)
    assert lr.at(consumed_samples=49, global_batch_size=64) == pytest.approx(5e-4)
    assert lr.at(consumed_samples=100, global_batch_size=64) == pytest.approx(1e-3)
    assert lr.at(consumed_samples=600, global_batch_size=64) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr.at(consumed_samples=1100, global_batch_size=64) == pytest.approx(1e-4)
    assert lr.at(consumed_samples=10**9, global_batch_size=64) == pytest.approx(1e-4)


def test_linear_and_constant_decay():
    assert schedule(decay="linear").factor(600) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(decay="constant").factor(10**6) == 1.0


def test_lr_factor_does_not_depend_on_the_batch_size():
    """Ramp-up cannot shift the schedule: the factor is a function of consumed samples only."""
    lr = schedule(scaling="sqrt")
    for consumed in (0, 50, 100, 700, 5000):
        ratio = lr.at(consumed_samples=consumed, global_batch_size=256) / lr.at(
            consumed_samples=consumed, global_batch_size=64
        )
        assert ratio == pytest.approx(2.0)


def test_cost_estimate_against_a_pool_held_at_max_nodes():
    plan = plan_stages(
        schedule=megatron_rampup(start=256, increment=256, ramp_samples=10_000_000, target=2048),
        total_samples=20_000_000,
        micro_batch_size=4,
        devices_per_node=8,
        max_nodes=16,
        min_nodes=1,
        lr_schedule=schedule(),
    )
    cost = estimate_cost(plan, samples_per_s_per_device=2.0)
    first = plan.stages[0]
    assert cost.stages[0].duration_s == pytest.approx(first.num_samples / (2.0 * 64))
    assert cost.stages[0].node_hours == pytest.approx(cost.stages[0].duration_s / 3600 * 8)
    assert cost.duration_s == pytest.approx(sum(s.num_samples / (2.0 * s.world_size) for s in plan.stages))
    static = sum(s.num_samples / (2.0 * s.world_size) / 3600 * 16 for s in plan.stages)
    assert cost.static_pool_node_hours == pytest.approx(static)
    assert 0 < cost.saving_ratio < 1
    assert math.isclose(cost.node_hours, (1 - cost.saving_ratio) * static)
    with pytest.raises(ValueError):
        estimate_cost(plan, samples_per_s_per_device=0)
