"""Property tests over random valid ramp-ups: the stage list is a faithful, valid tiling."""

import itertools
from fractions import Fraction

import pytest
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
from batchpilot.planning.nodes import Placement

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
        placement=Placement(devices_per_node=devices_per_node, max_nodes=max_nodes, min_nodes=1),
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
        assert 1 <= stage.num_nodes <= setup["placement"].max_nodes
        # batch(consumed) at every step start agrees with the stage list
        for step in range(stage.num_steps):
            consumed = stage.start_sample + step * stage.global_batch_size
            assert schedule.batch_at(consumed) == stage.global_batch_size
            assert plan.stage_at(consumed) == stage


@st.composite
def megatron_inputs(draw):
    """A Megatron ramp-up on a cluster that plans it: every batch is a multiple of one pass over
    `min_nodes` nodes, and training runs at least two target steps past the ramp."""
    micro = draw(st.integers(1, 9))
    devices_per_node = draw(st.integers(1, 9))
    max_nodes = draw(st.integers(1, 9))
    min_nodes = draw(st.integers(1, max_nodes))
    unit = micro * devices_per_node * min_nodes  # min_nodes nodes split every multiple of this
    start = unit * draw(st.integers(1, 8))
    increment = unit * draw(st.integers(1, 8))
    target = start + increment * draw(st.integers(1, 8))
    ramp_samples = draw(st.integers(1, 5000))
    ramp_end = megatron_rampup(
        start=start, increment=increment, ramp_samples=ramp_samples, target=target
    ).ramp_end_sample
    return dict(
        start=start,
        increment=increment,
        target=target,
        ramp_samples=ramp_samples,
        total=ramp_end + draw(st.integers(2 * target, 20 * target)),
        micro=micro,
        devices_per_node=devices_per_node,
        max_nodes=max_nodes,
        min_nodes=min_nodes,
    )


def plan_megatron(
    *, start, increment, target, ramp_samples, total, micro, devices_per_node, max_nodes, min_nodes
):
    schedule = megatron_rampup(start=start, increment=increment, ramp_samples=ramp_samples, target=target)
    return plan_stages(
        schedule=schedule,
        total_samples=total,
        micro_batch_size=micro,
        lr_schedule=LR,
        placement=Placement(devices_per_node=devices_per_node, max_nodes=max_nodes, min_nodes=min_nodes),
    )


@settings(max_examples=300, deadline=None)
@given(megatron_inputs())
def test_a_ramp_every_stage_of_which_fits_min_nodes_plans_from_start_to_target(inputs):
    plan = plan_megatron(**inputs)
    stages = plan.stages
    assert stages[0].start_sample == 0 and stages[0].global_batch_size == inputs["start"]
    assert stages[-1].is_final and stages[-1].global_batch_size == inputs["target"]
    assert 0 <= inputs["total"] - plan.trained_samples < inputs["target"]
    for before, after in itertools.pairwise(stages):
        assert before.end_sample == after.start_sample
        assert before.global_batch_size < after.global_batch_size
        assert before.num_nodes <= after.num_nodes
    for stage in stages:
        assert (stage.global_batch_size - inputs["start"]) % inputs["increment"] == 0
        assert inputs["min_nodes"] <= stage.num_nodes <= inputs["max_nodes"]
        assert stage.data_parallel_size == stage.num_nodes * inputs["devices_per_node"]
        per_pass = inputs["micro"] * stage.data_parallel_size
        assert stage.gradient_accumulation_steps * per_pass == stage.global_batch_size


# Each broken input: (the field the refusal names, words of its problem).
REFUSALS = {
    "start not positive": ("batch.rampup", "must be positive"),
    "increment not positive": ("batch.rampup", "must be positive"),
    "start at or above the target": ("batch.rampup", "must be smaller than the target global batch size"),
    "increment not dividing the ramp": ("batch.rampup", "is not a multiple of increment"),
    "ramp samples not positive": ("batch.rampup.samples", "must be positive"),
    "training ends within the ramp": ("train.total_samples", "end before the ramp-up reaches the target"),
    "min_nodes above max_nodes": ("cluster.min_nodes", "exceeds cluster.max_nodes"),
    "target splits over no node count": (None, "no node count in ["),
}


@settings(max_examples=300, deadline=None)
@given(inputs=megatron_inputs(), broken=st.sampled_from(sorted(REFUSALS)), data=st.data())
def test_a_ramp_with_one_input_broken_is_refused_with_one_line_naming_it(inputs, broken, data):
    """One input of a ramp that plans is broken on purpose: the refusal names that input's field."""
    if broken == "start not positive":
        inputs["start"] = data.draw(st.integers(-4, 0))
    elif broken == "increment not positive":
        inputs["increment"] = data.draw(st.integers(-4, 0))
    elif broken == "start at or above the target":
        inputs["start"] = inputs["target"] + data.draw(st.integers(0, 300))
    elif broken == "increment not dividing the ramp":
        inputs["increment"] *= 2  # at least 2, and (target - start) becomes an odd multiple of its half
        inputs["target"] = (
            inputs["start"] + inputs["increment"] * data.draw(st.integers(0, 7)) + (inputs["increment"] // 2)
        )
    elif broken == "ramp samples not positive":
        inputs["ramp_samples"] = data.draw(st.integers(-4, 0))
    elif broken == "training ends within the ramp":
        ramp_end = megatron_rampup(
            start=inputs["start"],
            increment=inputs["increment"],
            ramp_samples=inputs["ramp_samples"],
            target=inputs["target"],
        ).ramp_end_sample
        inputs["total"] = data.draw(st.integers(1, ramp_end))
    elif broken == "min_nodes above max_nodes":
        inputs["min_nodes"] = inputs["max_nodes"] + data.draw(st.integers(1, 4))
    else:  # every batch, the target included, is one sample past a multiple of one device pass
        inputs["micro"] = data.draw(st.integers(2, 9))
        inputs["min_nodes"] = 1
        inputs["start"] = inputs["micro"] * inputs["devices_per_node"] * data.draw(st.integers(1, 8)) + 1
        inputs["increment"] = inputs["micro"] * inputs["devices_per_node"] * data.draw(st.integers(1, 8))
        inputs["target"] = inputs["start"] + inputs["increment"] * data.draw(st.integers(1, 8))
        inputs["total"] = 50 * inputs["target"] + inputs["ramp_samples"]
    field, problem = REFUSALS[broken]
    with pytest.raises(BatchpilotError) as info:
        plan_megatron(**inputs)
    error = info.value
    if field is None:  # the final stage, the first one the node walk places, names itself
        assert error.field.startswith("stage ") and error.field.endswith(
            f"(global_batch_size={inputs['target']})"
        ), error.field
    else:
        assert error.field == field, str(error)
    assert problem in error.problem, str(error)
    assert "\n" not in str(error)


@st.composite
def node_setups(draw, *, min_devices_per_node=1):
    """(cluster, micro batch, the fewest nodes a stage may run on): at least one whole loading group fits."""
    loading_factor = draw(st.integers(1, 4))
    max_nodes = draw(st.integers(loading_factor, 12))
    min_nodes = draw(st.integers(1, max_nodes // loading_factor * loading_factor))
    where = dict(
        devices_per_node=draw(st.integers(min_devices_per_node, 8)),
        max_nodes=max_nodes,
        min_nodes=min_nodes,
        loading_factor=loading_factor,
    )
    fewest = -(-min_nodes // loading_factor) * loading_factor
    return where, draw(st.integers(1, 8)), fewest


MULTIPLES = st.lists(st.integers(1, 12), min_size=1, max_size=6, unique=True).map(sorted)


@settings(max_examples=300, deadline=None)
@given(setup=node_setups(), multiples=MULTIPLES)
def test_batches_that_split_over_the_fewest_nodes_get_whole_loading_groups(setup, multiples):
    where, micro, fewest = setup
    batches = [micro * where["devices_per_node"] * fewest * k for k in multiples]
    assert unschedulable_stages(batch_sizes=batches, placement=Placement(**where)) == []
    nodes = schedule_nodes(batch_sizes=batches, micro_batch_size=micro, placement=Placement(**where))
    assert nodes == sorted(nodes)
    for batch, n in zip(batches, nodes, strict=True):
        assert n % where["loading_factor"] == 0 and where["min_nodes"] <= n <= where["max_nodes"]
        assert batch % (micro * where["devices_per_node"] * n) == 0
    # the target stage gets the most nodes that split it (NeMo's walk starts there)
    counts = range(where["min_nodes"], where["max_nodes"] + 1)
    assert nodes[-1] == max(
        n
        for n in counts
        if n % where["loading_factor"] == 0 and batches[-1] % (micro * where["devices_per_node"] * n) == 0
    )


@settings(max_examples=300, deadline=None)
@given(
    setup=node_setups(min_devices_per_node=2),
    multiples=MULTIPLES,
    unplaceable=st.sampled_from(["top batch off the pass grid", "bottom batch below one pass"]),
    data=st.data(),
)
def test_a_stage_micro_batch_1_cannot_place_no_micro_batch_can(setup, multiples, unplaceable, data):
    """What `config check` refuses before the micro batch is known (`unschedulable_stages`) is refused at
    every micro batch; the other stages split over the fewest nodes at the drawn micro batch."""
    where, micro, fewest = setup
    devices_per_node, loading_factor = where["devices_per_node"], where["loading_factor"]
    batches = [micro * devices_per_node * fewest * k for k in multiples]
    if unplaceable == "top batch off the pass grid":
        grid = devices_per_node * loading_factor  # every allowed node count's pass is a multiple of this
        top = grid * (batches[-1] // grid + data.draw(st.integers(1, 4))) + data.draw(
            st.integers(1, grid - 1)
        )
        batches, bad = [*batches, top], len(batches)
    else:  # fewer samples than devices on the fewest nodes
        batches, bad = [data.draw(st.integers(1, devices_per_node * fewest - 1)), *batches], 0
    assert unschedulable_stages(batch_sizes=batches, placement=Placement(**where)) == [bad]
    with pytest.raises(BatchpilotError) as info:
        schedule_nodes(batch_sizes=batches, micro_batch_size=micro, placement=Placement(**where))
    assert info.value.field == f"stage {bad} (global_batch_size={batches[bad]})"
    assert f"micro_batch_size={micro} x devices_per_node={devices_per_node}" in info.value.problem
    assert "\n" not in str(info.value)
    other = data.draw(st.integers(1, 8), label="another micro batch")
    with pytest.raises(BatchpilotError, match="no node count in"):
        schedule_nodes(batch_sizes=batches, micro_batch_size=other, placement=Placement(**where))


@settings(max_examples=100, deadline=None)
@given(loading_factor=st.integers(2, 4), groups=st.integers(0, 3), data=st.data())
def test_a_loading_factor_that_divides_no_node_count_is_refused(loading_factor, groups, data):
    min_nodes = loading_factor * groups + 1  # strictly between two whole loading groups
    max_nodes = data.draw(st.integers(min_nodes, loading_factor * (groups + 1) - 1))
    with pytest.raises(BatchpilotError) as info:
        schedule_nodes(
            batch_sizes=[loading_factor * 64],
            micro_batch_size=1,
            placement=Placement(
                devices_per_node=1, max_nodes=max_nodes, min_nodes=min_nodes, loading_factor=loading_factor
            ),
        )
    assert info.value.field == "data.expansion_factor_real_data"
    assert f"{loading_factor} divides no node count in [{min_nodes}, {max_nodes}]" in info.value.problem
