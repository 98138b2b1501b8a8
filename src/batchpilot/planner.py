"""Config -> plan: reads the config tree and calls the pure planning functions with narrow arguments."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

from batchpilot import __version__
from batchpilot.config import Config, MaxTextRampup, MegatronRampup
from batchpilot.errors import BatchpilotError
from batchpilot.planning import (
    BatchSchedule,
    LRSchedule,
    Plan,
    constant_schedule,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
    plan_stages,
)

PLAN_FORMAT_VERSION = 1


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


def resolve_micro_batch_size(config: Config, override: int | None) -> int:
    """The micro batch from the command line, else from the config; `explore` needs one of the two."""
    if override is not None:
        if override <= 0:
            raise BatchpilotError("--micro-batch-size", f"must be positive, got {override}")
        return override
    if config.batch.micro_batch_size == "explore":
        raise BatchpilotError(
            "batch.micro_batch_size",
            "is 'explore', so the plan needs a measured micro batch",
            "pass --micro-batch-size N or --explore explore.json, or set an integer in the config",
        )
    return config.batch.micro_batch_size


def micro_batch_from_explore(explore: dict[str, Any]) -> tuple[int, str | None]:
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


def plan_document(config: Config, plan: Plan) -> dict[str, Any]:
    """The `plan.json` contract: format version, resolved config, and the ordered stages."""
    return {
        "format_version": PLAN_FORMAT_VERSION,
        "batchpilot_version": __version__,
        "config": config.model_dump(mode="json"),
        **plan.to_dict(),
    }


def dump_plan(config: Config, plan: Plan) -> str:
    """Deterministic JSON text of the plan document (same input, same bytes)."""
    return json.dumps(plan_document(config, plan), indent=2, sort_keys=False) + "\n"


def load_plan(text: str) -> tuple[Config, Plan]:
    """Reads a plan.json document back into its config and plan."""
    from batchpilot.config import parse_config

    data = json.loads(text)
    if data.get("format_version") != PLAN_FORMAT_VERSION:
        raise BatchpilotError(
            "plan.format_version",
            f"is {data.get('format_version')!r}, this batchpilot reads {PLAN_FORMAT_VERSION}",
            "re-run `batchpilot plan` with this version",
        )
    return parse_config(data["config"]), Plan.from_dict(data)
