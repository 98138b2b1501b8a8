"""Batch trials: candidate global batches (and LR multipliers) raced on loss from one warm-up checkpoint.

The study estimates the critical batch from the gradient noise scale, a proxy that can be off (Merrill et
al., 2025). Trials measure it directly: train a warm-up at the ramp's start batch, then branch short runs
from its checkpoint, one per (batch, LR multiplier), each over the same samples in the same order, and
evaluate all of them on the same validation samples at the same sample counts. The critical batch is the
largest batch whose validation loss at the budget stays within a tolerance of the best smaller batch's.

This module is arithmetic only: which branches, how many samples each, when they evaluate, what they cost,
and the decision from their results. Running them is `batchpilot.workflow.trial_runs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from batchpilot.errors import BatchpilotError
from batchpilot.planning.units import format_int, format_number

DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)
"""Candidate batches by default: these multiples of the ramp's start batch (the study's multipliers)."""
RUN_NAME_LENGTH = 40
"""A run name is a DNS label of at most this many characters (the config's `name`)."""


def derived_run_name(name: str, suffix: str) -> str:
    """`<name><suffix>`, the name cut so that the whole stays a valid run name (the warm-up's and each
    branch's own runs: `-trials`, `-trial-<k>`)."""
    return f"{name[: RUN_NAME_LENGTH - len(suffix)].rstrip('-')}{suffix}"


def trial_run_names(
    name: str, *, batch_sizes: Sequence[int] | None, lr_multipliers: Sequence[float]
) -> list[str]:
    """Every run name the trials of run `name` may launch under, known from the config alone (the exit
    handler deletes their jobs with the run's own): the warm-up's, then one per branch index the configured
    batches (or the default multiples) and LR multipliers allow."""
    num_branches = len(batch_sizes or DEFAULT_MULTIPLES) * len(lr_multipliers)
    return [derived_run_name(name, "-trials")] + [
        derived_run_name(name, f"-trial-{k}") for k in range(num_branches)
    ]


@dataclass(frozen=True)
class TrialBranch:
    """One branch: a constant global batch and LR, from the warm-up checkpoint for `TrialsPlan.branch_samples`.

    Attributes:
        index: position in `TrialsPlan.branches`.
        global_batch_size: samples per optimizer step.
        lr_multiplier: factor on the LR the run's scaling rule gives at this batch.
        lr: the branch's (constant) learning rate: the rule's peak at this batch x `lr_multiplier`.
        num_nodes: nodes the branch trains on: the fewest its batch splits over.
    """

    index: int
    global_batch_size: int
    lr_multiplier: float
    lr: float
    num_nodes: int

    @property
    def name(self) -> str:
        """`trial-<k>-b<batch>-lr<multiplier>`, a DNS-label-safe name for its launch and folders."""
        multiplier = format(self.lr_multiplier, "g").replace(".", "p")
        return f"trial-{self.index}-b{self.global_batch_size}-lr{multiplier}"


@dataclass(frozen=True)
class TrialsPlan:
    """What the trials train. Every sample count is a multiple of every branch's batch and of the start
    batch, so that all branches consume the same samples and evaluate at the same counts.

    Attributes:
        start_batch: the warm-up's global batch (the ramp's start).
        warmup_samples: samples the warm-up trains from sample 0 (0: the branches start from
            `from_checkpoint` at its own position).
        branch_samples: samples each branch trains after the warm-up.
        eval_every_samples: each branch evaluates after every this many of its samples.
        tolerance: relative loss tolerance of the decision.
        parallelism: branches run at once.
        branches: one per (batch, LR multiplier), batches ascending.
        seq_len: tokens per sample.
        share: the trials' part of all samples trained (run + trials): at one per-device throughput, their
            part of the node-hours.
        from_checkpoint: the checkpoint the branches start from instead of a warm-up (None: the warm-up's).
        auto_bound: with `batch.global_batch_size: auto` from the trials, the bound the run was planned at until
            they decide its target (the configured `auto` is planned again with their outcome); None otherwise.
    """

    start_batch: int
    warmup_samples: int
    branch_samples: int
    eval_every_samples: int
    tolerance: float
    parallelism: int
    branches: tuple[TrialBranch, ...]
    seq_len: int
    share: float
    from_checkpoint: str | None = None
    auto_bound: int | None = None

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({b.global_batch_size for b in self.branches})

    @property
    def trained_samples(self) -> int:
        """Warm-up plus every branch."""
        return self.warmup_samples + self.branch_samples * len(self.branches)

    @property
    def eval_points(self) -> list[int]:
        """Samples after the warm-up at which every branch evaluates (the last one is its end)."""
        return list(range(self.eval_every_samples, self.branch_samples + 1, self.eval_every_samples))

    def node_hours(self, samples_per_s_per_device: float, devices_per_node: int) -> float:
        """Node-hours of the warm-up and the branches at a per-device throughput (nodes x time is the same
        on any node count when throughput scales with the devices)."""
        return self.trained_samples / (samples_per_s_per_device * devices_per_node) / 3600

    def describe(self) -> str:
        """One line for the plan's notes."""
        batches = ", ".join(format_int(b) for b in self.batch_sizes)
        multipliers = ", ".join(format(m, "g") for m in sorted({b.lr_multiplier for b in self.branches}))
        start = (
            f"from {self.from_checkpoint}"
            if self.from_checkpoint
            else f"after a warm-up of {format_int(self.warmup_samples)} samples at batch {self.start_batch}"
        )
        return (
            f"trials: {len(self.branches)} branches (batches {batches} x LR multipliers {multipliers}) {start}, "
            f"{format_int(self.branch_samples)} samples ({format_int(self.branch_samples * self.seq_len)} tokens) "
            f"each, evaluated every {format_int(self.eval_every_samples)}; {format_int(self.trained_samples)} "
            f"samples, {self.share:.1%} of all training (and of its node-hours at one per-device throughput)"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialsPlan:
        branches = tuple(TrialBranch(**b) for b in data["branches"])
        return cls(**{**data, "branches": branches})


def candidate_batches(
    *,
    start_batch: int,
    target: int,
    accepts: Callable[[int], str | None],
    configured: Sequence[int] | None,
) -> list[int]:
    """The branches' global batches, ascending.

    Args:
        start_batch: the ramp's start batch.
        target: the largest batch a branch may use (the run's target, or its bound under `auto`).
        accepts: the reason a batch cannot be trained under the run's node schedule, or None when it can.
        configured: `trials.batch_sizes`, or None for the default multiples of the start batch.

    Raises:
        BatchpilotError: a configured batch the schedule cannot train, or fewer than two candidates.
    """
    if configured:
        for batch in configured:
            why = accepts(batch)
            if why is not None:
                raise BatchpilotError(
                    "trials.batch_sizes",
                    f"{batch} cannot be trained: {why}",
                    "give batch sizes the node schedule accepts, or leave trials.batch_sizes out for the default",
                )
        batches = sorted(set(configured))
    else:
        batches = [
            start_batch * m
            for m in DEFAULT_MULTIPLES
            if start_batch * m <= target and accepts(start_batch * m) is None
        ]
    if len(batches) < 2:
        raise BatchpilotError(
            "trials.batch_sizes",
            f"gives {len(batches)} batch size(s) to compare ({', '.join(map(str, batches)) or 'none'}); the "
            f"default multiples 1, 2, 4, 8, 16 of the start batch {start_batch} up to {target} leave too few",
            "list at least two batch sizes the node schedule accepts in trials.batch_sizes",
        )
    return batches


def plan_trials(
    *,
    start_batch: int,
    batches: Sequence[int],
    lr_multipliers: Sequence[float],
    lr_at: Callable[[int], float],
    nodes_for: Callable[[int], int],
    seq_len: int,
    tokens: int,
    evaluations: int,
    warmup_samples: int,
    from_checkpoint: str | None,
    tolerance: float,
    parallelism: int,
    run_samples: int,
    budget_fraction: float,
) -> TrialsPlan:
    """The trials' sample arithmetic, branches and share of the training, checked against the budget.

    Args:
        lr_at: the run's peak LR at a global batch (its scaling rule).
        nodes_for: the fewest nodes a global batch splits over.
        tokens: tokens each branch should train at least (rounded up to whole evaluation intervals).
        evaluations: evaluations per branch.
        warmup_samples: the warm-up's samples at least (rounded up); ignored with `from_checkpoint`.
        run_samples: the run's own samples, for the share.
        budget_fraction: the largest share the trials may take.

    Raises:
        BatchpilotError: the trials would take more than `budget_fraction` of all training.
    """
    unit = math.lcm(start_batch, *batches)  # every branch steps through each multiple of it
    per_eval = max(1, math.ceil(tokens / seq_len / evaluations))
    eval_every = math.ceil(per_eval / unit) * unit
    warmup = 0 if from_checkpoint else max(unit, math.ceil(warmup_samples / unit) * unit)
    branches = tuple(
        TrialBranch(
            index=k,
            global_batch_size=batch,
            lr_multiplier=float(multiplier),
            lr=lr_at(batch) * multiplier,
            num_nodes=nodes_for(batch),
        )
        for k, (batch, multiplier) in enumerate((b, m) for b in batches for m in lr_multipliers)
    )
    trained = warmup + eval_every * evaluations * len(branches)
    share = trained / (trained + run_samples)
    plan = TrialsPlan(
        start_batch=start_batch,
        warmup_samples=warmup,
        branch_samples=eval_every * evaluations,
        eval_every_samples=eval_every,
        tolerance=tolerance,
        parallelism=parallelism,
        branches=branches,
        seq_len=seq_len,
        share=share,
        from_checkpoint=from_checkpoint,
    )
    if share > budget_fraction:
        raise BatchpilotError(
            "trials.budget_fraction",
            f"is {budget_fraction:g}, but the trials would train {format_int(trained)} samples, "
            f"{share:.1%} of all training ({len(branches)} branches x {format_int(plan.branch_samples)} samples"
            + (f" + a {format_int(warmup)}-sample warm-up" if warmup else "")
            + ")",
            "lower trials.tokens, list fewer trials.batch_sizes or trials.lr_multipliers, or raise "
            "trials.budget_fraction",
        )
    return plan


@dataclass(frozen=True)
class BranchResult:
    """What one branch measured.

    Attributes:
        index: the branch's index in the plan.
        global_batch_size: its batch.
        lr_multiplier: its LR multiplier.
        status: ok, or failed (excluded from the decision).
        curve: (samples after the warm-up, validation loss) at each evaluation.
        reason: why it failed (its error's last line), empty when ok.
    """

    index: int
    global_batch_size: int
    lr_multiplier: float
    status: Literal["ok", "failed"]
    curve: tuple[tuple[int, float], ...] = ()
    reason: str = ""

    @property
    def final_loss(self) -> float | None:
        return self.curve[-1][1] if self.status == "ok" and self.curve else None

    @property
    def diverged_at(self) -> int | None:
        """Samples after the warm-up at the first evaluation whose loss is NaN or infinite (the branch
        diverged: it counts as failed in the decision), or None."""
        return next((samples for samples, loss in self.curve if not math.isfinite(loss)), None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BranchResult:
        """The result as `asdict` wrote it, read back from JSON (the curve's pairs come back as lists)."""
        return cls(**{**data, "curve": tuple((int(s), float(v)) for s, v in data["curve"])})


@dataclass(frozen=True)
class TrialsDecision:
    """The trials' verdict.

    Attributes:
        critical_batch: the largest batch whose best loss at the budget is within the tolerance of the best
            smaller batch's (scanning up from the smallest; the first batch outside it ends the scan).
        lr_multiplier: the LR multiplier that did best at `critical_batch`.
        best: per batch that trained, (its best LR multiplier, that branch's final loss).
        reason: the decision in one sentence.
        excluded: branches that failed, with why.
    """

    critical_batch: int | None
    lr_multiplier: float | None
    best: dict[int, tuple[float, float]] = field(default_factory=dict)
    reason: str = ""
    excluded: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["best"] = {str(batch): list(value) for batch, value in self.best.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialsDecision:
        best = {int(batch): (float(v[0]), float(v[1])) for batch, v in data["best"].items()}
        return cls(**{**data, "best": best, "excluded": tuple(data["excluded"])})


def _why_excluded(result: BranchResult) -> str | None:
    """Why a branch takes no part in the decision as a loss (failed, or diverged), or None."""
    if result.status != "ok":
        return result.reason or "failed"
    if result.diverged_at is not None:
        loss = dict(result.curve)[result.diverged_at]
        return f"diverged (validation loss {loss} at {format_int(result.diverged_at)} samples)"
    return None


def decide(results: Sequence[BranchResult], *, tolerance: float) -> TrialsDecision:
    """The critical batch from the branches' final validation losses (Merrill-style), failed ones left out.

    A branch whose validation loss became NaN or infinite diverged: it is excluded like a failed one, and a
    batch at which every branch that trained diverged is outside the tolerance (it ends the scan)."""
    excluded = tuple(
        f"batch {r.global_batch_size} x LR {r.lr_multiplier:g}: {why}"
        for r in results
        if (why := _why_excluded(r)) is not None
    )
    best: dict[int, tuple[float, float]] = {}
    for result in results:
        loss = result.final_loss
        if loss is None or _why_excluded(result) is not None:
            continue
        kept = best.get(result.global_batch_size)
        if kept is None or loss < kept[1]:
            best[result.global_batch_size] = (result.lr_multiplier, loss)
    # A batch whose every trained branch diverged, above the smallest that did not: never within the tolerance.
    diverged = {r.global_batch_size for r in results if r.status == "ok" and r.diverged_at is not None}
    scanned = sorted(set(best) | {b for b in diverged - set(best) if best and b > min(best)})
    if len(scanned) < 2:
        return TrialsDecision(
            None,
            None,
            best,
            f"only {len(best)} batch size(s) trained to the end: no comparison (see the failed branches)",
            excluded,
        )
    critical, best_smaller = scanned[0], best[scanned[0]][1]
    stop = ""
    for batch in scanned[1:]:
        if batch not in best:
            stop = f"; batch {batch} diverged (its validation loss became NaN or infinite)"
            break
        loss = best[batch][1]
        if loss > best_smaller * (1 + tolerance):
            stop = (
                f"; batch {batch} reached {format_number(loss, digits=4)}, more than {tolerance:.1%} above the best "
                f"smaller batch's {format_number(best_smaller, digits=4)}"
            )
            break
        critical, best_smaller = batch, min(best_smaller, loss)
    multiplier = best[critical][0]
    reason = (
        f"critical batch {critical}: the largest whose validation loss at the budget "
        f"({format_number(best[critical][1], digits=4)}, LR x {multiplier:g}) is within {tolerance:.1%} of every "
        f"smaller batch's best{stop or ' (the largest batch tried)'}"
    )
    return TrialsDecision(critical, multiplier, best, reason, excluded)


@dataclass(frozen=True)
class TrialsOutcome:
    """The branches' results and the decision made from them (recorded in the run's plan.json)."""

    results: tuple[BranchResult, ...]
    decision: TrialsDecision
    noise_scale_at_start: float | None = None
    """B_simple (the trainer's smoothed gradient noise scale) at the branch point: the warm-up's last
    measurement; None when the branches started from `from_checkpoint` or the warm-up measured none."""

    @property
    def scale_calibration(self) -> float | None:
        """The trials' critical batch over B_simple at the branch point: `adaptive.scale` calibrated for this
        model and data (docs/planning.md), or None when either is missing."""
        if not self.noise_scale_at_start or self.decision.critical_batch is None:
            return None
        return self.decision.critical_batch / self.noise_scale_at_start

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [asdict(r) for r in self.results],
            "decision": self.decision.to_dict(),
            "noise_scale_at_start": self.noise_scale_at_start,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialsOutcome:
        results = tuple(BranchResult.from_dict(r) for r in data["results"])
        return cls(
            results=results,
            decision=TrialsDecision.from_dict(data["decision"]),
            noise_scale_at_start=data.get("noise_scale_at_start"),
        )
