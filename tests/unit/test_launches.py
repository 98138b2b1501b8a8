"""Launches: consecutive stages on one node count run as one job (issue #13, part 4)."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.config import load_config
from batchpilot.errors import BatchpilotError
from batchpilot.kfp.shape import check_pipeline_launches, pipeline_launch_names
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.stages import build_plan
from batchpilot.planning.launches import launch_containing, launch_of, launches
from batchpilot.planning.table import plan_footer
from batchpilot.workflow.stage import select_launch, stage_metrics
from helpers import REPO

# Kubernetes label values (Labels and Selectors) and KFP task names: lower case, digits, dashes.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def nemo_plan():
    return build_plan(load_config(REPO / "configs" / "nemo_gpt3_5b.yaml"), micro_batch_size=4)


def test_the_nemo_example_is_eight_stages_in_five_launches():
    plan = nemo_plan()
    groups = launches(plan)
    assert [(g.name, g.first_stage, g.last_stage, g.num_nodes) for g in groups] == [
        ("stages-0-3", 0, 3, 8),
        ("stage-4", 4, 4, 10),
        ("stage-5", 5, 5, 12),
        ("stage-6", 6, 6, 14),
        ("final", 7, 7, 16),
    ]
    assert groups[0].stage_names == ("stage-0", "stage-1", "stage-2", "stage-3")
    assert [g.stage_arg for g in groups] == ["0-3", "4", "5", "6", "7"]
    assert [g.index for g in groups] == [0, 1, 2, 3, 4]


def test_the_demo_at_micro_batch_16_is_two_launches():
    plan = build_plan(load_config(REPO / "configs" / "demo.yaml"), micro_batch_size=16)
    assert [(s.global_batch_size, s.num_nodes) for s in plan.stages] == [(16, 1), (32, 1), (48, 1), (64, 2)]
    assert [(g.name, g.stage_arg, g.num_nodes) for g in launches(plan)] == [
        ("stages-0-2", "0-2", 1),
        ("final", "3", 2),
    ]


def test_a_launch_that_ends_with_the_final_stage_says_so():
    import yaml

    from batchpilot.config import parse_config

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["cluster"]["max_nodes"] = 1  # every stage on one node: one launch
    plan = build_plan(parse_config(data), micro_batch_size=16)
    assert [(g.name, g.stage_arg) for g in launches(plan)] == [("stages-0-final", "0-3")]


def test_a_launch_refuses_two_node_counts_and_gaps():
    plan = nemo_plan()
    with pytest.raises(ValueError, match="one launch runs on one node count"):
        launch_of(plan.stages[3:5], index=0)
    with pytest.raises(ValueError, match="not consecutive"):
        launch_of([plan.stages[0], plan.stages[2]], index=0)
    assert launch_containing(plan, 2).name == "stages-0-3"


@given(nodes=st.lists(st.integers(1, 4), min_size=1, max_size=12))
def test_launches_tile_the_stages_and_change_at_every_node_count_change(nodes):
    from batchpilot.planning.stages import Plan, Stage

    stages = tuple(
        Stage(k, "final" if k == len(nodes) - 1 else f"stage-{k}", 8, 8 * k, 8 * k + 8, n, n, 1, 8 // n, 1e-3,
              1, n, 8, n, k == len(nodes) - 1)
        for k, n in enumerate(nodes)
    )  # fmt: skip
    plan = Plan(stages, 8 * len(nodes), 1, 1, 4, nemo_plan().lr_schedule)
    groups = launches(plan)
    assert [k for g in groups for k in range(g.first_stage, g.last_stage + 1)] == list(range(len(nodes)))
    changes = sum(1 for a, b in itertools.pairwise(nodes) if a != b)
    assert len(groups) == changes + 1
    for g in groups:
        assert NAME.match(g.name), g.name
        assert {nodes[k] for k in range(g.first_stage, g.last_stage + 1)} == {g.num_nodes}


def test_the_plan_footer_lists_the_launches():
    assert (
        "5 launch(es): stages-0-3 on 8 node(s), stage-4 on 10, stage-5 on 12, stage-6 on 14, final on 16"
        in (plan_footer(nemo_plan(), None))
    )


# --- the workflow: which launch `--stage` names, the pipeline's launch groups ---------------------


def nemo_document():
    return make_run_document(load_config(REPO / "configs" / "nemo_gpt3_5b.yaml"), shape=None)


def test_stage_selects_a_launch_by_range_name_or_one_stage():
    document = nemo_document()
    assert select_launch(document, "0-3").name == "stages-0-3"
    assert select_launch(document, "stages-0-3").stage_arg == "0-3"
    one = select_launch(document, "2")  # one stage of a larger launch runs alone
    assert (one.name, one.stage_arg, one.num_nodes, one.index) == ("stage-2", "2", 8, 0)
    assert select_launch(document, "final").name == "final"
    with pytest.raises(BatchpilotError, match=r"run on 8, 10 nodes.*give one launch of this plan: 0-3"):
        select_launch(document, "2-4")


def test_pipelines_name_their_launches_when_the_micro_batch_is_fixed():
    assert pipeline_launch_names(load_config(REPO / "configs" / "nemo_gpt3_5b.yaml")) == (
        "stages-0-3", "stage-4", "stage-5", "stage-6", "final",
    )  # fmt: skip
    # An explored micro batch decides the node counts at run time: one slot per stage.
    demo = load_config(REPO / "configs" / "demo.yaml")
    assert pipeline_launch_names(demo) == ("launch-0", "launch-1", "launch-2", "launch-3")


def test_a_run_whose_launches_differ_from_the_compiled_ones_asks_for_a_recompile():
    document = nemo_document()
    names = pipeline_launch_names(document.config)
    check_pipeline_launches(document, expected=names, num_slots=5)
    check_pipeline_launches(document, expected=(), num_slots=8)
    with pytest.raises(BatchpilotError, match="compiled for stage-0, stage-1"):
        check_pipeline_launches(document, expected=("stage-0", "stage-1"), num_slots=2)
    with pytest.raises(BatchpilotError, match="at most 4 launch"):
        check_pipeline_launches(document, expected=(), num_slots=4)


def test_launch_metrics_are_the_last_step_of_its_stages_with_the_last_validation_loss(tmp_path, monkeypatch):
    import json

    document = nemo_document()
    records = [
        {"stage": s, "loss": 5.0 - s, "consumed_samples": 100 * s, "global_batch_size": 256 * (s + 1),
         "tokens_per_s": 1000.0 + s, "val_loss": v}
        for s, v in [(0, None), (1, 4.5), (2, None), (3, None), (4, 3.0)]
    ]  # fmt: skip
    monkeypatch.setattr("batchpilot.runstate.load_metrics", lambda uri: records)
    metrics = stage_metrics(document, launch=launches(document.plan)[0])
    assert metrics == {
        "loss": 2.0,
        "consumed_samples": 300.0,
        "global_batch_size": 1024.0,
        "tokens_per_s": 1003.0,
        "val_loss": 4.5,
    }
    without = [{k: v for k, v in r.items() if k != "val_loss"} for r in records]
    monkeypatch.setattr("batchpilot.runstate.load_metrics", lambda uri: without)
    assert "val_loss" not in stage_metrics(document, launch=launches(document.plan)[1])
    assert json.dumps(metrics)  # plain floats for KFP's Metrics


def test_the_plan_task_logs_the_launches_and_the_cost_estimate_as_kfp_metrics(tmp_path):
    from kfp.dsl import Artifact, Markdown, Metrics

    from batchpilot.kfp.components import plan as plan_component
    from batchpilot.kfp.pipeline import config_parameter
    from batchpilot.kfp.shape import plan_metrics

    config = load_config(REPO / "configs" / "nemo_gpt3_5b.yaml")
    document = make_run_document(config, samples_per_s_per_device=10.0)
    assert document.cost is not None
    metrics = plan_metrics(document)
    assert metrics["num_launches"] == 5 and metrics["num_stages"] == 8
    assert metrics["estimated_node_hours"] == pytest.approx(document.cost.node_hours)
    assert metrics["estimated_hours"] == pytest.approx(document.cost.duration_s / 3600)
    assert metrics["static_pool_node_hours"] == pytest.approx(document.cost.static_pool_node_hours)
    assert "estimated_node_hours" not in plan_metrics(nemo_document())  # no throughput, no estimate
    logged = Metrics(uri=str(tmp_path / "metrics"))
    plan_component(
        config_yaml=config_parameter(config), micro_batch_size=0, total_samples=0, expected_num_stages=8,
        run_dir="", plan_file=Artifact(uri=str(tmp_path / "plan.json")),
        plan_table=Markdown(uri=str(tmp_path / "plan.md")), expected_launches=",".join(
            pipeline_launch_names(config)), num_launch_slots=5, plan_metrics=logged,
    )  # fmt: skip
    assert logged.metadata["num_launches"] == 5
