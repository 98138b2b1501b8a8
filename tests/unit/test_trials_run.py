"""The runs the batch trials derive from a plan (warm-up and branches), the checkpoint a branch starts from,
a failed launch's reason, and the plan made again with the decision (`batchpilot.workflow.trial_runs`)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.planning.trials import BranchResult, trial_run_names
from batchpilot.runstate import latest_checkpoint
from batchpilot.workflow.plan import plan
from batchpilot.workflow.trial_runs import (
    branch_config,
    copy_checkpoint,
    decide_trials,
    failure_reason,
    warmup_config,
)
from helpers import REPO, tiny_config, write_manifest


def document_of(tmp_path: Path, **batch: object):
    config = tiny_config(data_uri=write_manifest(tmp_path / "data"), checkpoint_uri="file:///ckpt/run")
    config["train"].update(lr_scaling="sqrt", lr_reference_batch=32)
    config["batch"].update(batch)
    config["trials"] = {
        "enabled": True, "tokens": 256 * 32, "evaluations": 2, "warmup_samples": 192, "batch_sizes": [16, 32, 64],
        "lr_multipliers": [0.5, 2.0], "budget_fraction": 0.75,
    }  # fmt: skip
    return plan(parse_config(config), announce=False)


def test_the_warm_up_trains_the_start_batch_to_its_end_under_the_runs_lr_rule(tmp_path):
    document = document_of(tmp_path)
    warmup = warmup_config(document)
    assert warmup.name == "tiny-trials"
    assert (warmup.batch.schedule, warmup.batch.global_batch_size, warmup.total_samples) == ("0:16", 16, 192)
    assert (warmup.train.lr, warmup.train.lr_scaling, warmup.train.lr_reference_batch) == (1e-3, "sqrt", 32)
    assert (warmup.train.lr_decay, warmup.train.warmup_samples) == ("constant", 128)
    assert warmup.train.checkpoint_uri == "file:///ckpt/run/trials/warmup"
    assert not warmup.trials.enabled


def test_a_branch_resumes_at_the_warm_up_at_exactly_its_lr_and_evaluates_at_the_shared_points(tmp_path):
    document = document_of(tmp_path)
    branch = document.trials.branches[5]  # batch 64, LR x 2
    assert (branch.global_batch_size, branch.lr_multiplier, branch.num_nodes) == (64, 2.0, 1)
    config = branch_config(document, branch, start_sample=192)
    derived = plan(config, micro_batch_size=16, announce=False).plan
    [stage] = derived.stages
    assert (stage.global_batch_size, stage.start_sample, stage.end_sample, stage.num_nodes) == (64, 0, 448, 1)
    # The run's sqrt rule at 64 (twice its reference 32) x 2, constant from the warm-up's end to the branch's.
    assert branch.lr == pytest.approx(1e-3 * 2**0.5 * 2)
    lrs = {derived.lr_schedule.at(consumed_samples=s, global_batch_size=64) for s in (192, 320, 384)}
    assert lrs == {branch.lr}
    # Every branch evaluates where its count crosses a multiple of gcd(192, 128) = 64: 192 + 128 and
    # 192 + 256 among them.
    assert config.train.eval_every_samples == 64
    assert config.train.checkpoint_uri == "file:///ckpt/run/trials/trial-5-b64-lr2"
    assert config.name == "tiny-trial-5"


def write_checkpoint(root: Path, step: int, consumed: int) -> None:
    folder = root / f"{step:09d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step, "consumed_samples": consumed}))
    (folder / "__0_0.distcp").write_bytes(b"shard")
    (root / "latest").write_text(f"{step:09d}\n")


def test_a_branch_starts_from_a_complete_copy_of_the_latest_checkpoint_alone(tmp_path):
    source, target = tmp_path / "warmup", tmp_path / "branch"
    write_checkpoint(source, 4, 64)
    write_checkpoint(source, 12, 192)
    (source / "metrics.jsonl").write_text("{}\n")
    (target / "000000099").mkdir(parents=True)
    (target / "000000099" / "meta.json").write_text("{}")  # a previous attempt's
    assert copy_checkpoint(f"file://{source}", f"file://{target}") == 192
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == ["000000012/__0_0.distcp", "000000012/meta.json", "branch.json", "latest"]
    assert latest_checkpoint(f"file://{target}") == ("000000012", 192)
    # The branch record lets the branch's first launch continue the warm-up's weights (config.identity).
    assert json.loads((target / "branch.json").read_text()) == {
        "source": f"file://{source}",
        "run": None,
        "consumed_samples": 192,
    }


def test_a_failed_launch_is_told_by_its_trainers_error_line(tmp_path):
    logs = tmp_path / "torchx" / "app" / "batchpilot" / "0"
    logs.mkdir(parents=True)
    (logs / "stderr.log").write_text(
        "[0]:Traceback (most recent call last):\n"
        '[0]:  File "x.py", line 1\n'
        "[0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    # torchrun's own ChildFailedError (no message) is not the cause.
    assert (
        failure_reason(tmp_path) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    (logs / "combined.log").write_text("[0]:batchpilot: error: train.checkpoint_uri: is gone\n")
    assert failure_reason(tmp_path) == "train.checkpoint_uri: is gone"


def result(index: int, batch: int, multiplier: float, loss: float) -> BranchResult:
    return BranchResult(index, batch, multiplier, "ok", ((128, loss + 0.1), (256, loss)))


def test_auto_from_trials_is_planned_again_from_the_configured_auto_with_the_decision(tmp_path):
    document = document_of(
        tmp_path, global_batch_size="auto", max_global_batch_size=64, auto_from="trials", schedule=None,
        rampup={"start": 16, "increment": 16, "samples": 960},
    )  # fmt: skip
    assert document.plan.stages[-1].global_batch_size == 64  # at the bound until the trials decide
    assert document.trials.auto_bound == 64
    results = [
        result(0, 16, 0.5, 3.5),
        result(1, 16, 2.0, 3.4),
        result(2, 32, 0.5, 3.6),
        result(3, 32, 2.0, 3.41),
    ]
    results += [result(4, 64, 0.5, 3.7), BranchResult(5, 64, 2.0, "failed", (), "CUDA out of memory")]
    decided = decide_trials(document, results)
    assert decided.trials_outcome.decision.critical_batch == 32
    assert decided.trials_outcome.decision.excluded == ("batch 64 x LR 2: CUDA out of memory",)
    assert decided.plan.stages[-1].global_batch_size == 32
    assert decided.config.train.lr == pytest.approx(2 * 1e-3)  # the multiplier that did best at 32
    assert decided.trials == document.trials
    assert decided.micro_batch_source == document.micro_batch_source


def test_with_a_fixed_target_the_decision_is_recorded_and_the_plan_stands(tmp_path):
    document = document_of(tmp_path)
    assert document.trials.auto_bound is None
    decided = decide_trials(document, [result(0, 16, 0.5, 3.4), result(2, 32, 0.5, 3.41)])
    assert decided.trials_outcome.decision.critical_batch == 32
    assert decided.plan == document.plan


def test_local_branches_at_once_are_bounded_by_the_cpus_over_a_branchs_processes():
    from batchpilot.commands.trials import default_parallel

    assert default_parallel(parallelism=4, backend="local", processes_per_branch=2, cpus=6) == 3
    assert default_parallel(parallelism=2, backend="local", processes_per_branch=1, cpus=16) == 2
    assert default_parallel(parallelism=4, backend="local", processes_per_branch=4, cpus=2) == 1
    assert default_parallel(parallelism=4, backend="gke", processes_per_branch=16, cpus=2) == 4


def test_the_exit_handler_knows_every_run_name_the_trials_launch_under(tmp_path):
    document = document_of(tmp_path)
    trials = document.config.trials
    names = trial_run_names("tiny", batch_sizes=trials.batch_sizes, lr_multipliers=trials.lr_multipliers)
    # 3 configured batches x 2 multipliers: the warm-up's run and one per branch index the config allows.
    assert names == ["tiny-trials"] + [f"tiny-trial-{k}" for k in range(6)]
    assert warmup_config(document).name == names[0]
    assert [branch_config(document, b, start_sample=192).name for b in document.trials.branches] == names[1:]
    # The default candidates: 5 multiples of the start batch.
    assert len(trial_run_names("tiny", batch_sizes=None, lr_multipliers=[1.0])) == 1 + 5


def test_a_trial_on_gke_keeps_the_owning_runs_lease_alive_while_it_trains(tmp_path, monkeypatch):
    """The pool is labelled with the run; a trial launches under its own name, so without the owner's Lease
    renewed a long trial would leave the pool looking orphaned (cluster.orphan_ttl_s) to the next run."""
    import contextlib

    import batchpilot.cluster.ownership as ownership
    import batchpilot.workflow.stage as stage_module
    from batchpilot.workflow import trial_runs as trials_module

    renewed: list[str] = []
    launched: list[tuple[str, list[str]]] = []

    @contextlib.contextmanager
    def lease_renewed(api_client, *, namespace, run, ttl_s):
        renewed.append(run)
        yield

    monkeypatch.setattr(ownership, "lease_renewed", lease_renewed)
    monkeypatch.setattr(
        stage_module,
        "run_stage",
        lambda document, **_: launched.append((document.config.name, list(renewed))) or 0,
    )
    document = document_of(tmp_path)
    gke = document.config.model_copy(
        update={"cluster": document.config.cluster.model_copy(update={"backend": "gke"}), "name": "tiny"}
    )
    trials_module._launch(dataclasses.replace(document, config=gke), work_dir=None, owner="owner-run")
    assert launched == [("tiny", ["owner-run"])]
    local = trials_module._launch(document, work_dir=None, owner="owner-run")
    assert local == 0 and renewed == ["owner-run"]  # a local launch has no Lease


def test_an_adaptive_ramp_is_calibrated_from_the_trials_and_the_warm_ups_noise_scale(tmp_path):
    """adaptive.scale = the trials' critical batch / B_simple at the branch point (the warm-up's last
    noise-scale measurement, in the metrics kept beside its checkpoints)."""
    import yaml

    from batchpilot.runstate import METRICS_OBJECT
    from batchpilot.workflow.trial_runs import warmup_uri

    config = yaml.safe_load((REPO / "configs" / "demo_adaptive.yaml").read_text())
    config["data"]["uri"] = write_manifest(tmp_path / "data")
    config["train"]["checkpoint_uri"] = f"file://{tmp_path}/ckpt"
    config["trials"] = {
        "enabled": True, "tokens": 128 * 64, "batch_sizes": [4, 8, 16], "lr_multipliers": [1.0],
        "calibrate_adaptive": True, "budget_fraction": 0.5,
    }  # fmt: skip
    document = plan(parse_config(config), announce=False)
    assert document.config.batch.rampup.adaptive.scale == 1.0
    warmup = Path(warmup_uri(document.config).removeprefix("file://"))
    warmup.mkdir(parents=True)
    records = [
        {"consumed_samples": 4 * k, "noise_scale": ns} for k, ns in ((1, None), (2, 1.5), (3, 2.0), (4, None))
    ]
    (warmup / METRICS_OBJECT).write_text("".join(json.dumps(r) + "\n" for r in records))
    decided = decide_trials(
        document, [result(0, 4, 1.0, 3.40), result(1, 8, 1.0, 3.41), result(2, 16, 1.0, 3.60)]
    )
    assert decided.trials_outcome.noise_scale_at_start == 2.0
    assert decided.trials_outcome.scale_calibration == 4.0  # critical 8 / B_simple 2.0
    assert decided.config.batch.rampup.adaptive.scale == 4.0
    # Without calibrate_adaptive the calibration is recorded, and the configured scale stands.
    config["trials"]["calibrate_adaptive"] = False
    kept = decide_trials(
        plan(parse_config(config), announce=False),
        [result(0, 4, 1.0, 3.40), result(1, 8, 1.0, 3.41), result(2, 16, 1.0, 3.60)],
    )
    assert (kept.trials_outcome.scale_calibration, kept.config.batch.rampup.adaptive.scale) == (4.0, 1.0)


def test_branches_from_an_existing_checkpoint_skip_the_warm_up_and_resume_at_its_sample(
    tmp_path, monkeypatch
):
    """trials.from_checkpoint: no warm-up; each branch starts from a copy of that checkpoint at its sample."""
    import batchpilot.workflow.trial_runs as trials_module
    from batchpilot.runstate import METRICS_OBJECT
    from batchpilot.workflow.trial_runs import branch_uri, run_branch, run_warmup

    existing = tmp_path / "pretrained"
    write_checkpoint(existing, 20, 320)
    config = tiny_config(data_uri=write_manifest(tmp_path / "data"), checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["trials"] = {
        "enabled": True, "tokens": 256 * 32, "evaluations": 2, "batch_sizes": [16, 32, 64], "lr_multipliers": [1.0],
        "from_checkpoint": f"file://{existing}", "budget_fraction": 0.75,
    }  # fmt: skip
    document = plan(parse_config(config), announce=False)
    assert document.trials.warmup_samples == 0
    launched: list[tuple[str, int, list[str]]] = []

    def launch(derived, *, work_dir, owner):
        uri = Path(derived.config.train.checkpoint_uri.removeprefix("file://"))
        launched.append(
            (derived.config.name, derived.plan.stages[0].global_batch_size, sorted(os.listdir(uri)))
        )
        points = [320 + point for point in document.trials.eval_points]
        (uri / METRICS_OBJECT).write_text(
            "".join(json.dumps({"consumed_samples": p, "val_loss": 3.0}) + "\n" for p in points)
        )
        return 0

    monkeypatch.setattr(trials_module, "_launch", launch)
    run_warmup(document, work_dir=None)
    assert launched == []  # nothing to warm up
    outcome = run_branch(document, index=2, work_dir=None)
    assert launched == [("tiny-trial-2", 64, ["000000020", "branch.json", "latest"])]
    assert outcome.status == "ok" and outcome.curve == ((128, 3.0), (256, 3.0))
    assert Path(branch_uri(document.config, document.trials.branches[2]).removeprefix("file://")).is_dir()
    # A checkpoint at a sample that is not a multiple of every branch's batch cannot be shared by them.
    write_checkpoint(existing, 21, 336)
    with pytest.raises(BatchpilotError) as refused:
        run_branch(document, index=0, work_dir=None)
    assert str(refused.value) == (
        "trials.from_checkpoint: its checkpoint is at sample 336, not a multiple of every branch's batch (64) "
        "(fix: branch from a checkpoint at a multiple of every batch in trials.batch_sizes)"
    )
