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


def test_wsd_holds_the_peak_then_decays_over_the_spans_last_part():
    """Warmup-stable-decay (issue #38): warmup 100, then the peak until 1100 - 0.2 x 1000 = 900, then 1-sqrt to
    the floor at 1100 (by default), or the shape and share asked for."""
    lr = schedule(decay="wsd")
    assert lr.factor(99) == pytest.approx(1.0)
    assert lr.factor(100) == lr.factor(500) == lr.factor(899) == 1.0
    assert lr.factor(950) == pytest.approx(0.1 + 0.9 * (1 - 0.25**0.5))  # a quarter of the decay, 1-sqrt
    assert lr.factor(1100) == pytest.approx(0.1) and lr.factor(10**6) == pytest.approx(0.1)
    linear = schedule(decay="wsd", wsd_fraction=0.5, wsd_shape="linear")  # decays from 600
    assert linear.factor(599) == 1.0 and linear.factor(850) == pytest.approx(0.1 + 0.9 * 0.5)
    cosine = schedule(decay="wsd", wsd_fraction=1.0, wsd_shape="cosine")  # the whole span: plain cosine
    for consumed in (100, 350, 600, 1000, 1100):
        assert cosine.factor(consumed) == pytest.approx(schedule(decay="cosine").factor(consumed))


def test_wsd_settings_are_refused_without_wsd_and_left_out_of_other_configs():
    from batchpilot.config import Config
    from batchpilot.config.identity import run_identity
    from helpers import tiny_config

    base = tiny_config(data_uri="file:///tmp/d", checkpoint_uri="file:///tmp/c")
    with pytest.raises(ValueError, match="wsd_decay_fraction applies to lr_decay wsd only"):
        Config.model_validate({**base, "train": {**base["train"], "wsd_decay_fraction": 0.3}})
    plain = Config.model_validate(base)
    assert "wsd_decay_fraction" not in plain.train.model_dump()  # compiled pipelines stay as they were
    assert not any(key.startswith("train.wsd") for key in run_identity(plain))  # and checkpoints' identities
    wsd = Config.model_validate(
        {**base, "train": {**base["train"], "lr_decay": "wsd", "wsd_decay_fraction": 0.3}}
    )
    assert run_identity(wsd)["train.wsd_decay_fraction"] == 0.3
