"""The whole pipeline locally (kfp.local), as `batchpilot run --local` runs it: the main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchpilot.train.metrics import read_metrics
from helpers import REPO

pytestmark = pytest.mark.slow


def run_pipeline(
    config: dict, output: Path, *args: str, cpus: int | None = None
) -> subprocess.CompletedProcess:
    config_path = output.parent / f"{output.name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable,
        "-m",
        "batchpilot",
        "run",
        "--local",
        "--config",
        str(config_path),
        "--output",
        str(output),
    ]
    preexec = (lambda: os.sched_setaffinity(0, set(range(cpus)))) if cpus else None
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=1200, check=False, preexec_fn=preexec
    )


def launches_of(plan_json: Path) -> list[tuple[str, list[int]]]:
    """(launch name, its stage indices) of a run document's plan."""
    from batchpilot.planning.launches import launches
    from batchpilot.rundoc import read_run_document

    plan = read_run_document(plan_json).plan
    return [(g.name, list(range(g.first_stage, g.last_stage + 1))) for g in launches(plan)]


def demo_config(data_uri: str) -> dict:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = data_uri
    return config


@pytest.fixture(scope="module")
def demo_run(demo_data_uri, tmp_path_factory):
    output = tmp_path_factory.mktemp("e2e") / "run"
    result = run_pipeline(demo_config(demo_data_uri), output)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return output, result


def test_demo_goes_through_explore_plan_and_one_launch_per_node_count(demo_run):
    output, result = demo_run
    explore = json.loads((output / "explore" / "explore.json").read_text())
    plan = json.loads((output / "plan.json").read_text())
    recommendation = explore["recommendation"]
    # The fastest measured size, or the fastest one that fits every stage when that one does not.
    assert plan["micro_batch_size"] == (
        recommendation["plan_compatible_micro_batch_size"] or recommendation["micro_batch_size"]
    )
    stages = plan["stages"]
    assert len([s for s in stages if not s["is_final"]]) >= 3 and stages[-1]["is_final"]
    assert len({s["num_nodes"] for s in stages}) >= 2, stages
    # Launches follow node counts: consecutive stages on one node count are one torchx job.
    launches = launches_of(output / "plan.json")
    if plan["micro_batch_size"] == 16:  # the demo's usual explore result: 16@1n, 32@1n, 48@1n, 64@2n
        assert [(s["global_batch_size"], s["num_nodes"]) for s in stages] == [
            (16, 1),
            (32, 1),
            (48, 1),
            (64, 2),
        ]
        assert launches == [("stages-0-2", [0, 1, 2]), ("final", [3])]
    launched = [line.split("launched demo-", 1)[1].split(":")[0] for line in result.stdout.splitlines()
                if "launched demo-" in line]  # fmt: skip
    assert launched == ["canary", *(name for name, _ in launches)]  # the canary first, on 2 nodes
    records = read_metrics(output / "metrics.jsonl")
    assert [r["stage"] for r in records] == sorted(r["stage"] for r in records)
    # Every step of every stage once, in order, within and across launches: nothing lost or repeated.
    expected = [
        consumed
        for s in stages
        for consumed in range(
            s["start_sample"] + s["global_batch_size"], s["end_sample"] + 1, s["global_batch_size"]
        )
    ]
    assert [r["consumed_samples"] for r in records] == expected
    assert {r["stage"] for r in records} == {s["index"] for s in stages}
    assert {(r["stage"], r["world_size"]) for r in records} == {(s["index"], s["num_nodes"]) for s in stages}
    assert records[-1]["consumed_samples"] == plan["trained_samples"]
    first, last = sum(r["loss"] for r in records[:5]) / 5, sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert "[batchpilot] done in" in result.stdout


def test_demo_console_is_short_and_the_full_log_is_in_the_run_folder(demo_run):
    output, result = demo_run
    console = result.stdout.splitlines()
    assert len(console) < 150, len(console)
    assert "KFP Executor" not in result.stdout and '"outputFile"' not in result.stdout  # no executor JSON
    assert "Warning" not in result.stdout + result.stderr
    # An explored micro batch: the pipeline has a launch slot per stage; the plan's launches take the first.
    for task in (
        "> canary",
        "> explore",
        "> plan",
        "> launch-0: train (1/4)",
        "done launch-3: train (4/4)",
        "> scale-down",
    ):
        assert any(line.startswith(task) or line.strip().startswith(task) for line in console), task
    assert any("launch-0 is stages-0-" in line for line in console), console
    assert any("launch-3: not used (the plan has" in line for line in console), console
    assert "launch(es) stages-0-" in result.stdout  # the summary names the launches
    assert any(" step " in line and "| loss " in line for line in console)  # the stages' training lines
    log = (output / "pipeline.log").read_text()
    assert "KFP Executor" in log and '"outputFile"' in log  # everything else went to the log


def test_demo_leaves_report_checkpoints_and_a_scaled_down_pool(demo_run):
    output, _ = demo_run
    report = (output / "report.html").read_text()
    assert (
        "Training and validation loss" in report
        and "Batch-size ramp" in report
        and "data:image/png;base64," in report
    )
    # The validation loss and the cost estimate (#13): in the summary (also the KFP metrics) and the plan.
    assert "<div class='label'>validation loss</div>" in report and "estimated 0." in report
    assert "node-hours" in report and "parallelism ddp" in report
    # The canary's figures (canary.json beside the checkpoints): 2 local nodes, a gloo all-reduce.
    assert "<h2>Canary</h2><p>2 node(s) x 1 process(es), gloo all-reduce of 4 MiB: bus bandwidth " in report
    assert (output / "ckpt" / "canary" / "canary.json").exists()
    assert "| final |" in (output / "plan.md").read_text()
    assert (output / "ckpt" / "latest").exists()
    assert json.loads((output / "pool.json").read_text())["num_nodes"] == 0


def test_a_failing_stage_still_scales_the_pool_down(demo_data_uri, tmp_path):
    """The final stage needs 3 local nodes on a machine limited to 2 CPUs: its resize fails."""
    config = demo_config(demo_data_uri)
    config["cluster"]["max_nodes"] = 3
    config["batch"] = {"global_batch_size": 48, "micro_batch_size": 16, "schedule": "0:16 64:32 128:48"}
    config["train"]["total_samples"] = 256
    config["train"]["warmup_samples"] = 0
    # A fixed micro batch and no study: the pipeline has no explore task (and the plan no explore input).
    config["explore"] = {"study": False}
    output = tmp_path / "run"
    result = run_pipeline(config, output, cpus=2)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "> explore" not in result.stdout and not (output / "explore").exists()
    assert (
        "the pipeline failed" in result.stderr
        and f"the full log is {output / 'pipeline.log'}" in result.stderr
    )
    assert "FAILURE final: resize pool (3/3)" in result.stdout  # the failed task, named by its stage
    assert (
        "3 local node(s) x 1 process(es) = 3 processes, but this machine has 2 CPU(s)"
        in result.stdout + result.stderr
    )
    plan = json.loads((output / "plan.json").read_text())
    assert [s["num_nodes"] for s in plan["stages"]] == [1, 2, 3]
    assert json.loads((output / "pool.json").read_text())["num_nodes"] == 0  # the exit handler ran
    assert read_metrics(output / "ckpt" / "metrics.jsonl")[-1]["stage"] == 1  # stages 0 and 1 trained


def test_an_auto_target_is_taken_from_the_study_during_the_run(demo_data_uri, tmp_path):
    """`batch.global_batch_size: auto` (#13): the pipeline is compiled with a launch slot per stage of the
    ramp at max_global_batch_size; the plan step takes the study's target, and the stages train to it."""
    config = demo_config(demo_data_uri)
    config["batch"].update(global_batch_size="auto", max_global_batch_size=128)
    config["train"]["total_samples"] = 8192
    output = tmp_path / "run"
    result = run_pipeline(config, output)
    if result.returncode != 0:
        # The study can find the gradient noise unmeasurable on a tiny model; auto then refuses, one line.
        assert (
            "is auto, which takes the target from explore's gradient-noise study, but explore's study "
            "measured no noise scale" in result.stdout + result.stderr
        ), result.stdout[-4000:]
        return
    document = json.loads((output / "plan.json").read_text())
    target = document["config"]["batch"]["global_batch_size"]
    assert isinstance(target, int) and 16 < target <= 128 and target % 16 == 0
    assert any(
        note.startswith(f"batch.global_batch_size: auto -> {target} ") for note in document["run_notes"]
    )
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["global_batch_size"] == target
    assert [r["consumed_samples"] for r in metrics] == sorted({r["consumed_samples"] for r in metrics})


def test_a_launch_short_of_nodes_trains_on_the_nodes_it_got(demo_data_uri, tmp_path):
    """#21: the local pool grants 1 node (cluster.local_capacity_nodes) and fewer_nodes is allowed: the
    2-node final stage trains on 1 node at its planned global batch, every sample once."""
    config = demo_config(demo_data_uri)
    config["batch"]["micro_batch_size"] = 16
    config["explore"] = {"study": False}
    config["train"]["total_samples"] = 6144
    config["cluster"].update(local_capacity_nodes=1, fewer_nodes="allow")
    output = tmp_path / "run"
    result = run_pipeline(config, output)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    assert (
        "final: 1 of 2 planned node(s) ready after 0s (cluster.fewer_nodes: allow): training on 1 node(s) at the "
        "planned global batch" in result.stdout
    )
    document = json.loads((output / "plan.json").read_text())  # the run as it went
    stages = document["stages"]
    assert [(s["global_batch_size"], s["num_nodes"], s.get("planned_nodes")) for s in stages] == [
        (16, 1, None),
        (32, 1, None),
        (48, 1, None),
        (64, 1, 2),
    ]
    assert [
        (c["launch"], c["planned_nodes"], c["ready_nodes"], c["nodes"]) for c in document["capacity"]
    ] == [("final", 2, 1, 1)]
    records = read_metrics(output / "metrics.jsonl")
    expected = [
        consumed
        for s in stages
        for consumed in range(
            s["start_sample"] + s["global_batch_size"], s["end_sample"] + 1, s["global_batch_size"]
        )
    ]
    assert [r["consumed_samples"] for r in records] == expected  # nothing lost or repeated
    final = [r for r in records if r["stage"] == 3]
    assert {(r["world_size"], r["global_batch_size"], r["gradient_accumulation_steps"]) for r in final} == {
        (1, 64, 4)
    }
    assert records[-1]["consumed_samples"] == document["trained_samples"] == 6144
    report = (output / "report.html").read_text()
    assert "Capacity: launches on fewer nodes than planned" in report
    assert "1 stage(s) on fewer nodes than planned" in report
    assert "final (64@1n of 2 planned)" in result.stdout
