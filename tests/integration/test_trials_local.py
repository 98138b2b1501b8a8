"""Batch trials on this machine: `batchpilot trials` trains a warm-up and three branches (batches 16, 32, 64)
from its checkpoint with real torchx launches on a real shard set, writes trials.json and the decided plan;
a branch whose trainer runs out of memory is reported FAILED and left out of the decision; a branch trained
again reaches the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.plan.rundoc import read_run_document
from batchpilot.planning.trials import BranchResult, TrialsOutcome
from batchpilot.runstate import load_metrics
from batchpilot.train.step import INJECT_OOM_ENV
from batchpilot.workflow.trial_runs import branch_uri, decide_trials, run_branch, warmup_uri
from helpers import run_batchpilot, tiny_config, write_plan

pytestmark = pytest.mark.slow

BATCHES = [16, 32, 64]


@pytest.fixture(scope="module")
def ran(tmp_path_factory, demo_data_uri) -> tuple[Path, Path, object]:
    """A plan with trials (a warm-up of 192 samples at 16, then 256 samples per branch, evaluated after 128
    and 256: 192 is no multiple of 128) and the trials run through the command: (plan.json, --out folder,
    the completed process)."""
    root = tmp_path_factory.mktemp("trials")
    config = tiny_config(data_uri=demo_data_uri, checkpoint_uri=f"file://{root}/ckpt")
    config["train"]["eval_samples"] = 32
    config["trials"] = {
        "enabled": True, "tokens": 256 * 32, "evaluations": 2, "warmup_samples": 192, "batch_sizes": BATCHES,
        "lr_multipliers": [1.0], "budget_fraction": 0.5,
    }  # fmt: skip
    plan = Path(write_plan(root / "plan", config))
    out = root / "out"
    result = run_batchpilot("trials", "--plan", str(plan), "--out", str(out), "--parallel", "2", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return plan, out, result


def test_every_branch_trains_the_same_samples_and_the_decision_is_written(ran):
    plan_path, out, result = ran
    document = read_run_document(plan_path)
    trials = document.trials
    assert trials is not None
    assert (trials.warmup_samples, trials.branch_samples, trials.eval_every_samples) == (192, 256, 128)
    curves = []
    for branch in trials.branches:
        records = load_metrics(branch_uri(document.config, branch))
        # From the warm-up's 192 samples to 448, in steps of the branch's batch, evaluated at the same counts
        # (every 64 = gcd(192, 128), so that 192 + 128 and 192 + 256 are among them).
        batch = branch.global_batch_size
        assert [r["consumed_samples"] for r in records] == list(range(192 + batch, 449, batch))
        assert {r["global_batch_size"] for r in records} == {branch.global_batch_size}
        evaluated = {r["consumed_samples"]: r["val_loss"] for r in records if r["val_loss"] is not None}
        assert sorted(evaluated) == [256, 320, 384, 448]
        curves.append(((128, evaluated[320]), (256, evaluated[448])))
        assert {r["lr"] for r in records} == {branch.lr}
        assert f"> {branch.name}: batch {branch.global_batch_size}" in result.stdout
    # The warm-up trained [0, 128) at the start batch into its own prefix, not the run's.
    assert [r["consumed_samples"] for r in load_metrics(warmup_uri(document.config))] == list(
        range(16, 193, 16)
    )
    assert not (Path(document.config.train.checkpoint_uri.removeprefix("file://")) / "latest").exists()

    record = json.loads((out / "trials.json").read_text())
    outcome = TrialsOutcome.from_dict(record["outcome"])
    assert [r.global_batch_size for r in outcome.results] == BATCHES
    assert [(r.status, r.curve) for r in outcome.results] == [("ok", curve) for curve in curves]
    decided = read_run_document(out / "plan.json")
    assert decided.trials_outcome == outcome
    assert decided.trials == trials
    assert f"decision: {outcome.decision.reason}" in result.stdout
    assert outcome.decision.best == {r.global_batch_size: (1.0, r.curve[-1][1]) for r in outcome.results}


def test_a_branch_that_runs_out_of_memory_is_reported_failed_and_left_out(ran, monkeypatch):
    plan_path, out, _ = ran
    document = read_run_document(plan_path)
    ok = TrialsOutcome.from_dict(json.loads((out / "trials.json").read_text())["outcome"]).results
    # Every micro batch runs out of memory on this "device": halved down to 1, which cannot be halved.
    monkeypatch.setenv(INJECT_OOM_ENV, "0")
    failed = run_branch(document, index=2, work_dir=out / "failing")
    assert failed.status == "failed"
    assert failed.reason.startswith("batch.micro_batch_size: out of memory at micro batch 1 in final")
    decided = decide_trials(document, [ok[0], ok[1], failed])
    assert decided.trials_outcome is not None
    decision = decided.trials_outcome.decision
    assert decision.excluded == (f"batch 64 x LR 1: {failed.reason}",)
    assert decision.best == {16: (1.0, ok[0].curve[-1][1]), 32: (1.0, ok[1].curve[-1][1])}


def test_a_branch_trained_again_reaches_the_same_losses(ran):
    plan_path, out, _ = ran
    document = read_run_document(plan_path)
    first = TrialsOutcome.from_dict(json.loads((out / "trials.json").read_text())["outcome"]).results[0]
    again = run_branch(document, index=0, work_dir=out / "again")
    assert again == first
    assert isinstance(again, BranchResult) and len(again.curve) == 2


def test_the_command_refuses_a_plan_without_trials(tmp_path, demo_data_uri):
    plan = write_plan(
        tmp_path / "plan", tiny_config(data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/c")
    )
    result = run_batchpilot("trials", "--plan", plan, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "plans no batch trials" in result.stderr
    assert yaml.safe_load(Path(plan).read_text())["config"]["trials"]["enabled"] is False
