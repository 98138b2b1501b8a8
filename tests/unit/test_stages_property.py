"""Property tests over random valid ramp-ups: the stage list is a faithful, valid tiling."""

import itertools
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.errors import BatchpilotError
from batchpilot.planning import (
    LRSchedule,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
    plan_stages,
    schedule_nodes,
    unschedulable_stages,
)

LR = LRSchedule(
    lr=1e-3,
    scaling="sqrt",
    reference_batch=64,
    warmup_samples=0,
    decay="constant",
    decay_end_samples=0,
    min_lr_ratio=0,
)


@st.composite
def valid_setups(draw):
    micro = draw(st.integers(1, 8))
    devices_per_node = draw(st.integers(1, 8))
    max_nodes = draw(st.integers(1, 16))
    unit = micro * devices_per_node  # one node always fits a multiple of this
    form = draw(st.sampled_from(["megatron", "maxtext", "explicit"]))
    num_increments = draw(st.integers(1, 8))
    if form == "maxtext":
        num_devices = devices_per_node * max_nodes
        per_device_start = draw(st.integers(1, 4)) * micro
        per_device_increment = draw(st.integers(1, 4)) * micro
        target = (per_device_start + num_increments * per_device_increment) * num_devices
        ramp_samples = draw(st.integers(1, 50 * target))
        schedule = maxtext_rampup(
            per_device_start=Fraction(per_device_start),
            per_device_increment=Fraction(per_device_increment),
            ramp_samples=ramp_samples,
            target=target,
            num_devices=num_devices,
        )
    else:
        start = unit * draw(st.integers(1, 16))
        increment = unit * draw(st.integers(1, 16))
        target = start + num_increments * increment
        ramp_samples = draw(st.integers(1, 50 * target))
        schedule = megatron_rampup(start=start, increment=increment, ramp_samples=ramp_samples, target=target)
        if form == "explicit":
            text = " ".join(
                f"{t}:{b}" for t, b in zip(schedule.thresholds, schedule.batch_sizes, strict=True)
            )
            schedule = explicit_schedule(text, target=target, seq_len=128)
    total = schedule.ramp_end_sample + draw(st.integers(2 * target, 20 * target))
    return dict(
        schedule=schedule,
        total_samples=total,
        micro_batch_size=micro,
        devices_per_node=devices_per_node,
        max_nodes=max_nodes,
        min_nodes=1,
        lr_schedule=LR,
    )


@settings(max_examples=300, deadline=None)
@given(valid_setups())
def test_stages_tile_divide_and_agree_with_the_schedule(setup):
    plan = plan_stages(**setup)
    schedule = setup["schedule"]
    stages = plan.stages
    # tile [0, trained) with no gap or overlap; only a remainder smaller than one final step is left
    assert stages[0].start_sample == 0
    for before, after in itertools.pairwise(stages):
        assert before.end_sample == after.start_sample
        assert before.global_batch_size < after.global_batch_size
        assert before.num_nodes <= after.num_nodes  # nodes never decrease
    assert 0 <= setup["total_samples"] - plan.trained_samples < schedule.target
    assert stages[-1].is_final and stages[-1].global_batch_size == schedule.target
    for stage in stages:
        per_pass = stage.micro_batch_size * stage.data_parallel_size
        assert stage.global_batch_size % per_pass == 0
        assert stage.gradient_accumulation_steps * per_pass == stage.global_batch_size
        assert (stage.end_sample - stage.start_sample) == stage.num_steps * stage.global_batch_size
        assert 1 <= stage.num_nodes <= setup["max_nodes"]
        # batch(consumed) at every step start agrees with the stage list
        for step in range(stage.num_steps):
            consumed = stage.start_sample + step * stage.global_batch_size
            assert schedule.batch_at(consumed) == stage.global_batch_size
            assert plan.stage_at(consumed) == stage


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(-4, 300),
    increment=st.integers(-4, 300),
    target=st.integers(1, 1200),
    ramp_samples=st.integers(0, 5000),
    total=st.integers(1, 20000),
    micro=st.integers(1, 9),
    devices_per_node=st.integers(1, 9),
    max_nodes=st.integers(1, 9),
    min_nodes=st.integers(1, 9),
)
def test_any_input_either_plans_or_raises_a_user_error(
    start, increment, target, ramp_samples, total, micro, devices_per_node, max_nodes, min_nodes
):
    """No combination crashes with anything but a BatchpilotError naming a field."""
    try:
        schedule = megatron_rampup(start=start, increment=increment, ramp_samples=ramp_samples, target=target)
        plan = plan_stages(
            schedule=schedule,
            total_samples=total,
            micro_batch_size=micro,
            devices_per_node=devices_per_node,
            max_nodes=max_nodes,
            min_nodes=min_nodes,
            lr_schedule=LR,
        )
    except BatchpilotError as error:
        assert error.field and error.problem
        assert "\n" not in str(error)
    else:
        assert plan.stages[-1].global_batch_size == target


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.integers(1, 600), min_size=1, max_size=6, unique=True).map(sorted),
    micro=st.integers(1, 8),
    devices_per_node=st.integers(1, 8),
    max_nodes=st.integers(1, 12),
    min_nodes=st.integers(1, 12),
    loading_factor=st.integers(1, 4),
)
def test_a_stage_micro_batch_1_cannot_place_no_micro_batch_can(
    batches, micro, devices_per_node, max_nodes, min_nodes, loading_factor
):
    """What `config check` refuses before the micro batch is known is refused at every micro batch, and
    the node counts chosen are always whole numbers of loading groups."""
    if min_nodes > max_nodes or min_nodes > max_nodes // loading_factor * loading_factor:
        return
    where = dict(devices_per_node=devices_per_node, max_nodes=max_nodes, min_nodes=min_nodes)
    unplaceable = unschedulable_stages(batch_sizes=batches, loading_factor=loading_factor, **where)
    try:
        nodes = schedule_nodes(
            batch_sizes=batches, micro_batch_size=micro, loading_factor=loading_factor, **where
        )
    except BatchpilotError as error:
        assert "\n" not in str(error)
    else:
        assert not unplaceable
        assert all(n % loading_factor == 0 and min_nodes <= n <= max_nodes for n in nodes)
