"""Batch trials' decision (`planning.trials.decide`), the rules a one-line slip would break unseen:

- a branch whose validation loss became NaN or infinite diverged: it is excluded like a failed branch, never
  the critical batch, and a batch at which every trained branch diverged is outside the tolerance (it ends the
  scan), also when its curve is read back from the metrics beside its checkpoints (`read_branch_result`);
- a batch is compared with the best of EVERY smaller batch, not only with the batch before it;
- "within the tolerance" includes the boundary: a loss exactly `best_smaller * (1 + tolerance)` is within it.
"""

from __future__ import annotations

import json
import math

from batchpilot.planning.trials import BranchResult, TrialBranch, TrialsPlan, decide
from batchpilot.runstate import METRICS_OBJECT
from batchpilot.workflow.trial_runs import read_branch_result

NAN = float("nan")
INF = float("inf")


def result(index: int, batch: int, losses: list[float], multiplier: float = 1.0) -> BranchResult:
    """A branch that trained to its end, evaluated every 64 samples."""
    curve = tuple((64 * (k + 1), loss) for k, loss in enumerate(losses))
    return BranchResult(index, batch, multiplier, "ok", curve)


def test_a_batch_that_diverged_is_never_critical_and_ends_the_scan():
    # 64 is as good as 16, but 32 between them diverged: 32 is outside any tolerance, so the scan ends there.
    results = [result(0, 16, [3.0, 2.0]), result(1, 32, [3.0, NAN]), result(2, 64, [3.0, 2.0])]
    decision = decide(results, tolerance=0.01)
    assert decision.critical_batch == 16
    assert 32 not in decision.best
    assert decision.excluded == ("batch 32 x LR 1: diverged (validation loss nan at 128 samples)",)
    assert "batch 32 diverged" in decision.reason


def test_a_diverged_largest_batch_does_not_win_over_the_smaller_ones():
    results = [result(0, 16, [3.0, 2.0]), result(1, 32, [3.0, 2.01]), result(2, 64, [3.0, NAN])]
    decision = decide(results, tolerance=0.01)
    assert (decision.critical_batch, decision.lr_multiplier) == (32, 1.0)


def test_an_infinite_loss_counts_as_diverged_too():
    results = [result(0, 16, [3.0, 2.0]), result(1, 32, [3.0, INF])]
    decision = decide(results, tolerance=0.01)
    assert decision.critical_batch == 16
    assert decision.excluded == ("batch 32 x LR 1: diverged (validation loss inf at 128 samples)",)


def test_a_branch_that_diverged_before_its_last_evaluation_is_excluded():
    # A finite last loss after a NaN evaluation does not make the branch a measurement.
    results = [result(0, 16, [3.0, 2.0]), result(1, 32, [NAN, 2.0])]
    decision = decide(results, tolerance=0.01)
    assert decision.critical_batch == 16
    assert decision.excluded == ("batch 32 x LR 1: diverged (validation loss nan at 64 samples)",)


def test_at_a_batch_with_a_diverged_lr_the_other_lr_decides_it():
    results = [
        result(0, 16, [3.0, 2.0]),
        result(1, 32, [3.0, 2.01], multiplier=1.0),
        result(2, 32, [3.0, NAN], multiplier=2.0),  # a NaN is not below 2.01: it must not be "best"
    ]
    decision = decide(results, tolerance=0.01)
    assert (decision.critical_batch, decision.lr_multiplier) == (32, 1.0)
    assert decision.best[32] == (1.0, 2.01)
    assert decision.excluded == ("batch 32 x LR 2: diverged (validation loss nan at 128 samples)",)


def test_a_nan_validation_loss_read_back_from_the_metrics_is_a_diverged_branch(tmp_path):
    # The caller's path: the branch's curve comes from the metrics kept beside its checkpoints (the trainer
    # writes a NaN loss as JSON's NaN).
    branch = TrialBranch(index=1, global_batch_size=32, lr_multiplier=1.0, lr=1e-3, num_nodes=1)
    trials = TrialsPlan(
        start_batch=16, warmup_samples=64, branch_samples=128, eval_every_samples=64, tolerance=0.01,
        parallelism=1, branches=(branch,), seq_len=8, share=0.1,
    )  # fmt: skip
    records = [
        {"consumed_samples": 64 + 64, "val_loss": 3.0},
        {"consumed_samples": 64 + 128, "val_loss": NAN},
    ]
    (tmp_path / METRICS_OBJECT).write_text("".join(json.dumps(r) + "\n" for r in records))
    read = read_branch_result(trials, branch, start_sample=64, uri=f"file://{tmp_path}")
    assert read.curve[0] == (64, 3.0) and math.isnan(read.curve[1][1])
    decision = decide([result(0, 16, [3.0, 2.0]), read, result(2, 64, [3.0, 2.0])], tolerance=0.01)
    assert decision.critical_batch == 16


def test_each_batch_is_compared_with_every_smaller_batch_not_only_the_previous_one():
    # Each step up is within 1% of the batch before it, but 64 is 1.8% above 16's loss: the scan ends at 64.
    losses = {16: 3.40, 32: 3.43, 64: 3.46}
    assert losses[32] <= losses[16] * 1.01 and losses[64] <= losses[32] * 1.01
    assert losses[64] > losses[16] * 1.01
    results = [result(k, batch, [4.0, loss]) for k, (batch, loss) in enumerate(losses.items())]
    decision = decide(results, tolerance=0.01)
    assert decision.critical_batch == 32
    assert "batch 64 reached 3.46" in decision.reason


def test_a_loss_exactly_at_the_tolerance_is_within_it():
    # 4.0 x (1 + 0.25) = 5.0 exactly in binary floating point: the boundary itself.
    assert 4.0 * (1 + 0.25) == 5.0
    results = [result(0, 16, [6.0, 4.0]), result(1, 32, [6.0, 5.0])]
    assert decide(results, tolerance=0.25).critical_batch == 32
    # Just above the boundary it is outside.
    above = [result(0, 16, [6.0, 4.0]), result(1, 32, [6.0, math.nextafter(5.0, 6.0)])]
    assert decide(above, tolerance=0.25).critical_batch == 16
