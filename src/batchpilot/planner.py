"""Checked config (+ exploration) -> plan, read top to bottom: `make_run_document` is the flow, and the one
place where the plan's micro batch is decided; the functions below it follow in the order it calls them.

The config is checked first (`batchpilot.checks`: every problem that no micro batch can fix, one line
each); what follows assembles the plan from narrow arguments (`batchpilot.schedule` reads the ramp-up and
the node placement) and trusts a checked config. Other entry points (the stage count of a compiled
pipeline, explore's probe strategy, a launch on fewer nodes, the adaptive ramp-up's run-time rule) follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from batchpilot.checks import SHOWN_STAGES, check_plan_config, explore_problems, plan_problems
from batchpilot.config import AdaptiveRampup, Config, resolved_runtime
from batchpilot.errors import BatchpilotError
from batchpilot.planning import LRSchedule, Plan, estimate_cost, plan_stages
from batchpilot.planning.adaptive import AdaptiveRule, AdaptiveRun, StageDecision
from batchpilot.planning.batch import raise_problems
from batchpilot.planning.devices import device_memory_bytes
from batchpilot.planning.memory import (
    RESERVE_FIXED_BYTES,
    MemoryEstimate,
    MemoryPlan,
    ModelShape,
    StageMemory,
    activation_bytes_per_sample,
    estimate_memory,
    plan_memory,
)
from batchpilot.planning.nodes import fits, walk_nodes
from batchpilot.planning.noise import NoiseMeasurement, noise_measurement, why_unmeasured
from batchpilot.planning.stages import Stage, sample_ranges
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan, candidate_batches, plan_trials
from batchpilot.planning.units import format_node_hours, format_number
from batchpilot.rundoc import MicroBatchSource, RunDocument
from batchpilot.schedule import allowed_node_counts, batch_schedule, placement, tpu_plan_slices


def make_run_document(
    config: Config,
    *,
    micro_batch_size: int | None = None,
    explore: dict[str, Any] | None = None,
    samples_per_s_per_device: float | None = None,
    shape: ModelShape | None = None,
    trials: TrialsPlan | None = None,
    trials_outcome: TrialsOutcome | None = None,
) -> RunDocument:
    """Config (+ explore.json, + an override) -> the validated run document with every stage.

    Args:
        config: the resolved config.
        micro_batch_size: an explicit override of the micro batch (None: the config's, else explore's).
        explore: the parsed explore.json, when an exploration ran.
        samples_per_s_per_device: throughput for the cost estimate (default: explore's measurement).
        shape: the model's shape (a meta-device build, `train.shape`): gives the per-device memory of every
            stage and resolves `train.parallelism: auto`. None: no memory check, and auto means ddp.
        trials: the batch trials of the document made before them (None: planned here when enabled).
        trials_outcome: their results and decision, once they ran (`batch.auto_from: trials` takes its
            target from it).
    """
    # What no micro batch can fix, and an exploration of another model, before asking for a micro batch.
    raise_problems(plan_problems(config) + explore_problems(config, explore))
    micro, source, notes = choose_micro_batch(config, override=micro_batch_size, explore=explore)
    if explore is not None and "fingerprint" not in explore:  # never a silent pass: say what was not checked
        notes.append(
            "explore.json records no fingerprint (written before explore recorded one), so it was not compared "
            "with this config's model, data.seq_len, devices and parallelism"
        )
    auto = config.batch.global_batch_size == "auto"
    from_trials = auto and config.batch.auto_from == "trials"
    if from_trials:
        if trials_outcome is None:  # the trials and the launch slots are sized for the bound
            bound = config.batch.target_bound
            config = at_trials_bound(config)
            notes.append(
                f"batch.global_batch_size: auto from the trials: planned at max_global_batch_size {bound} until "
                "the trials decide the target"
            )
        else:
            config, trial_notes = resolve_trials_target(config, trials_outcome, micro_batch_size=micro)
            notes += trial_notes
    elif auto:
        config, auto_notes = resolve_auto_target(config, explore, micro_batch_size=micro)
        notes += auto_notes
    if source == "explore":
        assert explore is not None
        config, setting_notes = with_explored_setting(config, explored_setting(explore))
        notes += setting_notes
    notes += [] if auto else study_advice(config, explore)  # taken with auto, else shown beside
    if samples_per_s_per_device is not None and samples_per_s_per_device <= 0:
        raise BatchpilotError(
            "--samples-per-s-per-device", f"must be positive, got {samples_per_s_per_device}"
        )
    plan = build_plan(config, micro_batch_size=micro)
    memory = memory_plan(config, plan, shape=shape, explore=explore) if shape is not None else None
    requested = config.train.parallelism
    plan = replace(
        plan, parallelism=memory.strategy if memory else "ddp" if requested == "auto" else requested
    )
    throughput = samples_per_s_per_device
    if throughput is None and explore is not None:
        throughput = explored_throughput(explore, micro_batch_size=micro)
    if trials is None and config.trials.enabled:
        trials = trials_for(config, plan, memory=memory, shape=shape)
        if from_trials:  # the configured `auto` is planned again with the trials' outcome
            trials = replace(trials, auto_bound=config.batch.target_bound)
    if trials is not None:
        cost = (
            f"; {format_node_hours(trials.node_hours(throughput, config.cluster.devices_per_node))} node-hours at "
            f"{format_number(throughput)} samples/s per device"
            if throughput
            else ""
        )
        notes.append(trials.describe() + cost)
    return RunDocument(
        config=config,
        plan=plan,
        micro_batch_source=source,
        explore=explore_summary(explore) if explore is not None else None,
        cost=estimate_cost(plan, samples_per_s_per_device=throughput) if throughput else None,
        notes=tuple(notes),
        memory=memory,
        trials=trials,
        trials_outcome=trials_outcome,
    )


def choose_micro_batch(
    config: Config, *, override: int | None, explore: dict[str, Any] | None
) -> tuple[int, MicroBatchSource, list[str]]:
    """The plan's micro batch, where it came from, and notes: the one rule the CLI and the pipeline share.

    An explicit override (`--micro-batch-size`, the pipeline's `micro_batch_size` parameter) comes first,
    then an integer in the config, then the exploration (when the config says `explore`).
    """
    notes: list[str] = []
    setting = explored_setting(explore) if explore is not None else None
    explored = setting.micro_batch_size if setting else None
    if override is not None:
        if override <= 0:
            raise BatchpilotError("--micro-batch-size", f"must be positive, got {override}")
        micro, source = override, "override"
    elif config.batch.micro_batch_size != "explore":
        micro, source = config.batch.micro_batch_size, "config"
    elif explored is not None:
        micro, source = explored, "explore"
        notes += [setting.note] if setting and setting.note else []
    else:
        raise BatchpilotError(
            "batch.micro_batch_size",
            "is 'explore', so the plan needs a measured micro batch",
            "pass --micro-batch-size N or --explore explore.json, or set an integer in the config",
        )
    if explored is not None and source != "explore" and explored != micro:
        notes.append(f"explore recommends micro_batch_size={explored}; the {source}'s {micro} stands")
    return micro, source, notes  # type: ignore[return-value]


@dataclass(frozen=True)
class ExploredSetting:
    """What the plan takes from explore.json: the micro batch and the setting it was measured with (None:
    explore.json does not say, and the config's setting stands)."""

    micro_batch_size: int
    activation_checkpointing: bool | None
    compile: bool | None
    note: str | None = None


def explored_setting(explore: dict[str, Any]) -> ExploredSetting:
    """The micro batch a plan takes from explore.json with its activation-checkpointing and compile
    settings, and a note when it is not the fastest measured.

    The fastest size may not fit every ramp-up stage; explore then names the fastest one that does
    (`plan_compatible_*`), and that is the one to plan with.
    """
    recommendation = explore["recommendation"]
    fastest = ExploredSetting(
        int(recommendation["micro_batch_size"]),
        recommendation.get("activation_checkpointing"),
        recommendation.get("compile"),
    )
    compatible = recommendation.get("plan_compatible_micro_batch_size")
    if compatible is None or int(compatible) == fastest.micro_batch_size:
        return fastest
    return ExploredSetting(
        int(compatible),
        recommendation.get("plan_compatible_activation_checkpointing"),
        recommendation.get("plan_compatible_compile"),
        f"explore's fastest micro_batch_size={fastest.micro_batch_size} does not fit every stage of this "
        f"ramp-up; planning with micro_batch_size={compatible}, the fastest measured size that does",
    )


def with_explored_setting(config: Config, setting: ExploredSetting) -> tuple[Config, list[str]]:
    """The config the stages run: explore's activation checkpointing and compile settings replace the
    config's (a size measured with activation checkpointing may not fit without it), with notes."""
    train = config.train
    notes: list[str] = []
    update: dict[str, bool] = {}
    for key, value in (
        ("activation_checkpointing", setting.activation_checkpointing),
        ("compile", setting.compile),
    ):
        if value is not None and getattr(train, key) != value:
            update[key] = bool(value)
            notes.append(
                f"train.{key}: {str(value).lower()} (explore measured micro_batch_size={setting.micro_batch_size} "
                f"with it; the config said {str(getattr(train, key)).lower()})"
            )
    return config.model_copy(update={"train": train.model_copy(update=update)}), notes


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
    recommended, critical = study.get("recommended_global_batch_size"), study.get("critical_batch_size")
    if explore is None or not recommended or not critical:
        why = "no exploration was given" if explore is None else "explore's study measured no noise scale"
        raise BatchpilotError(
            "batch.global_batch_size",
            f"is auto, which takes the target from explore's gradient-noise study, but {why}",
            "plan with --explore explore.json from an exploration whose study measured the noise scale, or "
            "set an integer global_batch_size",
        )

    def lr_scaling(target: int) -> str:
        return "sqrt" if target <= 2 * critical else "none"

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
        f"batch.global_batch_size: auto -> {target} (explore's study: critical batch ~{format_number(critical)} "
        f"samples, recommended {recommended}; the nearest size the ramp-up and the node schedule accept at "
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
    counts = allowed_node_counts(config)

    def fewest_nodes(batch: int) -> int | None:
        for nodes in counts:
            placed = fits(
                global_batch_size=batch, num_nodes=nodes, micro_batch_size=micro,
                devices_per_node=where["devices_per_node"], pipeline_parallel_size=where["pipeline_parallel_size"],
                tensor_parallel_size=where["tensor_parallel_size"], loading_factor=where["loading_factor"],
                allowed_nodes=where["allowed_nodes"],
            )  # fmt: skip
            if (
                placed
                and _does_not_fit(config, memory, shape, num_nodes=nodes, micro_batch_size=micro) is None
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


def study_advice(config: Config, explore: dict[str, Any] | None) -> list[str]:
    """The effective-batch study's advice beside the config's own numbers (which stand), as a note."""
    study = (explore or {}).get("noise_scale") or {}
    target = study.get("recommended_global_batch_size")
    if not target or not study.get("critical_batch_size"):
        return []
    return [
        f"explore's gradient-noise study: critical batch ~{format_number(study['critical_batch_size'])} samples, advises a "
        f"target global batch of {target} with train.lr_scaling: {study.get('lr_scaling')}; this plan keeps "
        f"batch.global_batch_size {config.batch.global_batch_size} and lr_scaling {config.train.lr_scaling} "
        "(global_batch_size: auto with a max_global_batch_size takes the advice)"
    ]


def build_plan(config: Config, *, micro_batch_size: int, decisions: Sequence[StageDecision] = ()) -> Plan:
    """Validates every stage of the config's ramp-up and schedules its nodes (an adaptive ramp-up: the
    stages its `decisions` fix, the open stage and the final one).

    Raises:
        BatchpilotError: every micro-batch-independent problem (`check_plan_config`), one line each; else
            the stages this micro batch cannot place.
    """
    check_plan_config(config)
    plan = plan_stages(
        schedule=batch_schedule(config, decisions),
        total_samples=config.total_samples,
        micro_batch_size=micro_batch_size,
        devices_per_node=config.cluster.devices_per_node,
        max_nodes=config.cluster.max_nodes,
        min_nodes=config.cluster.min_nodes,
        lr_schedule=lr_schedule(config),
        expansion_factor=Fraction(str(config.data.expansion_factor_real_data)),
        pipeline_parallel_size=config.batch.pipeline_parallel_size,
        tensor_parallel_size=config.batch.tensor_parallel_size,
        num_pipeline_microbatches=config.batch.num_pipeline_microbatches,
        tpu=tpu_plan_slices(config),
        each_stage_alone=isinstance(config.batch.rampup, AdaptiveRampup),
    )
    unmeasured = noise_note(config, plan)
    if unmeasured is not None:
        plan = replace(plan, notes=(*plan.notes, unmeasured))
    if not isinstance(config.batch.rampup, AdaptiveRampup):
        return plan
    settings = config.batch.rampup.adaptive
    open_stage = plan.stages[len(decisions)] if len(decisions) < len(plan.stages) - 1 else None
    note = (
        f"adaptive ramp-up: {len(decisions)} stage(s) decided so far; "
        + (
            f"{open_stage.name} (batch {open_stage.global_batch_size}) ends when the smoothed noise scale stays "
            f"at or above the next accepted batch for {settings.patience_samples:,} samples, at sample "
            f"{open_stage.end_sample:,} at the latest; "
            if open_stage
            else "the target is reached; "
        )
        + f"at most {settings.max_stages} stages in all"
    )
    return replace(plan, notes=(note, *plan.notes), stage_per_launch=True)


def lr_schedule(config: Config) -> LRSchedule:
    train = config.train
    total = config.total_samples
    return LRSchedule(
        lr=train.lr,
        scaling=train.lr_scaling,
        reference_batch=train.lr_reference_batch or config.batch.target_bound,
        warmup_samples=train.warmup_samples,
        decay=train.lr_decay,
        decay_end_samples=train.lr_decay_samples or total,
        min_lr_ratio=train.min_lr_ratio,
    )


def noise_note(config: Config, plan: Plan) -> str | None:
    """One line naming the stages whose steps cannot measure the noise scale (planning/noise.py), and why;
    under an adaptive ramp-up such a stage cannot end on the rule. None when every stage measures."""
    if not config.train.measure_noise_scale:
        return None
    every = config.train.measure_noise_every_steps
    strategy = "xla" if resolved_runtime(config) == "xla" else plan.parallelism
    blind = [
        stage
        for stage in plan.stages
        if noise_measurement(
            strategy=strategy, world_size=stage.world_size, micro_batch_size=stage.micro_batch_size,
            accumulation=stage.gradient_accumulation_steps, split_every_steps=every,
        )
        is NoiseMeasurement.NONE
    ]  # fmt: skip
    if not blind:
        return None
    names = ", ".join(stage.name for stage in blind[:SHOWN_STAGES])
    more = f" and {len(blind) - SHOWN_STAGES} more" if len(blind) > SHOWN_STAGES else ""
    why = why_unmeasured(micro_batch_size=blind[0].micro_batch_size, split_every_steps=every)
    adaptive = (
        "; the adaptive rule cannot end such a stage (it trains to its last sample)"
        if isinstance(config.batch.rampup, AdaptiveRampup)
        else ""
    )
    fix = "an even micro batch >= 2" if every else "train.measure_noise_every_steps >= 1"
    return (
        f"noise scale not measured in {names}{more}: accumulation 1 under {strategy} and {why}{adaptive} "
        f"(fix: {fix})"
    )


def memory_plan(
    config: Config, plan: Plan, *, shape: ModelShape, explore: dict[str, Any] | None
) -> MemoryPlan:
    """Per-device memory of every stage and the strategy (`train.parallelism`, auto resolved); refuses a
    strategy that does not fit the device. Local runs check against explore's CPU memory budget."""
    cluster = config.cluster
    local = cluster.backend == "local"
    device_memory = cluster.device_memory_bytes or (
        config.explore.memory_budget_bytes if local else device_memory_bytes(cluster.accelerator_type)
    )
    return plan_memory(
        # SPMD under xla shards over every device of the slice: the memory of fsdp.
        requested="fsdp" if resolved_runtime(config) == "xla" else config.train.parallelism,
        shape=shape,
        stages=plan.stages,
        devices_per_node=cluster.devices_per_node,
        seq_len=config.data.seq_len,
        mixed_precision=mixed_precision(config),
        activation_checkpointing=config.train.activation_checkpointing,
        activation_bytes_per_sample=explored_activation_bytes(config, explore),
        device_memory_bytes=device_memory,
        reserve_fixed_bytes=_reserve_fixed_bytes(config),
    )


def mixed_precision(config: Config) -> bool:
    """Whether the trainers will compute in bf16: `train.precision: bf16`, or `auto` on a GPU pool (local
    runs are planned as CPU runs)."""
    precision = config.train.precision
    on_accelerator = config.cluster.backend == "gke" and config.cluster.accelerator_type is not None
    return precision == "bf16" or (precision == "auto" and on_accelerator)


def _reserve_fixed_bytes(config: Config) -> int:
    """The runtime's fixed reserve per device: none on the CPU (local runs, or no accelerator)."""
    cluster = config.cluster
    return 0 if cluster.backend == "local" or cluster.accelerator_type is None else RESERVE_FIXED_BYTES


def _estimate_like(
    config: Config,
    planned: MemoryEstimate,
    *,
    shape: ModelShape,
    strategy: Any,
    world_size: int,
    micro_batch_size: int,
) -> MemoryEstimate:
    """A stage's per-device memory on `world_size` devices under `strategy`, with the activations of the
    `planned` estimate (measured ones per sample; the micro batch is the plan's)."""
    measured = planned.activations_source == "explore"
    return estimate_memory(
        shape=shape, strategy=strategy, world_size=world_size, devices_per_node=config.cluster.devices_per_node,
        micro_batch_size=micro_batch_size, seq_len=config.data.seq_len, mixed_precision=mixed_precision(config),
        activation_checkpointing=config.train.activation_checkpointing,
        activation_bytes_per_sample=planned.activations / micro_batch_size if measured else None,
        reserve_fixed_bytes=_reserve_fixed_bytes(config),
    )  # fmt: skip


def explored_activation_bytes(config: Config, explore: dict[str, Any] | None) -> float | None:
    """Activation memory per sample from explore's fitting probes of the trained setting (the slope of the
    per-device peak over the micro batch), or None when explore did not measure two sizes of it."""
    if explore is None:
        return None
    points = [
        (int(p["micro_batch_size"]), int(p["peak_memory_bytes"]))
        for p in explore.get("probes", [])
        if p.get("fits")
        and p.get("peak_memory_bytes")
        and bool(p.get("activation_checkpointing")) == config.train.activation_checkpointing
        and not p.get("compile")
    ]
    return activation_bytes_per_sample(points)


def explored_throughput(explore: dict[str, Any], *, micro_batch_size: int) -> float | None:
    """Samples/s of one device at `micro_batch_size`: the best fitting probe of that size, else the
    recommendation's own figure when it is that size; None when explore did not measure it."""
    measured = [
        float(p["samples_per_s"])
        for p in explore.get("probes", [])
        if p.get("fits") and p.get("micro_batch_size") == micro_batch_size and p.get("samples_per_s")
    ]
    if measured:
        return max(measured)
    recommendation = explore.get("recommendation") or {}
    if recommendation.get("micro_batch_size") == micro_batch_size and recommendation.get("samples_per_s"):
        return float(recommendation["samples_per_s"])
    return None


def explore_summary(explore: dict[str, Any]) -> dict[str, Any]:
    """What a run document keeps of explore.json: its recommendation and noise-scale estimate."""
    return {
        "recommendation": explore.get("recommendation"),
        "noise_scale": explore.get("noise_scale"),
        "num_probes": len(explore.get("probes", [])),
        "device": explore.get("device"),
    }


# --- other entry points -------------------------------------------------------------------------------------


def num_stages(config: Config) -> int:
    """How many stages the config's ramp-up has (it does not depend on the micro batch); refuses a config
    that `check_plan_config` refuses."""
    check_plan_config(config)
    if isinstance(config.batch.rampup, AdaptiveRampup):
        return config.batch.rampup.adaptive.max_stages  # decided at run time: at most this many
    return len(sample_ranges(batch_schedule(config), total_samples=config.total_samples))


def probe_parallelism(config: Config, shape: ModelShape) -> str:
    """The strategy explore's probes run under, so that they measure what the stages will run: the
    config's, or for `auto` the one the memory model picks at micro batch 1 (fsdp when even that does
    not fit: explore then finds out what does)."""
    if config.train.parallelism != "auto":
        return config.train.parallelism
    plan = build_plan(config, micro_batch_size=1)
    try:
        return memory_plan(config, plan, shape=shape, explore=None).strategy
    except BatchpilotError:
        return "fsdp"


def memory_on_fewer_nodes(
    config: Config, memory: MemoryPlan, *, stages: Sequence[Stage], shape: ModelShape
) -> tuple[StageMemory, ...]:
    """The per-device memory of `stages` (a launch moved to fewer nodes) under the plan's strategy, with
    the activations the plan estimated (the micro batch is unchanged; only the shard degree moves).

    Raises:
        BatchpilotError: a stage that no longer fits the device (fsdp's share grows as the world shrinks).
    """
    planned = {item.stage: item.estimate for item in memory.stages}
    checked = []
    for stage in stages:
        estimate = _estimate_like(
            config, planned[stage.name], shape=shape, strategy=memory.strategy,
            world_size=stage.world_size, micro_batch_size=stage.micro_batch_size,
        )  # fmt: skip
        limit = memory.device_memory_bytes
        if limit is not None and estimate.total > limit:
            raise BatchpilotError(
                "cluster.fewer_nodes",
                f"{stage.name} on {stage.num_nodes} node(s) needs {estimate.describe()} per device under "
                f"{memory.strategy} (shard degree {estimate.shard_degree}), more than the device's "
                f"{limit / 2**30:.1f} GiB",
                "wait for the planned nodes (raise cluster.capacity_timeout_s) or set cluster.fewer_nodes: fail",
            )
        checked.append(StageMemory(stage.name, estimate))
    return tuple(checked)


# --- the adaptive ramp-up -----------------------------------------------------------------------------------


def is_adaptive(config: Config) -> bool:
    """Whether the ramp-up's stages are decided at run time (`rampup: {adaptive: ...}`)."""
    return isinstance(config.batch.rampup, AdaptiveRampup)


def adaptive_rule(config: Config) -> AdaptiveRule:
    """The adaptive ramp-up's rule with the target resolved."""
    assert isinstance(config.batch.rampup, AdaptiveRampup)
    settings = config.batch.rampup.adaptive
    return AdaptiveRule(
        start=settings.start,
        target=config.batch.target_bound,
        smoothing=settings.smoothing,
        patience_samples=settings.patience_samples,
        max_growth=settings.max_growth,
        min_stage_samples=settings.min_stage_samples,
        ramp_samples=settings.samples,
        confidence=settings.confidence,
        scale=settings.scale,
    )


def accepted_batch_sizes(
    config: Config,
    *,
    micro_batch_size: int,
    memory: MemoryPlan | None = None,
    shape: ModelShape | None = None,
) -> tuple[list[int], dict[int, str]]:
    """The global batch sizes from the adaptive start to the target that the node schedule can place at
    `micro_batch_size` (on some allowed node count up to the target's), ascending; and, given the plan's
    `memory` and the model's `shape`, the placeable sizes left out because their stage would not fit the
    device (fsdp's share of the model grows on fewer nodes), each with the reason in one line."""
    rule = adaptive_rule(config)
    target_nodes = build_plan(config, micro_batch_size=micro_batch_size).stages[-1].num_nodes
    where = placement(config) | {"max_nodes": target_nodes}
    accepted: list[int] = []
    too_big: dict[int, str] = {}
    doubling = config.batch.rampup.adaptive.doubling  # type: ignore[union-attr]
    for size in range(rule.start, rule.target + 1):
        if size % micro_batch_size:
            continue
        if doubling and size != rule.target and not _is_doubling(size, rule.start):
            continue
        nodes = walk_nodes(batch_sizes=[size], micro_batch_size=micro_batch_size, **where)[0]
        if nodes is None:
            continue
        why = _does_not_fit(config, memory, shape, num_nodes=nodes, micro_batch_size=micro_batch_size)
        if why is None or size == rule.target:  # the target's stage was checked with the plan
            accepted.append(size)
        else:
            too_big[size] = why
    return accepted, too_big


def _is_doubling(size: int, start: int) -> bool:
    """Whether `size` is start x 2^k."""
    ratio, remainder = divmod(size, start)
    return remainder == 0 and ratio & (ratio - 1) == 0


def _does_not_fit(
    config: Config,
    memory: MemoryPlan | None,
    shape: ModelShape | None,
    *,
    num_nodes: int,
    micro_batch_size: int,
) -> str | None:
    """Why a stage on `num_nodes` would not fit the device under the plan's strategy (None: it fits, or
    memory is unknown), with the activations the plan estimated for its first stage."""
    if memory is None or shape is None or memory.device_memory_bytes is None or not memory.stages:
        return None
    estimate = _estimate_like(
        config, memory.stages[0].estimate, shape=shape, strategy=memory.strategy,
        world_size=num_nodes * config.cluster.devices_per_node, micro_batch_size=micro_batch_size,
    )  # fmt: skip
    if estimate.total <= memory.device_memory_bytes:
        return None
    return (
        f"on {num_nodes} node(s) it needs {estimate.describe()} per device under {memory.strategy} (shard "
        f"degree {estimate.shard_degree}), more than the device's {memory.device_memory_bytes / 2**30:.1f} GiB"
    )


def adaptive_run(
    config: Config,
    *,
    micro_batch_size: int,
    decisions: Sequence[StageDecision],
    accepted: Sequence[int] | None = None,
) -> AdaptiveRun:
    """The adaptive ramp-up's rule, the accepted sizes (`accepted_batch_sizes` at `micro_batch_size`
    unless given: the trainer passes them without the sizes that would not fit), stage limit and
    `decisions`."""
    assert isinstance(config.batch.rampup, AdaptiveRampup)
    if accepted is None:
        accepted, _ = accepted_batch_sizes(config, micro_batch_size=micro_batch_size)
    return AdaptiveRun(
        rule=adaptive_rule(config),
        accepted=tuple(accepted),
        max_stages=config.batch.rampup.adaptive.max_stages,
        decisions=tuple(decisions),
    )
