"""Batch trials through the whole local pipeline (#25): `batchpilot run --local` on a tiny config whose target is
`auto` from the trials: the warm-up, two branches (batches 16 and 32) side by side under kfp.local's
parallel-for, the decision, then the run on the decided plan; the report shows the branches' losses."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from batchpilot.plan.rundoc import read_run_document
from batchpilot.planning.trials import TrialsOutcome
from batchpilot.planning.units import format_loss
from batchpilot.runstate import read_metrics
from helpers import run_batchpilot, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trials_run(demo_data_uri, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("trials-e2e")
    config = tiny_config(data_uri=demo_data_uri, checkpoint_uri=f"file://{root}/unused")
    config["batch"].pop("schedule")
    config["batch"].update(
        global_batch_size="auto", max_global_batch_size=64, auto_from="trials",
        rampup={"start": 16, "increment": 16, "samples": 960},
    )  # fmt: skip
    config["train"]["eval_samples"] = 32
    config["explore"] = {"study": False}  # no explore task: the trials set the target
    config["trials"] = {
        "enabled": True, "tokens": 256 * 32, "evaluations": 2, "warmup_samples": 192, "batch_sizes": [16, 32],
        "lr_multipliers": [1.0], "tolerance": 0.1, "parallelism": 2, "budget_fraction": 0.5,
    }  # fmt: skip
    path, output = root / "config.yaml", root / "run"
    path.write_text(yaml.safe_dump(config))
    result = run_batchpilot("run", "--local", "--config", str(path), "--out", str(output), timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return output, result


def test_the_run_trains_the_target_the_trials_decided_and_records_them_in_its_plan(trials_run):
    output, _ = trials_run
    document = read_run_document(output / "plan.json")
    outcome = document.trials_outcome
    assert outcome is not None
    assert [(r.global_batch_size, r.status) for r in outcome.results] == [(16, "ok"), (32, "ok")]
    assert [[samples for samples, _ in r.curve] for r in outcome.results] == [[128, 256], [128, 256]]
    chosen = outcome.decision.critical_batch
    assert document.plan.stages[-1].global_batch_size == chosen  # batch.auto_from: trials
    assert any(
        f"batch.global_batch_size: auto -> {chosen} from the trials" in note for note in document.notes
    )
    # trials.json keeps the same outcome; the run's own steps are those of the decided plan, from sample 0.
    record = json.loads((output / "trials.json").read_text())
    assert TrialsOutcome.from_dict(record["outcome"]) == outcome
    steps = read_metrics(output / "metrics.jsonl")
    assert steps[0]["consumed_samples"] == 16
    assert steps[-1]["global_batch_size"] == chosen
    assert steps[-1]["consumed_samples"] == document.plan.trained_samples
    # The branches trained from copies of the warm-up under ckpt/trials/, never in the run's checkpoints.
    assert {p.name for p in (output / "ckpt" / "trials").iterdir()} == {
        "warmup",
        "trial-0-b16-lr1",
        "trial-1-b32-lr1",
    }


def test_the_branches_run_side_by_side(trials_run):
    """Both branches' trainers are launched before either branch's task writes its output (the lines each
    branch's own executor process writes into pipeline.log). kfp.local's own "Task ... finished" lines are
    not used: its per-task logger context swaps the root logger's handlers, which is not thread-safe, and a
    parallel iteration's line can go missing. (The few training steps take a fraction of a second after
    seconds of process start, so the steps themselves need not overlap.)"""
    output, _ = trials_run
    text = re.sub(r"\x1b\[[0-9;]*m", "", (output / "pipeline.log").read_text())
    pattern = r"launched tiny-trial-\d|for-loop-\d+-iteration-\d+/trial-branch/executor_output\.json\."
    events = [
        "launch" if match.group(0).startswith("launched") else "done" for match in re.finditer(pattern, text)
    ]
    assert events == ["launch", "launch", "done", "done"], events


def test_the_report_shows_each_branch_loss_and_the_choice(trials_run):
    output, _ = trials_run
    outcome = read_run_document(output / "plan.json").trials_outcome
    assert outcome is not None
    text = " ".join(re.sub(r"<[^>]+>", " ", (output / "report.html").read_text()).split())
    for result, name in zip(outcome.results, ["trial-0-b16-lr1", "trial-1-b32-lr1"], strict=True):
        assert result.final_loss is not None
        assert re.search(
            rf"{name} {result.global_batch_size} 1 0\.001 1 ok {format_loss(result.final_loss)} ", text
        )
    assert f"Chosen: global batch {outcome.decision.critical_batch} with LR x 1 (0.001)" in text
