"""Launches on the nodes they get (#21): the node count a partial resize leaves a launch, the stages on it,
the record beside the checkpoints, and the resize step that decides it (local pool with a capacity limit)."""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from batchpilot.cluster.capacity import CapacityShortfall
from batchpilot.cluster.nodepool import LocalNodePool
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.checks import check_plan_config
from batchpilot.plan.rundoc import parse_run_document
from batchpilot.plan.stages import build_plan
from batchpilot.planning.capacity import LaunchCapacity, apply_capacity, fewer_nodes, stage_on_nodes
from batchpilot.planning.launches import launches
from batchpilot.planning.nodes import Placement
from batchpilot.workflow.canary import prepare_canary_pool
from batchpilot.workflow.capacity import prepare_launch_pool
from batchpilot.workflow.document import current_document, with_capacity
from batchpilot.workflow.plan import plan
from batchpilot.workflow.stage import pipeline_launch
from helpers import gke_a3_config, tiny_config


def nemo_like_plan():
    """Batches 8, 16, 64 on 1, 2, 4 nodes of 4 devices, micro batch 2."""
    config = tiny_config(data_uri="file:///data", checkpoint_uri="file:///ckpt")
    config["cluster"].update(devices_per_node=4, max_nodes=4)
    config["batch"].update(global_batch_size=64, micro_batch_size=2, schedule="0:8 320:16 960:64")
    parsed = parse_config(config)
    return parsed, build_plan(parsed, micro_batch_size=2)


def test_the_largest_node_count_the_batches_split_over_is_taken():
    _, plan = nemo_like_plan()
    final = plan.stages[-1]
    assert (final.global_batch_size, final.num_nodes) == (64, 4)
    # 64 = 2 x 4 devices x n x accumulation: 4, 2 and 1 nodes split it; 3 nodes (12 devices) do not.
    assert (
        fewer_nodes([final], available=3, placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=1))
        == 2
    )
    assert (
        fewer_nodes([final], available=1, placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=1))
        == 1
    )
    assert (
        fewer_nodes([final], available=3, placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=3))
        is None
    )
    assert (
        fewer_nodes([final], available=0, placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=1))
        is None
    )
    # Loading hosts: every 2nd host loads, so only even node counts run.
    assert (
        fewer_nodes(
            [final],
            available=3,
            placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=1, loading_factor=2),
        )
        == 2
    )
    assert (
        fewer_nodes(
            [final],
            available=1,
            placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=1, loading_factor=2),
        )
        is None
    )


def test_a_stage_on_fewer_nodes_keeps_its_batch_samples_and_lr_and_accumulates_more():
    _, plan = nemo_like_plan()
    final = plan.stages[-1]
    moved = stage_on_nodes(
        final, num_nodes=2, planned_nodes=4, devices_per_node=4, expansion_factor=Fraction(1)
    )
    kept = ("global_batch_size", "start_sample", "end_sample", "lr", "num_steps", "micro_batch_size", "name")
    assert all(getattr(moved, key) == getattr(final, key) for key in kept)
    assert (moved.num_nodes, moved.data_parallel_size, moved.world_size) == (2, 8, 8)
    assert moved.gradient_accumulation_steps == 2 * final.gradient_accumulation_steps == 4
    assert moved.planned_nodes == 4
    with pytest.raises(ValueError, match="does not split over 3 node"):
        stage_on_nodes(final, num_nodes=3, planned_nodes=4, devices_per_node=4, expansion_factor=Fraction(1))


def test_a_stage_with_a_larger_micro_batch_of_its_own_trains_at_the_plans_where_its_own_does_not_split():
    """#36 item 4 with cluster.fewer_nodes: allow: a stage that took a faster micro batch than the plan's
    (`faster_micro_batches`) keeps it on the nodes that came where it still splits the batch, and trains at
    the plan's there otherwise, rather than on fewer nodes still or not at all."""
    _, plan = nemo_like_plan()  # the plan's micro batch: 2
    # final's batch 96 at its own micro batch 6 on 4 nodes of 4 devices: 96 = 6 x 16 x 1
    final = replace(plan.stages[-1], global_batch_size=96, micro_batch_size=6, gradient_accumulation_steps=1)
    place = Placement(devices_per_node=4, max_nodes=4, min_nodes=1)
    # 3 nodes: 96 = 8 per device, which 6 does not split and 2 does
    assert fewer_nodes([final], available=3, placement=place) == 2
    assert fewer_nodes([final], available=3, placement=place, base_micro_batch=2) == 3
    on = {
        nodes: stage_on_nodes(
            final, num_nodes=nodes, planned_nodes=4, devices_per_node=4, expansion_factor=Fraction(1),
            base_micro_batch=2,
        )
        for nodes in (3, 2)
    }  # fmt: skip
    assert (on[3].micro_batch_size, on[3].data_parallel_size, on[3].gradient_accumulation_steps) == (2, 12, 4)
    assert (on[2].micro_batch_size, on[2].data_parallel_size, on[2].gradient_accumulation_steps) == (6, 8, 2)
    with pytest.raises(ValueError, match="does not split over 3 node"):
        stage_on_nodes(final, num_nodes=3, planned_nodes=4, devices_per_node=4, expansion_factor=Fraction(1))
    # The record of a launch moved to 3 nodes gives the same stage through the plan (its micro batch 2).
    with_final = replace(plan, stages=(*plan.stages[:-1], final))
    record = LaunchCapacity(
        "final", 2, 2, planned_nodes=4, ready_nodes=3, nodes=3, waited_s=1.0, reason="stockout"
    )
    assert apply_capacity(with_final, [record], expansion_factor=Fraction(1)).stages[-1] == on[3]


def test_a_record_moves_only_the_launch_it_was_made_for_and_launches_stay_the_planned_ones():
    _, plan = nemo_like_plan()
    planned = [(g.name, g.num_nodes) for g in launches(plan)]
    assert planned == [("stage-0", 1), ("stage-1", 2), ("final", 4)]
    record = LaunchCapacity(
        "final", 2, 2, planned_nodes=4, ready_nodes=3, nodes=2, waited_s=600.0, reason="stockout"
    )
    moved = apply_capacity(plan, [record], expansion_factor=Fraction(1))
    # final now runs on 2 nodes like stage-1, yet stays its own launch: grouping follows the plan.
    groups = launches(moved)
    assert [(g.name, g.num_nodes, g.planned_nodes) for g in groups] == [
        ("stage-0", 1, None),
        ("stage-1", 2, None),
        ("final", 2, 4),
    ]
    assert groups[-1].requested_nodes == 4 and "on 2 node(s) (planned 4)" in groups[-1].describe()
    assert moved.stages[:2] == plan.stages[:2]
    # A record of another plan (other stages, or another planned count) changes nothing.
    for stale in (replace(record, planned_nodes=8), replace(record, first_stage=1, last_stage=2)):
        assert apply_capacity(plan, [stale], expansion_factor=Fraction(1)) == plan


def test_plan_json_names_planned_nodes_only_where_a_launch_got_fewer(tmp_path):
    config, _ = nemo_like_plan()
    document = plan(config, announce=False)
    assert all("planned_nodes" not in stage for stage in json.loads(document.to_json())["stages"])
    assert "capacity" not in json.loads(document.to_json())
    record = LaunchCapacity(
        "final", 2, 2, planned_nodes=4, ready_nodes=3, nodes=2, waited_s=61.5, reason="stockout"
    )
    moved = with_capacity(document, [record])
    data = json.loads(moved.to_json())
    assert [stage.get("planned_nodes") for stage in data["stages"]] == [None, None, 4]
    assert data["capacity"] == [record.to_dict()]
    again = parse_run_document(moved.to_json())
    assert again.capacity == (record,) and again.plan == moved.plan


def test_the_settings_are_refused_where_they_cannot_apply():
    def problems(**cluster):
        config = gke_a3_config(**cluster)
        with pytest.raises(BatchpilotError) as error:
            check_plan_config(parse_config(config))
        return str(error.value)

    assert "cluster.fewer_nodes: allow applies to pool_mode resize, not autoscale" in problems(
        fewer_nodes="allow", pool_mode="autoscale"
    )
    assert "cluster.local_capacity_nodes: limits the local pool, but cluster.backend is gke" in problems(
        local_capacity_nodes=1
    )
    check_plan_config(parse_config(gke_a3_config(fewer_nodes="allow")))  # resize mode: accepted


def test_a_local_pool_grants_at_most_its_capacity_and_says_how_many_came(tmp_path):
    pool = LocalNodePool(state_path=tmp_path / "pool.json", devices_per_node=1, max_nodes=2, capacity_nodes=1)
    pool.resize(2)
    state = json.loads((tmp_path / "pool.json").read_text())
    assert (state["num_nodes"], state["requested_nodes"]) == (1, 2)
    with pytest.raises(CapacityShortfall) as short:
        pool.wait_ready(2, timeout_s=1)
    assert (short.value.ready, short.value.wanted) == (1, 2)
    assert "the local pool granted 1 of 2 node(s)" in str(short.value)
    pool.wait_ready(1, timeout_s=1)  # what it granted is ready


def local_document(tmp_path: Path, **cluster):
    config = tiny_config(data_uri="file:///data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["cluster"].update(pool_state_path=str(tmp_path / "pool.json"), **cluster)
    return plan(parse_config(config), announce=False)


def test_the_resize_step_trains_a_short_launch_on_fewer_nodes_only_when_allowed(tmp_path):
    # tiny: 16 on 1 node, then 32 and 64 on 2 nodes (launch-1 = stages-1-final).
    refused = local_document(tmp_path, local_capacity_nodes=1)
    assert [(g.name, g.num_nodes) for g in launches(refused.plan)] == [("stage-0", 1), ("stages-1-final", 2)]
    with pytest.raises(BatchpilotError) as error:
        prepare_launch_pool(refused, slot=1)
    assert "stages-1-final needs 2 node(s): the local pool granted 1 of 2 node(s)" in str(error.value)
    assert "set cluster.fewer_nodes: allow" in str(error.value)
    assert not (tmp_path / "ckpt" / "capacity.json").exists()

    document = local_document(tmp_path, local_capacity_nodes=1, fewer_nodes="allow")
    assert prepare_launch_pool(document, slot=1) == 1
    recorded = json.loads((tmp_path / "ckpt" / "capacity.json").read_text())["launches"]
    assert [(r["launch"], r["planned_nodes"], r["ready_nodes"], r["nodes"]) for r in recorded] == [
        ("stages-1-final", 2, 1, 1)
    ]
    # The train task (and the report) see the launch on 1 node at its planned batches.
    current = current_document(document)
    launch = pipeline_launch(document, slot=1)
    assert launch is not None and (launch.num_nodes, launch.planned_nodes) == (1, 2)
    assert [
        (s.global_batch_size, s.num_nodes, s.gradient_accumulation_steps) for s in current.plan.stages
    ] == [
        (16, 1, 1),
        (32, 1, 2),
        (64, 1, 4),
    ]
    # A retry that gets the planned nodes clears the record: the launch trains as planned.
    roomy = local_document(tmp_path, fewer_nodes="allow")
    assert prepare_launch_pool(roomy, slot=1) == 2
    assert json.loads((tmp_path / "ckpt" / "capacity.json").read_text())["launches"] == []
    assert current_document(roomy).plan == roomy.plan


def test_the_canary_pool_takes_the_nodes_that_came_only_when_allowed(tmp_path):
    # Without a plan (the pipeline explores first) the canary wants 2 nodes; the local pool grants 1.
    config = tiny_config(data_uri="file:///data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["cluster"].update(pool_state_path=str(tmp_path / "pool.json"), local_capacity_nodes=1)
    with pytest.raises(CapacityShortfall, match="the local pool granted 1 of 2 node"):
        prepare_canary_pool(parse_config(config))
    config["cluster"]["fewer_nodes"] = "allow"
    assert prepare_canary_pool(parse_config(config)) == 1
