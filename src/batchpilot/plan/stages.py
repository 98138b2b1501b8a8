"""The stages of a checked config at a micro batch: the batch schedule split into stages, each placed on its
node count (`build_plan`), the LR schedule, the stage count a compiled pipeline has, and the note on stages
whose steps cannot measure the noise scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from typing import cast

from batchpilot.config import AdaptiveRampup, Config, SeesawRampup, resolved_runtime
from batchpilot.plan.checks import SHOWN_STAGES, check_plan_config
from batchpilot.plan.schedule import batch_schedule, placement, tpu_plan_slices
from batchpilot.planning import LRSchedule, Plan, plan_stages
from batchpilot.planning.adaptive import StageDecision
from batchpilot.planning.memory import Strategy, shard_degree
from batchpilot.planning.noise import NoiseMeasurement, noise_measurement, why_unmeasured
from batchpilot.planning.rampup import seesaw_growth_cuts
from batchpilot.planning.stages import sample_ranges


def build_plan(config: Config, *, micro_batch_size: int, decisions: Sequence[StageDecision] = ()) -> Plan:
    """Validates every stage of the config's ramp-up and schedules its nodes (an adaptive ramp-up: the
    stages its `decisions` fix, the open stage and the final one).

    Raises:
        BatchpilotError: every micro-batch-independent problem (`check_plan_config`), one line each; else
            the stages this micro batch cannot place.
    """
    check_plan_config(config)
    return assemble_plan(config, micro_batch_size=micro_batch_size, decisions=decisions)


def assemble_plan(config: Config, *, micro_batch_size: int, decisions: Sequence[StageDecision] = ()) -> Plan:
    """`build_plan` of a config the plan step has checked already (a run document's): the stages at
    `micro_batch_size` and, for an adaptive ramp-up, with its `decisions` so far, without the checks."""
    plan = plan_stages(
        schedule=batch_schedule(config, decisions),
        total_samples=config.total_samples,
        micro_batch_size=micro_batch_size,
        placement=placement(config),
        lr_schedule=lr_schedule(config),
        expansion_factor=Fraction(str(config.data.expansion_factor_real_data)),
        num_pipeline_microbatches=config.batch.num_pipeline_microbatches,
        tpu=tpu_plan_slices(config),
        each_stage_alone=isinstance(config.batch.rampup, AdaptiveRampup),
    )
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
    if isinstance(config.batch.rampup, SeesawRampup):  # the LR falls by sqrt(factor) where the batch grows
        seesaw = config.batch.rampup.seesaw
        grows = seesaw_growth_cuts(
            start=seesaw.start, factor=seesaw.factor, cuts=seesaw.cuts, target=config.batch.target_bound
        )
        later = tuple(seesaw.cuts[grows:])  # the batch is the target: these cut the LR by the factor
        return LRSchedule(
            lr=train.lr, scaling="seesaw", reference_batch=seesaw.start,
            warmup_samples=train.warmup_samples, decay=train.lr_decay, decay_end_samples=total,
            min_lr_ratio=train.min_lr_ratio, lr_cuts=later or None, lr_cut_factor=seesaw.factor if later else None,
        )  # fmt: skip
    return LRSchedule(
        lr=train.lr,
        scaling=train.lr_scaling,
        reference_batch=train.lr_reference_batch or config.batch.target_bound,
        warmup_samples=train.warmup_samples,
        decay=train.lr_decay,
        decay_end_samples=train.lr_decay_samples or total,
        min_lr_ratio=train.min_lr_ratio,
        wsd_fraction=train.wsd_decay_fraction,
        wsd_shape=train.wsd_decay_shape,
    )


def data_parallel_shard_degree(plan: Plan, data_parallel_size: int) -> int:
    """The data-parallel ranks one parameter is sharded over in a stage of `data_parallel_size` such ranks
    (a tensor-parallel group counts once)."""
    tp = plan.tensor_parallel_size
    return shard_degree(
        cast(Strategy, plan.parallelism), world_size=data_parallel_size, devices_per_node=plan.devices_per_node // tp,
        shard_nodes=plan.hsdp_shard_nodes,
    )  # fmt: skip


def with_noise_note(config: Config, plan: Plan) -> Plan:
    """The plan with `noise_note`'s line last among its notes (when a stage cannot measure): called once the
    plan's parallelism is resolved (the rule depends on it)."""
    unmeasured = noise_note(config, plan)
    return plan if unmeasured is None else replace(plan, notes=(*plan.notes, unmeasured))


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
            strategy=strategy, world_size=stage.data_parallel_size, micro_batch_size=stage.micro_batch_size,
            accumulation=stage.gradient_accumulation_steps, split_every_steps=every,
            shard_degree=data_parallel_shard_degree(plan, stage.data_parallel_size),
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


def num_stages(config: Config) -> int:
    """How many stages the config's ramp-up has (it does not depend on the micro batch); refuses a config
    that `check_plan_config` refuses."""
    check_plan_config(config)
    if isinstance(config.batch.rampup, AdaptiveRampup):
        return config.batch.rampup.adaptive.max_stages  # decided at run time: at most this many
    return len(sample_ranges(batch_schedule(config), total_samples=config.total_samples))
