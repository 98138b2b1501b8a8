"""Config (+ exploration) -> plan: reads the config tree and calls the pure planning functions with narrow
arguments. `make_run_document` is the one place where the plan's micro batch is decided."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from batchpilot.config import Config, MaxTextRampup, MegatronRampup
from batchpilot.errors import BatchpilotError
from batchpilot.planning import (
    BatchSchedule,
    LRSchedule,
    Plan,
    constant_schedule,
    estimate_cost,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
    plan_stages,
)
from batchpilot.planning.stages import sample_ranges
from batchpilot.rundoc import MicroBatchSource, RunDocument


def batch_schedule(config: Config) -> BatchSchedule:
    """The global batch size as a function of consumed samples, from whichever ramp-up form is set."""
    batch = config.batch
    target = batch.global_batch_size
    if isinstance(batch.rampup, MegatronRampup):
        return megatron_rampup(
            start=batch.rampup.start,
            increment=batch.rampup.increment,
            ramp_samples=batch.rampup.samples,
            target=target,
        )
    if isinstance(batch.rampup, MaxTextRampup):
        return maxtext_rampup(
            per_device_start=Fraction(str(batch.rampup.per_device_start)),
            per_device_increment=Fraction(str(batch.rampup.per_device_increment)),
            ramp_samples=batch.rampup.samples,
            target=target,
            num_devices=config.cluster.max_nodes * config.cluster.devices_per_node,
        )
    if batch.schedule is not None:
        return explicit_schedule(batch.schedule, target=target, seq_len=config.data.seq_len)
    return constant_schedule(target)


def lr_schedule(config: Config) -> LRSchedule:
    train = config.train
    total = config.total_samples
    return LRSchedule(
        lr=train.lr,
        scaling=train.lr_scaling,
        reference_batch=train.lr_reference_batch or config.batch.global_batch_size,
        warmup_samples=train.warmup_samples,
        decay=train.lr_decay,
        decay_end_samples=train.lr_decay_samples or total,
        min_lr_ratio=train.min_lr_ratio,
    )


def build_plan(config: Config, *, micro_batch_size: int) -> Plan:
    """Validates every stage of the config's ramp-up and schedules its nodes."""
    return plan_stages(
        schedule=batch_schedule(config),
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
    )


def num_stages(config: Config) -> int:
    """How many stages the config's ramp-up has (it does not depend on the micro batch)."""
    return len(sample_ranges(batch_schedule(config), total_samples=config.total_samples))


def explored_micro_batch(explore: dict[str, Any]) -> tuple[int, str | None]:
    """The micro batch a plan takes from explore.json, and a note when it is not the fastest measured.

    The fastest size may not fit every ramp-up stage; explore then names the fastest one that does
    (`plan_compatible_micro_batch_size`), and that is the one to plan with.
    """
    recommendation = explore["recommendation"]
    fastest = int(recommendation["micro_batch_size"])
    compatible = recommendation.get("plan_compatible_micro_batch_size")
    if compatible is None or int(compatible) == fastest:
        return fastest, None
    return int(compatible), (
        f"explore's fastest micro_batch_size={fastest} does not fit every stage of this ramp-up; planning with "
        f"micro_batch_size={compatible}, the fastest measured size that does"
    )


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


def choose_micro_batch(
    config: Config, *, override: int | None, explore: dict[str, Any] | None
) -> tuple[int, MicroBatchSource, list[str]]:
    """The plan's micro batch, where it came from, and notes: the one rule the CLI and the pipeline share.

    An explicit override (`--micro-batch-size`, the pipeline's `micro_batch_size` parameter) comes first,
    then an integer in the config, then the exploration (when the config says `explore`).
    """
    notes: list[str] = []
    explored, explored_note = explored_micro_batch(explore) if explore is not None else (None, None)
    if override is not None:
        if override <= 0:
            raise BatchpilotError("--micro-batch-size", f"must be positive, got {override}")
        micro, source = override, "override"
    elif config.batch.micro_batch_size != "explore":
        micro, source = config.batch.micro_batch_size, "config"
    elif explored is not None:
        micro, source = explored, "explore"
        notes += [explored_note] if explored_note else []
    else:
        raise BatchpilotError(
            "batch.micro_batch_size",
            "is 'explore', so the plan needs a measured micro batch",
            "pass --micro-batch-size N or --explore explore.json, or set an integer in the config",
        )
    if explored is not None and source != "explore" and explored != micro:
        notes.append(f"explore recommends micro_batch_size={explored}; the {source}'s {micro} stands")
    return micro, source, notes  # type: ignore[return-value]


def explore_summary(explore: dict[str, Any]) -> dict[str, Any]:
    """What a run document keeps of explore.json: its recommendation and noise-scale estimate."""
    return {
        "recommendation": explore.get("recommendation"),
        "noise_scale": explore.get("noise_scale"),
        "num_probes": len(explore.get("probes", [])),
        "device": explore.get("device"),
    }


def make_run_document(
    config: Config,
    *,
    micro_batch_size: int | None = None,
    explore: dict[str, Any] | None = None,
    samples_per_s_per_device: float | None = None,
) -> RunDocument:
    """Config (+ explore.json, + an override) -> the validated run document with every stage.

    Args:
        config: the resolved config.
        micro_batch_size: an explicit override of the micro batch (None: the config's, else explore's).
        explore: the parsed explore.json, when an exploration ran.
        samples_per_s_per_device: throughput for the cost estimate (default: explore's measurement).
    """
    micro, source, notes = choose_micro_batch(config, override=micro_batch_size, explore=explore)
    if samples_per_s_per_device is not None and samples_per_s_per_device <= 0:
        raise BatchpilotError(
            "--samples-per-s-per-device", f"must be positive, got {samples_per_s_per_device}"
        )
    plan = build_plan(config, micro_batch_size=micro)
    throughput = samples_per_s_per_device
    if throughput is None and explore is not None:
        throughput = explored_throughput(explore, micro_batch_size=micro)
    return RunDocument(
        config=config,
        plan=plan,
        micro_batch_source=source,
        explore=explore_summary(explore) if explore is not None else None,
        cost=estimate_cost(plan, samples_per_s_per_device=throughput) if throughput else None,
        notes=tuple(notes),
    )
