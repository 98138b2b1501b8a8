"""The workflow steps and the run document: one decision for the CLI and the pipeline, edits refused."""

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.config import config_from_text
from batchpilot.errors import BatchpilotError
from batchpilot.kfp.shape import expected_stage_count, explore_in_pipeline, pipeline_launch_names
from batchpilot.plan.rundoc import parse_run_document
from batchpilot.workflow.explore import read_explore
from batchpilot.workflow.plan import plan
from helpers import REPO, run_batchpilot, write_manifest

DEMO = (REPO / "configs" / "demo.yaml").read_text()


def explore_file(
    folder: Path, *, micro: int = 16, compatible: int | None = None, checkpointing: bool = False
) -> Path:
    path = folder / "explore.json"
    recommendation = {
        "micro_batch_size": micro,
        "activation_checkpointing": checkpointing,
        "compile": False,
        "plan_compatible_micro_batch_size": compatible,
        "plan_compatible_activation_checkpointing": None if compatible is None else checkpointing,
        "plan_compatible_compile": None if compatible is None else False,
    }
    probes = [{"micro_batch_size": micro, "fits": True, "samples_per_s": 400.0}]
    path.write_text(json.dumps({"recommendation": recommendation, "probes": probes, "noise_scale": None}))
    return path


def test_run_time_overrides():
    config = config_from_text(DEMO, micro_batch_size=8, total_samples=8192)
    assert config.batch.micro_batch_size == 8 and config.total_samples == 8192
    assert config_from_text(DEMO).batch.micro_batch_size == "explore"
    as_json = json.dumps(yaml.safe_load(DEMO))  # the compiled default is one line of JSON
    assert config_from_text(as_json) == config_from_text(DEMO)


def test_plan_uses_the_explored_micro_batch_and_records_what_it_used(tmp_path):
    explore = read_explore(explore_file(tmp_path, micro=64, compatible=16))
    document = plan(config_from_text(DEMO), explore=explore, expected_num_stages=4)
    assert document.plan.micro_batch_size == 16 and document.micro_batch_source == "explore"
    assert [s.num_nodes for s in document.plan.stages] == [1, 1, 1, 2]
    assert document.explore is not None and document.explore["recommendation"]["micro_batch_size"] == 64
    assert "does not fit every stage" in document.notes[0]
    overridden = plan(config_from_text(DEMO), micro_batch_size=8, explore=explore)
    assert overridden.plan.micro_batch_size == 8 and overridden.micro_batch_source == "override"
    assert any("explore recommends micro_batch_size=16" in note for note in overridden.notes)


def test_the_stages_run_the_setting_explore_measured(tmp_path):
    """A size that fits only with activation checkpointing is trained with it: the plan's resolved config
    takes explore's setting, says so, and sizes memory with it."""
    explore = read_explore(explore_file(tmp_path, micro=16, checkpointing=True))
    document = plan(config_from_text(DEMO), explore=explore)
    assert document.config.train.activation_checkpointing is True
    assert any(
        "train.activation_checkpointing: true (explore measured micro_batch_size=16" in n
        for n in document.notes
    )
    assert parse_run_document(document.to_json()).config.train.activation_checkpointing is True
    integer = config_from_text(DEMO.replace("micro_batch_size: explore", "micro_batch_size: 16"))
    assert plan(integer, explore=explore).config.train.activation_checkpointing is False


def test_the_studys_advice_is_shown_beside_the_configs_numbers(tmp_path):
    path = explore_file(tmp_path, micro=16)
    data = json.loads(path.read_text())
    data["noise_scale"] = {
        "critical_batch_size": 183.4,
        "recommended_global_batch_size": 192,
        "lr_scaling": "sqrt",
    }
    path.write_text(json.dumps(data))
    document = plan(config_from_text(DEMO), explore=read_explore(path))
    assert document.config.batch.global_batch_size == 64  # the user's numbers stand
    assert any(
        "critical batch ~183 samples, advises a target global batch of 192 with train.lr_scaling: sqrt; this plan "
        "keeps batch.global_batch_size 64" in note
        for note in document.notes
    )


def test_an_integer_in_the_config_stands_and_explore_is_noted(tmp_path):
    config = config_from_text(DEMO.replace("micro_batch_size: explore", "micro_batch_size: 8"))
    explore = read_explore(explore_file(tmp_path, micro=16))
    document = plan(config, explore=explore)
    assert document.plan.micro_batch_size == 8 and document.micro_batch_source == "config"
    assert document.cost is None  # explore measured 16, not 8: no throughput for the estimate


def test_the_cost_comes_from_explores_throughput_at_the_planned_size(tmp_path):
    document = plan(config_from_text(DEMO), explore=read_explore(explore_file(tmp_path, micro=16)))
    assert document.cost is not None and document.cost.samples_per_s_per_device == 400.0
    data = json.loads(document.to_json())
    assert data["cost"]["node_hours"] == pytest.approx(document.cost.node_hours)


def test_a_config_with_another_stage_count_asks_for_a_recompile():
    longer_ramp = DEMO.replace("increment: 16", "increment: 8")
    with pytest.raises(
        BatchpilotError, match=r"implies 7 stage\(s\) but this pipeline was compiled for 4"
    ) as info:
        plan(config_from_text(longer_ramp, micro_batch_size=8), expected_num_stages=4)
    assert "batchpilot compile" in str(info.value)


def test_the_run_document_round_trips_and_refuses_an_edited_config():
    document = plan(config_from_text(DEMO), micro_batch_size=16)
    text = document.to_json()
    data = json.loads(text)
    # What the document says, against the demo's ramp [16, 16, 4096] to 64 over 16,384 samples on 1-2 nodes
    # at micro batch 16, with the LR scaled by sqrt(batch / 64):
    assert (data["format_version"], data["micro_batch_source"], data["micro_batch_size"]) == (
        4,
        "override",
        16,
    )
    assert (data["total_samples"], data["trained_samples"], data["num_steps"]) == (
        16384,
        16384,
        86 + 43 + 28 + 192,
    )
    assert [
        (
            s["global_batch_size"],
            s["num_nodes"],
            s["start_sample"],
            s["end_sample"],
            s["gradient_accumulation_steps"],
        )
        for s in data["stages"]
    ] == [(16, 1, 0, 1376, 1), (32, 1, 1376, 2752, 2), (48, 1, 2752, 4096, 3), (64, 2, 4096, 16384, 2)]
    assert [s["lr"] for s in data["stages"]] == pytest.approx(
        [3e-4 * 0.5, 3e-4 * 0.5**0.5, 3e-4 * 0.75**0.5, 3e-4]
    )
    assert data["lr_schedule"] == {
        "lr": 3e-4,
        "scaling": "sqrt",
        "reference_batch": 64,
        "warmup_samples": 1024,
        "decay": "cosine",
        "decay_end_samples": 16384,
        "min_lr_ratio": 0.1,
    }
    # ... and reads back as the document that was written, part by part.
    parsed = parse_run_document(text)
    assert parsed.config == document.config and parsed.plan == document.plan
    assert parsed.memory == document.memory and parsed.micro_batch_source == "override"
    edited = json.loads(text)
    edited["config"]["train"]["lr"] = 1.0
    with pytest.raises(BatchpilotError, match="config was edited after the plan was made"):
        parse_run_document(json.dumps(edited))
    edited["format_version"] = 1
    with pytest.raises(BatchpilotError, match="format_version: is 1"):
        parse_run_document(json.dumps(edited))


def test_train_refuses_a_plan_whose_config_was_edited(tmp_path):
    plan = tmp_path / "plan.json"
    write_manifest(tmp_path / "runs" / "demo" / "data")  # the demo's data.uri is relative to the folder
    assert run_batchpilot("plan", "--config", str(REPO / "configs" / "demo.yaml"), "--micro-batch-size", "16",
                          "--out", str(plan), cwd=tmp_path).returncode == 0  # fmt: skip
    data = json.loads(plan.read_text())
    data["config"]["data"]["seq_len"] = 64
    plan.write_text(json.dumps(data))
    result = run_batchpilot(
        "train", "--plan", str(plan), "--stage", "0", "--output-dir", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"batchpilot: error: {plan}: config: does not match the plan's config_hash"
    )
    assert not (tmp_path / "out").exists()


def test_the_cli_and_the_pipeline_make_the_same_plan(tmp_path):
    """`batchpilot plan --explore` and the pipeline's plan component, on the same config and explore.json."""
    from kfp.dsl import Artifact, Markdown

    from batchpilot.kfp.components import plan as plan_component

    explore_dir = tmp_path / "explore"
    explore_dir.mkdir()
    explore = explore_file(explore_dir, micro=64, compatible=16)
    by_cli = tmp_path / "cli.json"
    config = REPO / "configs" / "demo.yaml"
    write_manifest(tmp_path / "runs" / "demo" / "data")  # the demo's data.uri is relative to the folder
    result = run_batchpilot(
        "plan", "--config", str(config), "--explore", str(explore), "--out", str(by_cli), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    by_pipeline = plan_component(
        config_yaml=DEMO, micro_batch_size=0, total_samples=0, expected_num_stages=4, run_dir="",
        explore_dir=Artifact(uri=str(explore_dir)), plan_file=Artifact(uri=str(tmp_path / "plan_file")),
        plan_table=Markdown(uri=str(tmp_path / "plan.md")),
    )  # fmt: skip
    assert by_pipeline == by_cli.read_text()
    assert json.loads(by_pipeline)["micro_batch_size"] == 16
    # The CLI's table and the pipeline's Markdown come from one table model: the same rows.
    markdown = (tmp_path / "plan.md").read_text()
    table = run_batchpilot("plan", "--config", str(config), "--explore", str(explore), cwd=tmp_path).stdout
    cli_rows = [
        [c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")
    ]
    md_rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in markdown.splitlines()[2:]
        if line.startswith("|")
    ]
    assert cli_rows == md_rows and len(md_rows) == 4


def test_the_plan_component_without_an_exploration_uses_the_configs_micro_batch(tmp_path):
    """A pipeline with nothing to explore has no explore task: the plan gets no explore input."""
    from kfp.dsl import Artifact, Markdown

    from batchpilot.kfp.components import plan as plan_component

    fixed = DEMO.replace("micro_batch_size: explore", "micro_batch_size: 16")
    text = plan_component(
        config_yaml=fixed, micro_batch_size=0, total_samples=0, expected_num_stages=4, run_dir="",
        plan_file=Artifact(uri=str(tmp_path / "plan_file")), plan_table=Markdown(uri=str(tmp_path / "plan.md")),
    )  # fmt: skip
    document = parse_run_document(text)
    assert document.micro_batch_source == "config" and document.explore is None
    assert document.plan.micro_batch_size == 16


def test_explore_in_the_pipeline_only_when_there_is_something_to_explore():
    searched = config_from_text(DEMO)
    fixed = config_from_text(DEMO, micro_batch_size=16)
    no_study = fixed.model_copy(update={"explore": fixed.explore.model_copy(update={"study": False})})
    assert explore_in_pipeline(searched) and explore_in_pipeline(fixed)
    assert not explore_in_pipeline(no_study)


AUTO = DEMO.replace("global_batch_size: 64", "global_batch_size: auto\n  max_global_batch_size: 256")


def study_file(folder: Path, *, critical: float, recommended: int) -> Path:
    path = explore_file(folder, micro=16)
    data = json.loads(path.read_text())
    data["noise_scale"] = {
        "critical_batch_size": critical,
        "recommended_global_batch_size": recommended,
        "lr_scaling": "sqrt",
    }
    path.write_text(json.dumps(data))
    return path


def test_an_auto_target_takes_the_studys_advice_rounded_to_what_the_ramp_accepts(tmp_path):
    """global_batch_size: auto (#13): the demo's ramp [16, 16, 4096] on 1-2 nodes at micro 16 accepts
    multiples of 16 above 16; the study's 100 becomes 96, with the sqrt rule (96 <= 2 x 90)."""
    assert "global_batch_size: auto" in AUTO
    explore = read_explore(study_file(tmp_path, critical=90.0, recommended=100))
    document = plan(config_from_text(AUTO), explore=explore)
    assert document.config.batch.global_batch_size == 96
    assert document.config.train.lr_scaling == "sqrt"
    assert [s.global_batch_size for s in document.plan.stages] == [16, 32, 48, 64, 80, 96]
    assert any(
        "batch.global_batch_size: auto -> 96 (explore's study: critical batch ~90" in n
        for n in document.notes
    )
    assert parse_run_document(document.to_json()).config.batch.global_batch_size == 96  # the trainers see 96


def test_an_auto_target_stays_within_its_bound_and_needs_the_study(tmp_path):
    explore = read_explore(study_file(tmp_path, critical=600.0, recommended=1000))
    document = plan(config_from_text(AUTO), explore=explore)
    assert document.config.batch.global_batch_size == 256  # max_global_batch_size
    assert any("at most max_global_batch_size 256" in n for n in document.notes)
    no_study = read_explore(explore_file(tmp_path, micro=16))
    with pytest.raises(
        BatchpilotError, match=r"batch\.global_batch_size: is auto, which takes the target from"
    ):
        plan(config_from_text(AUTO), explore=no_study)


def test_an_auto_target_from_a_bound_on_the_critical_batch_scales_no_lr(tmp_path):
    """A study whose estimate came out below its smallest batch gives a bound (critical batch at most 16), not
    a number (#34): auto takes the recommended smallest batch's nearest accepted size, and no LR scaling, since
    whether the target is within twice an unmeasured critical batch is unknown."""
    path = study_file(tmp_path, critical=0.0, recommended=16)
    data = json.loads(path.read_text())
    data["noise_scale"].update(critical_batch_size=None, critical_batch_at_most=16, lr_scaling="none")
    path.write_text(json.dumps(data))
    document = plan(config_from_text(AUTO), explore=read_explore(path))
    assert document.config.batch.global_batch_size == 32  # the ramp starts at 16: the nearest target above
    assert document.config.train.lr_scaling == "none"
    assert any(
        "critical batch at most 16 samples (not measurable below it), recommended 16" in n
        for n in document.notes
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("  max_global_batch_size: 256\n", ""), r"set both \(auto and a bound\) or neither"),
        (
            ("global_batch_size: auto\n", "global_batch_size: 64\n"),
            r"set both \(auto and a bound\) or neither",
        ),
    ],
)
def test_an_auto_target_needs_a_bound(edit, message):
    from batchpilot.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        config_from_text(AUTO.replace(*edit))


def test_the_pipeline_of_an_auto_target_has_slots_and_takes_any_stage_count(tmp_path):
    """Compiled before the study: launch slots for the stages at the bound; the plan step resolves the
    target and the stage count follows from it."""
    from kfp.dsl import Artifact, Markdown

    from batchpilot.kfp.components import plan as plan_component

    config = config_from_text(AUTO)
    assert pipeline_launch_names(config)[0] == "launch-0"
    assert len(pipeline_launch_names(config)) == expected_stage_count(config) == 16
    study_file(tmp_path, critical=90.0, recommended=100)
    from kfp.dsl import Input  # noqa: F401  (the component takes an artifact with a .path)

    text = plan_component(
        config_yaml=AUTO, micro_batch_size=0, total_samples=0, expected_num_stages=0, run_dir="",
        plan_file=Artifact(uri=str(tmp_path / "plan_file")), plan_table=Markdown(uri=str(tmp_path / "plan.md")),
        explore_dir=Artifact(uri=str(tmp_path)), num_launch_slots=16,
    )  # fmt: skip
    assert parse_run_document(text).config.batch.global_batch_size == 96
