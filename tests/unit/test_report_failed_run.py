"""The report of a failed run (`report_failed_run`): from whatever the run folder holds, report.html says the run
failed, why, where it stopped and what ran; a folder with nothing to report from, or only half-written files,
gets one warning line and no page, never an error that would hide the run's own."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from batchpilot.config import config_from_text
from batchpilot.workflow.plan import plan
from batchpilot.workflow.report import report_failed_run
from helpers import REPO
from report_page import card, text_of
from report_samples import sample_canary, sample_explore, sample_records

FAILURE = "batchpilot: error: the pipeline failed in task train-stage-1; the full log is pipeline.log"


def run_folder(tmp_path: Path) -> Path:
    """A run folder as `batchpilot run` leaves it when stage-1 failed: plan.json (the demo plan at micro batch
    16, its checkpoints in run/ckpt), explore/explore.json, canary.json and the metrics beside the checkpoints
    as of the last checkpoint (90 steps), and the trainer's own metrics.jsonl 10 steps further, its last line
    half-written."""
    run = tmp_path / "run"
    text = (REPO / "configs" / "demo.yaml").read_text().replace("file://runs/demo/ckpt", f"file://{run}/ckpt")
    document = plan(config_from_text(text), micro_batch_size=16, announce=False)
    records = sample_records(document)[:100]  # stage-0's 86 steps and 14 of stage-1's
    (run / "ckpt" / "canary").mkdir(parents=True)
    (run / "explore").mkdir()
    (run / "plan.json").write_text(document.to_json())
    (run / "explore" / "explore.json").write_text(json.dumps(sample_explore()))
    (run / "ckpt" / "canary" / "canary.json").write_text(json.dumps(sample_canary()))
    (run / "canary").mkdir()  # the local canary's spec: the config it checked (cluster.canary.run_canary_job)
    (run / "canary" / "canary-spec.json").write_text(
        json.dumps({"config": json.loads(document.to_json())["config"]})
    )
    (run / "ckpt" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:90]))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 101, "consu'
    )
    return run


def what_ran(page: str) -> list[str]:
    block = page.split("<b>What ran:</b>", 1)[1].split("</ul>", 1)[0]
    return [text_of(item).strip() for item in block.split("<li>")[1:]]


def test_a_failed_run_with_a_plan_says_why_where_it_stopped_and_what_ran(tmp_path):
    run = run_folder(tmp_path)
    assert report_failed_run(run, failure=FAILURE) == run / "report.html"
    page = (run / "report.html").read_text()
    text = " ".join(text_of(page).split())
    assert "batchpilot run: demo failed last record" in text
    assert f"Why it failed: {FAILURE}" in text
    # The trainer's own metrics reached step 100: 86 steps of 16 samples, then 14 of 32.
    assert "Where it stopped: in stage-1 after step 100, at sample 1,824 of 16,384 planned" in text
    assert what_ran(page) == [
        "canary: 2 node(s), gloo all-reduce 1.09 GB/s bus bandwidth; passed",
        "explore: 10 probe(s), recommended micro_batch_size=48 (2.00x the base micro batch's tokens/s)",
        "plan: 4 stage(s) in 2 launch(es), 349 optimizer steps, 16,384 samples",
        "stage-0: 86 step(s) to sample 1,376, last loss 4.150",
        "stage-1: 14 step(s) to sample 1,824, last loss 4.010",
        "not reached: stage-2, final",
    ]
    assert "<h2>Launches and stages: plan and actuals</h2>" in page and "<h2>Exploration</h2>" in page
    # stage-0 and stage-1 trained on their 1 node; the final stage's 2 were never asked for: no shortfall
    assert card(page, "nodes") == ("2", "every stage that trained on its planned nodes")
    body = page.split("<body>", 1)[1]  # one self-contained page, as a completed run's
    assert "<script" not in body and "http" not in body and "<link" not in body


def test_a_run_that_failed_before_its_plan_reports_what_ran(tmp_path):
    run = run_folder(tmp_path)
    (run / "plan.json").unlink()
    (run / "metrics.jsonl").unlink()
    (run / "ckpt" / "metrics.jsonl").unlink()
    assert report_failed_run(run, failure="the plan step failed") == run / "report.html"
    page = (run / "report.html").read_text()
    text = " ".join(text_of(page).split())
    assert "failed" in text and "Why it failed: the plan step failed" in text
    assert "Where it stopped: before the first training step, after explore" in text
    assert what_ran(page) == [  # the canary.json found through the canary's spec
        "canary: 2 node(s), gloo all-reduce 1.09 GB/s bus bandwidth; passed",
        "explore: 10 probe(s), recommended micro_batch_size=48 (2.00x the base micro batch's tokens/s)",
        "plan: no plan.json (planning did not finish)",
        "training: no step recorded",
    ]
    assert "<h2>Exploration</h2>" in page


def test_an_empty_run_folder_gets_no_report_and_one_warning(tmp_path, batchpilot_log):
    batchpilot_log.clear()
    assert report_failed_run(tmp_path, failure=FAILURE) is None
    warnings = [r for r in batchpilot_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and len(warnings[0].getMessage().splitlines()) == 1
    assert "nothing to report" in warnings[0].getMessage()
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("missing_run_dir", [False, True])
def test_half_written_files_never_raise(tmp_path, batchpilot_log, missing_run_dir):
    run = tmp_path / "run"
    if not missing_run_dir:
        (run / "explore").mkdir(parents=True)
        (run / "plan.json").write_text('{"format_version": 1, "con')
        (run / "explore" / "explore.json").write_text('{"probes": [')
        (run / "metrics.jsonl").write_text('{"step": 1, "consumed')
    batchpilot_log.clear()
    assert report_failed_run(run, failure=FAILURE) is None
    assert len([r for r in batchpilot_log.records if r.levelno >= logging.WARNING]) == 1


def test_a_report_that_cannot_be_written_is_one_warning_not_an_error(tmp_path, batchpilot_log):
    run = run_folder(tmp_path)
    (run / "report.html").mkdir()  # a folder where the page should go
    batchpilot_log.clear()
    assert report_failed_run(run, failure=FAILURE) is None
    warnings = [r.getMessage() for r in batchpilot_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"report: no report of the failed run in {run}: ")
