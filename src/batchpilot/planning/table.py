"""The stage table as one model (columns and formatted cells) that every view renders: the CLI's
table, the Markdown plan the KFP UI shows, and the HTML report."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.planning.cost import CostEstimate
from batchpilot.planning.launches import launch_summary
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.stages import Plan
from batchpilot.planning.units import (
    format_bytes,
    format_duration,
    format_node_hours,
    format_number,
    short_count,
)


@dataclass(frozen=True)
class Column:
    name: str
    align: str  # "left" | "right"


@dataclass(frozen=True)
class PlanTable:
    """Header, rows of formatted cells, and the lines that belong under the table."""

    columns: tuple[Column, ...]
    rows: tuple[tuple[str, ...], ...]
    footer: tuple[str, ...]


def plan_table(plan: Plan, cost: CostEstimate | None = None, memory: MemoryPlan | None = None) -> PlanTable:
    """The stage table of `plan`, with duration and node-hour columns when `cost` is given and the
    per-device memory estimate when `memory` is."""
    tpu = any(stage.tpu_topology for stage in plan.stages)
    names = ["stage", "batch", "samples", "steps", "nodes", *(["slice"] if tpu else []), "dp", "micro"]
    names += ["accum", "lr"]
    if memory is not None:
        names += ["mem/device"]
    if cost is not None:
        names += ["est. time", "node-hours"]
    columns = tuple(Column(name, "left" if name == "stage" else "right") for name in names)
    rows = []
    for stage in plan.stages:
        row = [
            stage.name,
            str(stage.global_batch_size),
            f"{short_count(stage.start_sample)} - {short_count(stage.end_sample)}",
            f"{stage.num_steps:,}",
            str(stage.num_nodes),
            *([stage.tpu_topology or ""] if tpu else []),
            str(stage.data_parallel_size),
            str(stage.micro_batch_size),
            str(stage.gradient_accumulation_steps),
            f"{stage.lr:.2e}",
        ]
        if memory is not None:
            row += [format_bytes(memory.stages[stage.index].estimate.total)]
        if cost is not None:
            stage_cost = cost.stages[stage.index]
            row += [format_duration(stage_cost.duration_s), format_node_hours(stage_cost.node_hours)]
        rows.append(tuple(row))
    return PlanTable(columns=columns, rows=tuple(rows), footer=plan_footer(plan, cost, memory))


def memory_line(plan: Plan, memory: MemoryPlan) -> str:
    """The strategy and the per-device memory of the stage where it peaks, against the device's."""
    peak = memory.peak
    estimate = peak.estimate
    spread = (
        "full replicas"
        if estimate.shard_degree == 1
        else f"sharded {estimate.shard_degree} ways"
        + (
            (
                " within a node"
                if plan.hsdp_shard_nodes == 1
                else f" within groups of {plan.hsdp_shard_nodes} nodes"
            )
            if plan.parallelism == "hsdp"
            else ""
        )
    )
    if estimate.tensor_parallel_size > 1:
        spread += f", each block split {estimate.tensor_parallel_size} ways within a node (tensor parallel)"
    device = (
        f" of the device's {format_bytes(memory.device_memory_bytes)}"
        if memory.device_memory_bytes
        else " (device memory unknown: set cluster.device_memory_bytes to check it)"
    )
    return (
        f"parallelism {plan.parallelism} ({spread}): {estimate.describe()} per device at {peak.stage}{device}"
    )


def plan_footer(plan: Plan, cost: CostEstimate | None, memory: MemoryPlan | None = None) -> tuple[str, ...]:
    """The final stage's batch arithmetic, the totals, the launches, the plan's notes and the cost summary."""
    final = plan.stages[-1]
    lines = [
        f"global_batch_size {final.global_batch_size} = micro_batch_size {final.micro_batch_size} x "
        f"data_parallel_size {final.data_parallel_size} x gradient_accumulation_steps "
        f"{final.gradient_accumulation_steps} (final stage, {final.num_nodes} node(s) x "
        f"{plan.devices_per_node} device(s)"
        + (f" / tensor_parallel_size {plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else "")
        + ")",
        f"{len(plan.stages)} stage(s), {plan.num_steps:,} optimizer steps, {plan.trained_samples:,} samples",
        # A launch is one job: consecutive stages on one node count need no resize or restart between them.
        launch_summary(plan),
    ]
    if memory is not None:
        lines.append(memory_line(plan, memory))
    lines += [f"note: {note}" for note in plan.notes]
    if cost is not None:
        lines.append(
            f"estimate at {format_number(cost.samples_per_s_per_device)} samples/s per device: "
            f"{format_duration(cost.duration_s)}, {format_node_hours(cost.node_hours)} node-hours; a pool held at "
            f"max_nodes={plan.max_nodes} would cost {format_node_hours(cost.static_pool_node_hours)} node-hours "
            f"({cost.saving_ratio:.0%} saved by resizing per stage)"
        )
    return tuple(lines)
