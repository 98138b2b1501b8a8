"""The whole pipeline locally (kfp.local), as `batchpilot run --local` runs it: the main job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchpilot.runstate import read_metrics
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
    from batchpilot.plan.rundoc import read_run_document
    from batchpilot.planning.launches import launches

    plan = read_run_document(plan_json).plan
    return [(g.name, list(range(g.first_stage, g.last_stage + 1))) for g in launches(plan)]


def demo_config(data_uri: str) -> dict:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = data_uri
    return config


DEMO_TOTAL_SAMPLES = 8192
"""The demo's run here ends at 8,192 samples instead of its 16,384: the same explore, ramp-up stages, launches
and 2-node final stage (64 of its 192 steps; the ramp ends at 4,096), about a third less training on CI's 2
cores. The learning rate decays over the shorter run, so the losses are not those of the demo's own run."""


@pytest.fixture(scope="module")
def demo_run(demo_data_uri, tmp_path_factory):
    output = tmp_path_factory.mktemp("e2e") / "run"
    config = demo_config(demo_data_uri)
    config["train"]["total_samples"] = DEMO_TOTAL_SAMPLES
    result = run_pipeline(config, output)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return output, result


def test_demo_goes_through_explore_plan_and_one_launch_per_node_count(demo_run):
    output, result = demo_run
    explore = json.loads((output / "explore" / "explore.json").read_text())
    plan = json.loads((output / "plan.json").read_text())
    recommendation = explore["recommendation"]
    # The demo's explore: its fastest measured size (or a larger one as fast within the timing noise) that
    # splits the 16-sample first stage is 16, the only micro batch that leaves the ramp-up stages on one node
    # and the final one on two.
    assert (recommendation["plan_compatible_micro_batch_size"] or recommendation["micro_batch_size"]) == 16
    assert plan["micro_batch_size"] == 16
    stages = plan["stages"]
    assert [(s["global_batch_size"], s["num_nodes"], s["start_sample"], s["end_sample"]) for s in stages] == [
        (16, 1, 0, 1376),
        (32, 1, 1376, 2752),
        (48, 1, 2752, 4096),
        (64, 2, 4096, DEMO_TOTAL_SAMPLES),
    ]
    assert [s["is_final"] for s in stages] == [False, False, False, True]
    # Launches follow node counts: consecutive stages on one node count are one torchx job.
    launches = launches_of(output / "plan.json")
    assert launches == [("stages-0-2", [0, 1, 2]), ("final", [3])]
    launched = [line.split("launched demo-", 1)[1].split(":")[0] for line in result.stdout.splitlines()
                if "launched demo-" in line]  # fmt: skip
    assert launched == ["canary", "stages-0-2", "final"]  # the canary first, on 2 nodes
    records = read_metrics(output / "metrics.jsonl")
    final_steps = (DEMO_TOTAL_SAMPLES - 4096) // 64
    assert len(records) == 86 + 43 + 28 + final_steps  # each stage's samples over its global batch
    # Every step of every stage once, in order, within and across launches: nothing lost or repeated.
    expected = [
        consumed
        for s in stages
        for consumed in range(
            s["start_sample"] + s["global_batch_size"], s["end_sample"] + 1, s["global_batch_size"]
        )
    ]
    assert [r["consumed_samples"] for r in records] == expected
    assert [(r["stage"], r["world_size"]) for r in records] == [
        *[(0, 1)] * 86,
        *[(1, 1)] * 43,
        *[(2, 1)] * 28,
        *[(3, 2)] * final_steps,
    ]
    assert plan["trained_samples"] == DEMO_TOTAL_SAMPLES
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
    assert any("launch-0 is stages-0-2: stage-0, stage-1, stage-2 on 1 node(s)" in line for line in console)
    assert any("launch-1 is final: final on 2 node(s)" in line for line in console), console
    assert any("launch-3: not used (the plan has 2 launch(es))" in line for line in console), console
    # the summary names the launches
    steps = 86 + 43 + 28 + (DEMO_TOTAL_SAMPLES - 4096) // 64
    assert f"2 launch(es) stages-0-2 (16@1n, 32@1n, 48@1n) -> final (64@2n), {steps} steps" in result.stdout
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


def test_demo_goodput_ledger_accounts_for_every_second_and_every_launch(demo_run):
    """The goodput ledger (#36): the pool tasks, the train tasks and the trainers recorded their events; each
    launch of the plan trained (no launch lost), the categories add up to the wall time within 1%, the run's
    node-hours are those of the nodes up, and the report shows the goodput and a bar per launch."""
    from batchpilot.planning.goodput import build_ledger
    from batchpilot.runstate import read_events

    output, _ = demo_run
    events = read_events(f"file://{output / 'ckpt'}")
    names = [name for name, _ in launches_of(output / "plan.json")]
    assert [e["launch"] for e in events if e["kind"] == "launch"] == names
    assert len([e for e in events if e["kind"] == "trainer"]) == len(names)
    assert [(e["before"], e["after"]) for e in events if e["kind"] == "pool"][-1][1] == 0  # the scale-down
    end = max(e.get("ended_s", e.get("ready_s", 0.0)) for e in events)
    ledger = build_ledger(events, now_s=end)
    assert ledger is not None and set(ledger.launches) == set(names)
    assert "failed" not in ledger.categories
    total = sum(share.wall_s for share in ledger.categories.values())
    assert abs(total - ledger.wall_s) <= 0.01 * ledger.wall_s
    trained_s = sum(r["step_time_s"] for r in read_metrics(output / "metrics.jsonl"))
    assert ledger.categories["training_steps"].wall_s >= trained_s  # the steps and what the loop did between
    assert 0 < ledger.goodput < 1
    report = (output / "report.html").read_text()
    assert "<div class='label'>goodput</div>" in report and "<h2>Where the node-hours went</h2>" in report
    assert all(f"<td>{name}</td>" in report for name in names)
    kept = json.loads((output / "plan.json").read_text())[
        "goodput"
    ]  # the run's record, kept after the report
    assert set(kept["launches"]) == set(names) and 0 < kept["goodput"] < 1
    # and a record per launch at the end of metrics.jsonl (the run folder's and the one beside the checkpoints)
    from batchpilot.runstate import METRICS_OBJECT, parse_launch_records

    for text in ((output / METRICS_OBJECT).read_text(), (output / "ckpt" / METRICS_OBJECT).read_text()):
        lines = parse_launch_records(text)
        assert [r["launch"] for r in lines] == names
        assert all(0 < r["goodput"] <= 1 and r["node_hours"] > 0 for r in lines)
    assert (
        abs(sum(c["wall_s"] for c in kept["categories"].values()) - kept["wall_s"]) <= 0.01 * kept["wall_s"]
    )


def test_demo_asks_for_the_final_launchs_second_node_while_stages_0_2_train(demo_run):
    """cluster.capacity_ahead (#36): stages-0-2 trains on 1 node and final on 2; the pool task beside
    stages-0-2's train task grew the pool to 2 before stages-0-2's last step, so final's own resize found both
    nodes there, and the second node's time beside stages-0-2 is early capacity in the ledger."""
    from batchpilot.planning.goodput import build_ledger
    from batchpilot.runstate import read_events

    output, result = demo_run
    events = read_events(f"file://{output / 'ckpt'}")
    first = next(e for e in events if e["kind"] == "launch" and e["launch"] == "stages-0-2")
    trainer = next(e for e in events if e["kind"] == "trainer" and e["stages"] == [0, 2])
    early = [e for e in events if e["kind"] == "pool" and e.get("early")]
    assert [(e["before"], e["after"]) for e in early] == [(1, 2)]
    assert early[0]["ready_s"] <= trainer["last_step_s"]  # ready before the launch's last step ended
    final_resize = next(e for e in events if e["kind"] == "pool" and e["requested_s"] > first["ended_s"])
    assert (final_resize["before"], final_resize["after"]) == (2, 2)  # nothing left to wait for
    assert "launch-0: next launch's nodes (1/4)" in result.stdout
    end = max(e.get("ended_s", e.get("ready_s", 0.0)) for e in events)
    ledger = build_ledger(events, now_s=end)
    assert ledger is not None and ledger.launches["stages-0-2"]["early_capacity"].node_hours > 0


RUN_LOCAL_PIPELINE = (
    "import sys; from pathlib import Path; from batchpilot.config import load_config; "
    "from batchpilot.kfp.local import local_run_config, run_pipeline; out = Path(sys.argv[2]); out.mkdir(); "
    "config, _ = local_run_config(load_config(sys.argv[1]), output=out); run_pipeline(config, output=out)"
)
"""The local pipeline without `batchpilot run`'s checks before it starts (a stage that fails where no check
could foresee it, as on a cluster)."""


def test_a_failing_stage_still_scales_the_pool_down(demo_data_uri, tmp_path):
    """The final stage needs 3 local nodes on a machine limited to 2 CPUs: its resize fails after stages 0
    and 1 trained, and the exit handler scales the pool down. (`batchpilot run` refuses this config before
    anything starts, tests/bad_input/test_bad_run.py; the pipeline itself is run here, as a cluster runs it,
    where a resize can fail for reasons no check foresees.)"""
    config = demo_config(demo_data_uri)
    config["cluster"]["max_nodes"] = 3
    config["batch"] = {"global_batch_size": 48, "micro_batch_size": 16, "schedule": "0:16 64:32 128:48"}
    config["train"]["total_samples"] = 256
    config["train"]["warmup_samples"] = 0
    # A fixed micro batch and no study: the pipeline has no explore task (and the plan no explore input).
    config["explore"] = {"study": False}
    output = tmp_path / "run"
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-c", RUN_LOCAL_PIPELINE, str(config_path), str(output)],
        capture_output=True, text=True, timeout=1200, check=False,
        preexec_fn=lambda: os.sched_setaffinity(0, {0, 1}),
    )  # fmt: skip
    assert result.returncode != 0, result.stdout[-4000:]
    failed = re.sub(r"\x1b\[[0-9;]*m", "", result.stderr)
    assert "Inner task failed: 'resize-pool' inside 'final'" in failed, failed[-3000:]
    assert not (output / "explore").exists()
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
    ramp at max_global_batch_size (16, 32, ..., 128: 8 slots); the plan step takes the study's target, and
    the stages train to it. A fixed micro batch and the seeded study make the study's answer one number:
    a critical batch at most one micro batch (its estimate came out below it: not measured, a bound), so it
    recommends the smallest batch micro 16 makes, 16, and auto
    takes the nearest size the ramp [16, 16, 1024] accepts above its start: 32 (on 2 nodes)."""
    config = demo_config(demo_data_uri)
    config["batch"].update(global_batch_size="auto", max_global_batch_size=128, micro_batch_size=16)
    config["batch"]["rampup"]["samples"] = 1024
    config["train"]["total_samples"] = 2048
    output = tmp_path / "run"
    result = run_pipeline(config, output)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    study = json.loads((output / "explore" / "explore.json").read_text())["noise_scale"]
    # B_simple came out below the smallest batch measured (16): not a measurement, a bound (#34).
    assert study["critical_batch_size"] is None and study["critical_batch_at_most"] == 16
    assert study["recommended_global_batch_size"] == 16
    document = json.loads((output / "plan.json").read_text())
    assert document["config"]["batch"]["global_batch_size"] == 32
    assert document["config"]["train"]["lr_scaling"] == "none"  # 32 is above twice the critical batch
    notes = [n for n in document["run_notes"] if n.startswith("batch.global_batch_size: auto -> 32 (")]
    assert len(notes) == 1 and "recommended 16; " in notes[0], document["run_notes"]
    stages = document["stages"]
    assert [(s["global_batch_size"], s["num_nodes"], s["start_sample"], s["end_sample"]) for s in stages] == [
        (16, 1, 0, 1024),
        (32, 2, 1024, 2048),
    ]
    assert "launch-7: not used (the plan has 2 launch(es))" in result.stdout
    metrics = read_metrics(output / "metrics.jsonl")
    assert [(r["consumed_samples"], r["global_batch_size"], r["world_size"]) for r in metrics] == [
        *((consumed, 16, 1) for consumed in range(16, 1024 + 1, 16)),
        *((consumed, 32, 2) for consumed in range(1024 + 32, 2048 + 1, 32)),
    ]


def test_a_launch_short_of_nodes_trains_on_the_nodes_it_got(demo_data_uri, tmp_path):
    """#21: the local pool grants 1 node (cluster.local_capacity_nodes) and fewer_nodes is allowed: the
    2-node final stage trains on 1 node at its planned global batch, every sample once."""
    config = demo_config(demo_data_uri)
    config["batch"]["micro_batch_size"] = 16
    # The demo's stages (16, 32, 48 on 1 node, then 64 on 2) over 1,152 ramp-up samples instead of 4,096, and
    # 8 final steps instead of 32: what is checked is the final launch's shortfall, not the stages' length.
    config["batch"]["rampup"]["samples"] = 1152
    config["explore"] = {"study": False}
    config["train"]["total_samples"] = 1664
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
    assert records[-1]["consumed_samples"] == document["trained_samples"] == 1664
    report = (output / "report.html").read_text()
    assert "Capacity: launches on fewer nodes than planned" in report
    assert "1 stage(s) on fewer nodes than planned" in report
    assert "final (64@1n of 2 planned)" in result.stdout
