"""Targets decided by measurements: `batch.global_batch_size: auto` from explore's gradient-noise study or
from the batch trials (the nearest size the ramp-up and the node schedule accept), and the trials a run plans.
"""

from __future__ import annotations

from typing import Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.checks import plan_problems
from batchpilot.plan.memory import does_not_fit
from batchpilot.plan.schedule import batch_schedule, placement
from batchpilot.plan.stages import build_plan, lr_schedule
from batchpilot.planning import Plan
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan, candidate_batches, plan_trials
from batchpilot.planning.units import format_number

AUTO_TARGET_ATTEMPTS = 200
"""How many candidate targets (nearest to the study's first) `resolve_auto_target` plans before giving up."""


def resolve_auto_target(
    config: Config, explore: dict[str, Any] | None, *, micro_batch_size: int
) -> tuple[Config, list[str]]:
    """`batch.global_batch_size: auto`: the study's recommended target, moved to the nearest size at most
    `max_global_batch_size` that the ramp-up and the node schedule accept at `micro_batch_size`, and its LR
    rule (sqrt up to twice the critical batch, none above, as the study advises); with notes."""
    batch = config.batch
    study = (explore or {}).get("noise_scale") or {}
    recommended, measured = study.get("recommended_global_batch_size"), study.get("critical_batch_size")
    # Below the smallest batch measured the study gives a bound, not a number (`critical_batch_at_most`).
    critical = measured or study.get("critical_batch_at_most")
    if explore is None or not recommended or not critical:
        why = "no exploration was given" if explore is None else "explore's study measured no noise scale"
        raise BatchpilotError(
            "batch.global_batch_size",
            f"is auto, which takes the target from explore's gradient-noise study, but {why}",
            "plan with --explore explore.json from an exploration whose study measured the noise scale, or "
            "set an integer global_batch_size",
        )

    def lr_scaling(target: int) -> str:
        # With only a bound on the critical batch, whether the target is within twice it is unknown: none.
        return "sqrt" if measured and target <= 2 * critical else "none"

    found = _nearest_target(
        config, recommended, micro_batch_size=micro_batch_size,
        train=lambda target: {"lr_scaling": lr_scaling(target)},
    )  # fmt: skip
    bound = batch.target_bound
    if found is None:
        raise BatchpilotError(
            "batch.global_batch_size",
            f"is auto, but no target near the study's {recommended} up to max_global_batch_size {bound} fits the "
            f"ramp-up and the node schedule at micro_batch_size={micro_batch_size}",
            "set an integer global_batch_size (explore.json's noise_scale section has the study's advice)",
        )
    resolved, target = found
    clamped = f", at most max_global_batch_size {bound}" if recommended > bound else ""
    return resolved, [
        f"batch.global_batch_size: auto -> {target} (explore's study: critical batch "
        f"{f'~{format_number(critical)} samples' if measured else f'at most {critical} samples (not measurable below it)'}"
        f", recommended {recommended}; the nearest size the ramp-up and the node schedule accept at "
        f"micro_batch_size={micro_batch_size}{clamped}); train.lr_scaling: {lr_scaling(target)} (the study's rule: "
        "sqrt up to twice the critical batch, none above)"
    ]


def _nearest_target(
    config: Config, recommended: int, *, micro_batch_size: int, train: Any
) -> tuple[Config, int] | None:
    """The config with the target nearest `recommended` (at most the bound) that the ramp-up and the node
    schedule accept at `micro_batch_size`, and `train(target)`'s train settings; None when none does."""
    batch = config.batch
    unit = micro_batch_size * config.cluster.devices_per_node  # the final stage splits over whole nodes
    bound = batch.target_bound
    candidates = sorted(range(unit, bound + 1, unit), key=lambda t: (abs(t - recommended), -t))
    for target in candidates[:AUTO_TARGET_ATTEMPTS]:
        resolved = config.model_copy(
            update={
                # The resolved config is a plain one (what the trainers and later tasks read and validate).
                "batch": batch.model_copy(
                    update={"global_batch_size": target, "max_global_batch_size": None, "auto_from": "study"}
                ),
                "train": config.train.model_copy(update=train(target)),
            }
        )
        try:
            batch_schedule(resolved)  # the ramp's shape first: cheap, where plan_problems also seeks a fix
            if plan_problems(resolved):
                continue
            build_plan(resolved, micro_batch_size=micro_batch_size)
        except BatchpilotError:
            continue
        return resolved, target
    return None


def resolve_trials_target(
    config: Config, outcome: TrialsOutcome, *, micro_batch_size: int
) -> tuple[Config, list[str]]:
    """`batch.auto_from: trials`: the trials' critical batch as the target (the nearest size the ramp-up and
    the node schedule accept, at most the bound) and the LR multiplier that did best at it on train.lr."""
    decision = outcome.decision
    if decision.critical_batch is None or decision.lr_multiplier is None:
        raise BatchpilotError(
            "batch.auto_from",
            f"is trials, but the trials decided no critical batch: {decision.reason}",
            "look at the failed branches in the trials' results, or set an integer global_batch_size",
        )
    multiplier = decision.lr_multiplier
    found = _nearest_target(
        config, decision.critical_batch, micro_batch_size=micro_batch_size,
        train=lambda _target: {"lr": config.train.lr * multiplier},
    )  # fmt: skip
    if found is None:
        raise BatchpilotError(
            "batch.global_batch_size",
            f"is auto from the trials, but no target near their critical batch {decision.critical_batch} up to "
            f"max_global_batch_size {config.batch.target_bound} fits the ramp-up and the node schedule",
            "set an integer global_batch_size",
        )
    resolved, target = found
    return resolved, [
        f"batch.global_batch_size: auto -> {target} from the trials ({decision.reason}); train.lr "
        f"{format_number(config.train.lr)} x {multiplier:g} = {format_number(resolved.train.lr)} (the multiplier "
        "that did best at that batch)"
    ]


def at_trials_bound(config: Config) -> Config:
    """An `auto` target planned at its bound until the trials decide it (what the trials and the launch
    slots are sized for)."""
    batch = config.batch.model_copy(
        update={
            "global_batch_size": config.batch.target_bound,
            "max_global_batch_size": None,
            "auto_from": "study",
        }
    )
    return config.model_copy(update={"batch": batch})


def trials_for(
    config: Config, plan: Plan, *, memory: MemoryPlan | None = None, shape: ModelShape | None = None
) -> TrialsPlan:
    """The batch trials of `config` (`trials.enabled`) for `plan`: candidate batches from the ramp's start to
    its target that split over some allowed node count (on the fewest, fitting the device), their LRs under
    the run's scaling rule, and the samples each trains; refused over `trials.budget_fraction`."""
    trials = config.trials
    assert trials.tokens is not None  # the config requires it when enabled
    micro = plan.micro_batch_size
    where = placement(config)
    counts = where.node_counts()

    def fewest_nodes(batch: int) -> int | None:
        for nodes in counts:
            placed = where.fits(global_batch_size=batch, num_nodes=nodes, micro_batch_size=micro)
            if (
                placed
                and does_not_fit(config, memory, shape, num_nodes=nodes, micro_batch_size=micro) is None
            ):
                return nodes
        return None

    def accepts(batch: int) -> str | None:
        if fewest_nodes(batch) is not None:
            return None
        return (
            f"no allowed node count ({', '.join(map(str, counts))}) splits it into whole micro batches of {micro} "
            "on a device it fits"
        )

    schedule = lr_schedule(config)
    start = plan.stages[0].global_batch_size
    batches = candidate_batches(
        start_batch=start,
        target=plan.stages[-1].global_batch_size,
        accepts=accepts,
        configured=trials.batch_sizes,
    )
    return plan_trials(
        start_batch=start,
        batches=batches,
        lr_multipliers=trials.lr_multipliers,
        lr_at=schedule.peak,
        nodes_for=lambda batch: fewest_nodes(batch) or 0,
        seq_len=config.data.seq_len,
        tokens=trials.tokens,
        evaluations=trials.evaluations,
        warmup_samples=config.train.warmup_samples
        if trials.warmup_samples is None
        else trials.warmup_samples,
        from_checkpoint=trials.from_checkpoint,
        tolerance=trials.tolerance,
        parallelism=trials.parallelism,
        run_samples=config.total_samples,
        budget_fraction=trials.budget_fraction,
    )
