"""Learning rate driven by samples, scaled per stage; cost estimate per stage."""

import pytest

from batchpilot.planning import LRSchedule, estimate_cost, explicit_schedule, plan_stages
from batchpilot.planning.nodes import Placement


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
    """16 (1 node) -> 32 (2 nodes) -> 64 (2 nodes) on nodes of 2 devices at micro batch 8, 2 samples/s per
    device: the stages train 320, 640 and 1088 samples on 2, 4 and 4 devices, i.e. 80, 80 and 136 s on 1, 2
    and 2 nodes (80, 160 and 272 node-seconds); a pool held at 2 nodes pays 2 x 296 = 592 node-seconds."""
    plan = plan_stages(
        schedule=explicit_schedule("0:16 320:32 960:64", target=64, seq_len=32),
        total_samples=2048,
        micro_batch_size=8,
        lr_schedule=schedule(),
        placement=Placement(devices_per_node=2, max_nodes=2, min_nodes=1),
    )
    assert [(s.global_batch_size, s.num_nodes, s.num_samples) for s in plan.stages] == [
        (16, 1, 320),
        (32, 2, 640),
        (64, 2, 1088),
    ]
    cost = estimate_cost(plan, samples_per_s_per_device=2.0)
    assert [s.duration_s for s in cost.stages] == pytest.approx([80.0, 80.0, 136.0])
    assert [s.node_hours for s in cost.stages] == pytest.approx([80 / 3600, 160 / 3600, 272 / 3600])
    assert cost.duration_s == pytest.approx(296.0)
    assert cost.node_hours == pytest.approx(512 / 3600)
    assert cost.static_pool_node_hours == pytest.approx(592 / 3600)
    assert cost.saving_ratio == pytest.approx(80 / 592)
    with pytest.raises(ValueError):
        estimate_cost(plan, samples_per_s_per_device=0)
