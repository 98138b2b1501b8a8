"""Issue #15: an adaptive ramp-up's plan as the decisions come in, the pipeline slot that trains each
stage, and what is refused before anything runs."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.config import load_config, parse_config
from batchpilot.kfp.shape import pipeline_launch_names
from batchpilot.plan.adaptive import accepted_batch_sizes
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.stages import build_plan, num_stages
from batchpilot.planning.adaptive import Decision, StageDecision
from batchpilot.planning.launches import launch_summary
from batchpilot.runstate import read_decisions, write_decisions
from batchpilot.workflow.document import current_document
from batchpilot.workflow.stage import pipeline_launch
from helpers import write_manifest

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_adaptive.yaml"


def taken(stage: int, end: int, batch: int) -> StageDecision:
    decision = Decision(
        fired=True, next_batch=batch, reason="noise_scale", estimate=float(batch), stderr=1.0,
        threshold=batch, above_since=end - 256, stage_samples=end, consumed_samples=end,
    )  # fmt: skip
    return StageDecision(stage=stage, end_sample=end, next_batch=batch, decision=decision)


def config_at(tmp_path: Path):
    data = yaml.safe_load(DEMO.read_text())
    data["train"]["checkpoint_uri"] = f"file://{tmp_path / 'ckpt'}"
    return parse_config(data)


def test_before_any_decision_the_plan_is_the_open_stage_and_the_target():
    config = load_config(DEMO)
    plan = build_plan(config, micro_batch_size=2)
    assert [(s.global_batch_size, s.start_sample, s.end_sample, s.num_nodes) for s in plan.stages] == [
        (4, 0, 8192, 2),
        (16, 8192, 16384, 2),
    ]
    assert plan.stage_per_launch and launch_summary(plan) == "2 launch(es): stage-0 on 2 node(s), final on 2"
    assert plan.notes[0].startswith(
        "adaptive ramp-up: 0 stage(s) decided so far; stage-0 (batch 4) ends when"
    )
    assert num_stages(config) == 6
    assert pipeline_launch_names(config) == tuple(f"launch-{k}" for k in range(6))


def test_the_accepted_sizes_are_those_some_node_count_splits():
    # micro 2 on 1-device nodes, at most the target's 2 nodes: every even size from the start to the target.
    assert accepted_batch_sizes(load_config(DEMO), micro_batch_size=2) == ([4, 6, 8, 10, 12, 14, 16], {})


def test_decided_stages_keep_their_node_counts_as_later_ones_are_added():
    config = load_config(DEMO)
    decisions = [taken(0, 2184, 6), taken(1, 2952, 8), taken(2, 3208, 12)]
    shapes = []
    for count in range(len(decisions) + 1):
        plan = build_plan(config, micro_batch_size=2, decisions=decisions[:count])
        shapes.append([(s.global_batch_size, s.num_nodes) for s in plan.stages])
        assert plan.stages[-1].global_batch_size == 16 and 16384 - 16 < plan.stages[-1].end_sample <= 16384
    assert shapes[-1] == [(4, 2), (6, 1), (8, 2), (12, 2), (16, 2)]
    for earlier, later in itertools.pairwise(shapes):
        assert later[: len(earlier) - 1] == earlier[:-1]  # the open stage is replaced, nothing before it
    plan = build_plan(config, micro_batch_size=2, decisions=[*decisions, taken(3, 3472, 16)])
    assert [s.global_batch_size for s in plan.stages] == [4, 6, 8, 12, 16]
    assert plan.stages[-1].start_sample == 3472 and "the target is reached" in plan.notes[0]


def test_each_slot_trains_the_stage_the_decisions_so_far_make(tmp_path):
    config = config_at(tmp_path)
    document = make_run_document(config, micro_batch_size=2)
    assert pipeline_launch(document, slot=0).describe() == "stage-0: stage-0 on 2 node(s)"
    write_decisions(config.train.checkpoint_uri, [taken(0, 2184, 6)])
    assert read_decisions(config.train.checkpoint_uri) == [taken(0, 2184, 6)]
    assert pipeline_launch(document, slot=1).describe() == "stage-1: stage-1 on 1 node(s)"
    current = current_document(document)
    assert current.decisions == (taken(0, 2184, 6),) and current.memory is None
    assert '"adaptive_decisions"' in current.to_json()
    write_decisions(config.train.checkpoint_uri, [taken(0, 2184, 6), taken(1, 2952, 16)])
    assert pipeline_launch(document, slot=2).describe() == "final: final on 2 node(s)"
    assert pipeline_launch(document, slot=3) is None  # the target was reached: the slot does nothing


def test_a_fixed_ramp_run_document_has_no_decision_log(tmp_path):
    data = yaml.safe_load((DEMO.parent / "demo.yaml").read_text())
    document = make_run_document(parse_config(data), micro_batch_size=16)
    assert "adaptive_decisions" not in document.to_json() and current_document(document) is document


@pytest.mark.parametrize(
    ("adaptive", "expected"),
    [
        (
            {"start": 16},
            "batch.rampup.adaptive.start: (16) must be smaller than the target global batch size (16) (fix: "
            "lower the start or remove the ramp-up)",
        ),
        (
            {"max_growth": 1.0},
            "batch.rampup.adaptive.max_growth: Input should be greater than 1",
        ),
    ],
)
def test_bad_adaptive_settings_are_one_line(tmp_path, capsys, adaptive, expected):
    data = yaml.safe_load(DEMO.read_text())
    data["batch"]["rampup"]["adaptive"].update(adaptive)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err.splitlines()[0].startswith(f"batchpilot: error: {expected}")


def test_the_adaptive_form_plans_under_the_xla_runtime(tmp_path, capsys):
    """The XLA trainer runs the decision rule (train/loop.py), so TPU plans may be adaptive."""
    data = yaml.safe_load(DEMO.read_text())
    data["data"]["uri"] = write_manifest(tmp_path / "data")
    data["train"]["runtime"] = "xla"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--config", str(path)]) == 0
    assert "adaptive ramp-up: 0 stage(s) decided so far" in capsys.readouterr().out


def test_a_doubling_warm_up_accepts_only_the_doubled_sizes():
    data = yaml.safe_load(DEMO.read_text())
    data["batch"]["global_batch_size"] = 24
    data["batch"]["rampup"]["adaptive"]["doubling"] = True
    accepted, _ = accepted_batch_sizes(parse_config(data), micro_batch_size=2)
    assert accepted == [4, 8, 16, 24]


def test_stage_decisions_round_trip():
    decision = taken(2, 3208, 12)
    assert StageDecision.from_dict(decision.to_dict()) == decision
    assert dataclasses.asdict(decision.decision)["reason"] == "noise_scale"
