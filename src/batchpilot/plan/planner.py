"""Checked config (+ exploration) -> the run document, read top to bottom: `make_run_document` is the flow,
and the one place where the plan's micro batch is decided; the functions below it follow in the order it
calls them.

The config is checked first (`plan.checks`: every problem that no micro batch can fix, one line each; the
exploration against the config, `plan.inputs`); what follows assembles the plan from narrow arguments
(`plan.schedule` reads the ramp-up and the node placement, `plan.stages` places the stages, `plan.memory`
sizes them, `plan.targets` resolves an `auto` target and plans the trials) and trusts a checked config.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.checks import plan_problems
from batchpilot.plan.inputs import explore_problems
from batchpilot.plan.memory import memory_plan, stage_estimate
from batchpilot.plan.rundoc import MicroBatchSource, RunDocument
from batchpilot.plan.stages import build_plan, with_noise_note
from batchpilot.plan.targets import at_trials_bound, resolve_auto_target, resolve_trials_target, trials_for
from batchpilot.planning import estimate_cost
from batchpilot.planning.batch import raise_problems
from batchpilot.planning.memory import MemoryPlan, check_shard_nodes
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.stages import Plan, Stage, faster_micro_batches
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan
from batchpilot.planning.units import format_node_hours, format_number


def context_problems(config: Config, shape: ModelShape | None) -> list[BatchpilotError]:
    """A data.seq_len longer than the model takes (it would fail at the first training step)."""
    context = shape.context_length if shape is not None else None
    seq_len = config.data.seq_len
    if context is None or seq_len <= context:
        return []
    key = next((k for k in ("block_size", "max_seq_len") if k in config.model.args), None)
    where = f"model.args.{key}" if key else "the model's context length"
    return [
        BatchpilotError(
            "data.seq_len",
            f"is {seq_len:,} tokens, but the model takes at most {context:,} ({where})",
            f"set data.seq_len to at most {context:,}, or raise {where if key else 'the context length'} to "
            f"{seq_len:,}",
        )
    ]


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
    raise_problems(
        plan_problems(config) + explore_problems(config, explore) + context_problems(config, shape)
    )
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
    if config.train.hsdp_shard_nodes is not None:
        check_shard_nodes(plan.stages, config.train.hsdp_shard_nodes)
    memory = memory_plan(config, plan, shape=shape, explore=explore) if shape is not None else None
    if source == "explore" and explore is not None and not plan.stage_per_launch:
        plan, memory, faster_notes = with_faster_stage_micro_batches(
            config, plan, memory=memory, shape=shape, explore=explore
        )
        notes += faster_notes
    requested = config.train.parallelism
    plan = replace(
        plan,
        parallelism=memory.strategy
        if memory
        else auto_without_memory(config)
        if requested == "auto"
        else requested,
        hsdp_shard_nodes=memory.shard_nodes if memory else config.train.hsdp_shard_nodes or 1,
    )
    plan = with_noise_note(config, plan)
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


def explored_speeds(
    explore: dict[str, Any], *, activation_checkpointing: bool, compile: bool
) -> dict[int, float]:
    """Per micro batch of one setting, explore's throughput per device: the median of its probes' ratios to the
    base probe, measured pass by pass in one process (steady on a machine whose speed drifts), when every probe
    of the setting has one; else the median of their samples/s."""
    fitting = [p for p in explore.get("probes", []) if p.get("fits") and p.get("samples_per_s")]
    base = fitting[0] if fitting else None  # the first fitting probe is every pair's reference
    mine = [
        p
        for p in fitting
        if bool(p.get("activation_checkpointing")) == activation_checkpointing
        and bool(p.get("compile")) == compile
    ]
    paired = all(p is base or p.get("relative_throughput") for p in mine)
    values: dict[int, list[float]] = {}
    for probe in mine:
        value = (
            (1.0 if probe is base else float(probe["relative_throughput"]))
            if paired
            else float(probe["samples_per_s"])
        )
        values.setdefault(int(probe["micro_batch_size"]), []).append(value)
    return {micro: statistics.median(found) for micro, found in values.items()}


def with_faster_stage_micro_batches(
    config: Config,
    plan: Plan,
    *,
    memory: MemoryPlan | None,
    shape: ModelShape | None,
    explore: dict[str, Any],
) -> tuple[Plan, MemoryPlan | None, list[str]]:
    """The plan with each stage on the fastest micro batch explore measured that splits its batch and fits its
    devices (`planning.stages.faster_micro_batches`), the memory estimated again for them, and a note naming
    the stages that changed. Explore's fitting probes ran on one node, where a device holds at least as much
    of the model as on any stage's; the memory model checks each stage under the plan's strategy too."""
    speeds = explored_speeds(
        explore, activation_checkpointing=config.train.activation_checkpointing, compile=config.train.compile
    )

    def fits(stage: Stage, micro: int) -> bool:
        if memory is None or shape is None or memory.device_memory_bytes is None:
            return True
        estimate = stage_estimate(
            config, memory, shape=shape, stage=stage, micro_batch_size=micro, explore=explore
        )
        return estimate.total <= memory.device_memory_bytes

    stages = faster_micro_batches(plan.stages, speeds=speeds, base=plan.micro_batch_size, fits=fits)
    changed = [(old, new) for old, new in zip(plan.stages, stages, strict=True) if old != new]
    if not changed:
        return plan, memory, []
    plan = replace(plan, stages=stages)
    if shape is not None:
        memory = memory_plan(config, plan, shape=shape, explore=explore)
    base = speeds[plan.micro_batch_size]
    described = ", ".join(
        f"{new.name} at {new.micro_batch_size} ({speeds[new.micro_batch_size] / base:.2f}x)"
        for _, new in changed
    )
    return (
        plan,
        memory,
        [
            f"stages whose batch splits into a faster measured micro batch train with it: {described} the plan's "
            f"micro_batch_size {plan.micro_batch_size} per device (explore's throughput)"
        ],
    )


def explore_summary(explore: dict[str, Any]) -> dict[str, Any]:
    """What a run document keeps of explore.json: its recommendation and noise-scale estimate."""
    return {
        "recommendation": explore.get("recommendation"),
        "noise_scale": explore.get("noise_scale"),
        "num_probes": len(explore.get("probes", [])),
        "device": explore.get("device"),
    }


# --- other entry points -------------------------------------------------------------------------------------


# --- the adaptive ramp-up -----------------------------------------------------------------------------------


def auto_without_memory(config: Config) -> str:
    """`train.parallelism: auto` with no model shape to estimate: ddp, or hsdp under tensor parallelism (ddp
    does not take its parameters)."""
    return "ddp" if config.train.tensor_parallel_size == 1 else "hsdp"
