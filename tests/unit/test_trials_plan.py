"""Batch trials, the arithmetic: candidate batches, the samples every branch trains, the budget, and the
Merrill-style decision from the branches' losses."""

from __future__ import annotations

import pytest
import yaml

from batchpilot.config import config_from_text, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import parse_run_document
from batchpilot.planning.trials import (
    BranchResult,
    TrialsOutcome,
    candidate_batches,
    decide,
    plan_trials,
)
from batchpilot.workflow.plan import plan
from helpers import REPO, write_manifest


def accepts_multiples_of(unit: int):
    return lambda batch: None if batch % unit == 0 else f"not a multiple of {unit}"


def test_default_candidates_are_doublings_of_the_start_up_to_the_target_that_the_schedule_accepts():
    assert candidate_batches(
        start_batch=16, target=200, accepts=accepts_multiples_of(16), configured=None
    ) == [
        16,
        32,
        64,
        128,
    ]
    # 48 x 2 = 96 is not a multiple of 64: left out, not rounded.
    assert candidate_batches(
        start_batch=48, target=800, accepts=accepts_multiples_of(64), configured=None
    ) == [
        192,
        384,
        768,
    ]


def test_configured_candidates_the_schedule_cannot_train_are_refused_in_one_line():
    with pytest.raises(BatchpilotError) as refused:
        candidate_batches(start_batch=16, target=64, accepts=accepts_multiples_of(16), configured=[16, 40])
    assert str(refused.value) == (
        "trials.batch_sizes: 40 cannot be trained: not a multiple of 16 (fix: give batch sizes the node schedule "
        "accepts, or leave trials.batch_sizes out for the default)"
    )
    with pytest.raises(BatchpilotError, match="gives 1 batch size"):
        candidate_batches(start_batch=64, target=64, accepts=accepts_multiples_of(16), configured=None)


def trials(**changes):
    arguments = dict(
        start_batch=16,
        batches=[16, 32, 64],
        lr_multipliers=[0.5, 1.0, 2.0],
        lr_at=lambda batch: 1e-3 * batch / 64,
        nodes_for=lambda batch: 1 if batch < 64 else 2,
        seq_len=128,
        tokens=32_768,
        evaluations=4,
        warmup_samples=1000,
        from_checkpoint=None,
        tolerance=0.01,
        parallelism=4,
        run_samples=16_384,
        budget_fraction=0.25,
    )
    return plan_trials(**{**arguments, **changes})


def test_every_branch_trains_the_same_samples_and_evaluates_at_the_same_counts():
    planned = trials()
    # 32,768 tokens / 128 = 256 samples, 64 per evaluation, a multiple of every batch (lcm 64);
    # the warm-up of 1,000 samples is rounded up to 1,024.
    assert (planned.warmup_samples, planned.branch_samples, planned.eval_every_samples) == (1024, 256, 64)
    assert planned.eval_points == [64, 128, 192, 256]
    assert [(b.name, b.num_nodes, b.lr) for b in planned.branches[:2]] == [
        ("trial-0-b16-lr0p5", 1, 1.25e-4),
        ("trial-1-b16-lr1", 1, 2.5e-4),
    ]
    assert [b.global_batch_size for b in planned.branches] == [16, 16, 16, 32, 32, 32, 64, 64, 64]
    assert planned.branches[-1].num_nodes == 2
    assert planned.trained_samples == 1024 + 9 * 256
    assert planned.share == pytest.approx(3328 / (3328 + 16_384))
    assert trials(from_checkpoint="file:///ckpt").warmup_samples == 0


def test_trials_over_the_budget_are_refused_before_anything_runs():
    with pytest.raises(BatchpilotError) as refused:
        trials(tokens=65_536)
    assert str(refused.value) == (
        "trials.budget_fraction: is 0.25, but the trials would train 5,632 samples, 25.6% of all training "
        "(9 branches x 512 samples + a 1,024-sample warm-up) (fix: lower trials.tokens, list fewer "
        "trials.batch_sizes or trials.lr_multipliers, or raise trials.budget_fraction)"
    )


def result(index, batch, multiplier, losses, status="ok", reason=""):
    curve = tuple((64 * (k + 1), loss) for k, loss in enumerate(losses))
    return BranchResult(index, batch, multiplier, status, curve if status == "ok" else (), reason)


def test_the_critical_batch_is_the_largest_within_the_tolerance_of_every_smaller_one():
    results = [
        result(0, 16, 1.0, [4.0, 3.50]),
        result(1, 16, 2.0, [4.0, 3.40]),  # the best at 16
        result(2, 32, 1.0, [4.0, 3.42]),  # within 1% of 3.40
        result(3, 64, 1.0, [4.0, 3.60]),  # 5.9% above the best smaller: the scan ends here
        result(4, 128, 1.0, [4.0, 3.40]),  # not reached: the first batch outside ends the scan
    ]
    decision = decide(results, tolerance=0.01)
    assert (decision.critical_batch, decision.lr_multiplier) == (32, 1.0)
    assert decision.best == {16: (2.0, 3.40), 32: (1.0, 3.42), 64: (1.0, 3.60), 128: (1.0, 3.40)}
    assert "batch 64 reached 3.6, more than 1.0% above the best smaller batch's 3.4" in decision.reason
    assert decide(results, tolerance=0.1).critical_batch == 128


def test_a_failed_branch_is_excluded_and_the_others_still_decide():
    results = [
        result(0, 16, 1.0, [3.40]),
        result(1, 32, 1.0, [3.41]),
        result(2, 64, 1.0, [], status="failed", reason="CUDA out of memory"),
    ]
    decision = decide(results, tolerance=0.01)
    assert decision.critical_batch == 32
    assert decision.excluded == ("batch 64 x LR 1: CUDA out of memory",)
    lonely = decide([results[0], results[2]], tolerance=0.01)
    assert lonely.critical_batch is None and lonely.reason.startswith("only 1 batch size(s) trained")


@pytest.fixture
def demo_with_trials(tmp_path) -> dict:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = write_manifest(tmp_path / "data")
    config["trials"] = {"enabled": True, "tokens": 32_768}
    return config


def test_the_plan_carries_the_trials_and_says_what_they_cost(demo_with_trials):
    document = plan(
        config_from_text(yaml.safe_dump(demo_with_trials)), micro_batch_size=16, samples_per_s_per_device=64
    )
    assert document.trials is not None
    assert [b.global_batch_size for b in document.trials.branches] == [16] * 3 + [32] * 3 + [64] * 3
    assert document.notes[-1] == (
        "trials: 9 branches (batches 16, 32, 64 x LR multipliers 0.5, 1, 2) after a warm-up of 1,024 samples at "
        "batch 16, 256 samples (32,768 tokens) each, evaluated every 64; 3,328 samples, 16.9% of all training (and "
        "of its node-hours at one per-device throughput); 0.014 node-hours at 64 samples/s per device"
    )
    assert parse_run_document(document.to_json()).trials == document.trials


def test_auto_from_trials_plans_at_the_bound_then_takes_the_decided_batch_and_lr(demo_with_trials):
    demo_with_trials["batch"].update(global_batch_size="auto", max_global_batch_size=64, auto_from="trials")
    config = config_from_text(yaml.safe_dump(demo_with_trials))
    before = plan(config, micro_batch_size=16)
    assert before.plan.stages[-1].global_batch_size == 64
    assert "planned at max_global_batch_size 64 until the trials decide the target" in before.notes[-2]
    outcome = TrialsOutcome(
        results=(result(0, 16, 1.0, [3.40]), result(1, 32, 2.0, [3.41]), result(2, 64, 1.0, [3.60])),
        decision=decide(
            [result(0, 16, 1.0, [3.40]), result(1, 32, 2.0, [3.41]), result(2, 64, 1.0, [3.60])],
            tolerance=0.01,
        ),
    )
    after = plan(config, micro_batch_size=16, trials=before.trials, trials_outcome=outcome)
    assert after.plan.stages[-1].global_batch_size == 32
    assert after.config.train.lr == pytest.approx(2 * 3.0e-4)
    assert after.trials == before.trials
    assert parse_run_document(after.to_json()).trials_outcome == outcome


def test_trials_settings_are_checked_with_the_config():
    base = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    with pytest.raises(ValueError, match=r"trials\.enabled needs trials\.tokens"):
        parse_config({**base, "trials": {"enabled": True}})
    with pytest.raises(ValueError, match=r"batch\.auto_from: trials takes the target from the trials"):
        parse_config(
            {
                **base,
                "batch": {
                    **base["batch"],
                    "global_batch_size": "auto",
                    "max_global_batch_size": 64,
                    "auto_from": "trials",
                },
            }
        )
    with pytest.raises(ValueError, match=r"an explicit schedule fixes it \(its last batch\)"):
        parse_config(
            {
                **base,
                "batch": {
                    "global_batch_size": "auto", "max_global_batch_size": 64, "micro_batch_size": 16,
                    "schedule": "0:16 1024:64", "auto_from": "trials",
                },
                "trials": {"enabled": True, "tokens": 32_768},
            }
        )  # fmt: skip
