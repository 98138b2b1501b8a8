"""`batchpilot plan`: config (+ micro batch) -> validated ramp-up plan, as a table or plan.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from batchpilot.config import Config, load_config
from batchpilot.errors import BatchpilotError
from batchpilot.planner import build_plan, dump_plan, micro_batch_from_explore, resolve_micro_batch_size
from batchpilot.planning import CostEstimate, Plan, estimate_cost
from batchpilot.planning.units import short_count


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="turn a config into a validated ramp-up plan with node scheduling",
        description="Checks every stage for divisibility and prints the stage table (or plan.json). "
        "Nothing is launched and no accelerator is requested.",
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--micro-batch-size", type=int, help="overrides batch.micro_batch_size")
    parser.add_argument(
        "--explore", metavar="EXPLORE_JSON", help="take the micro batch and throughput from explore.json"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan.json document instead of the table"
    )
    parser.add_argument(
        "--out", help="also write plan.json to this path (refuses to overwrite unless --force)"
    )
    parser.add_argument("--force", action="store_true", help="allow --out to overwrite an existing file")
    parser.add_argument(
        "--samples-per-s-per-device",
        type=float,
        help="measured training throughput of one device, for the duration and node-hour estimate",
    )
    parser.set_defaults(handler=run)


def _from_explore(path: str) -> tuple[int, float | None]:
    """(micro batch to plan with, its measured samples/s per device) from an explore.json."""
    try:
        data = json.loads(Path(path).read_text())
        micro, note = micro_batch_from_explore(data)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BatchpilotError("--explore", f"cannot read a recommendation from {path}: {error}") from None
    if note:
        print(f"note: {note}")
    measured = [
        float(p["samples_per_s"])
        for p in data.get("probes", [])
        if p.get("fits") and p.get("micro_batch_size") == micro and p.get("samples_per_s")
    ]
    throughput = max(measured, default=None) or data["recommendation"].get("samples_per_s")
    return micro, float(throughput) if throughput else None


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    throughput = args.samples_per_s_per_device
    override = args.micro_batch_size
    if args.explore:
        explored_micro, explored_throughput = _from_explore(args.explore)
        override = override or explored_micro
        throughput = throughput or explored_throughput
    if throughput is not None and throughput <= 0:
        raise BatchpilotError("--samples-per-s-per-device", f"must be positive, got {throughput}")
    micro = resolve_micro_batch_size(config, override)
    if args.out and Path(args.out).exists() and not args.force:
        raise BatchpilotError("--out", f"{args.out} exists", "choose another path or pass --force")
    plan = build_plan(config, micro_batch_size=micro)
    text = dump_plan(config, plan)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    if args.json:
        print(text, end="")
    else:
        cost = estimate_cost(plan, samples_per_s_per_device=throughput) if throughput else None
        print_plan(config, plan, cost, console=wide_console())
        if args.out:
            wide_console().print(f"wrote {args.out}")
    return 0


def wide_console() -> Console:
    """A console that does not squeeze the table into 80 columns when output is piped."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(width=140, soft_wrap=True)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f}"


def print_plan(config: Config, plan: Plan, cost: CostEstimate | None, *, console: Console) -> None:
    """The readable stage table, the batch arithmetic of the final stage, notes and the cost summary."""
    table = Table(title=f"batchpilot plan: {config.name}", title_justify="left")
    for column in ("stage", "batch", "samples", "steps", "nodes", "dp", "accum", "lr"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    if cost:
        table.add_column("est. hours", justify="right")
        table.add_column("node-hours", justify="right")
    for stage in plan.stages:
        row = [
            stage.name,
            str(stage.global_batch_size),
            f"{short_count(stage.start_sample)} - {short_count(stage.end_sample)}",
            f"{stage.num_steps:,}",
            str(stage.num_nodes),
            str(stage.data_parallel_size),
            str(stage.gradient_accumulation_steps),
            f"{stage.lr:.2e}",
        ]
        if cost:
            stage_cost = cost.stages[stage.index]
            row += [_hours(stage_cost.duration_s), f"{stage_cost.node_hours:,.2f}"]
        table.add_row(*row)
    console.print(table)
    final = plan.stages[-1]
    console.print(
        f"global_batch_size {final.global_batch_size} = micro_batch_size {final.micro_batch_size} x "
        f"data_parallel_size {final.data_parallel_size} x gradient_accumulation_steps "
        f"{final.gradient_accumulation_steps} (final stage, {final.num_nodes} node(s) x "
        f"{plan.devices_per_node} device(s))"
    )
    console.print(
        f"{len(plan.stages)} stage(s), {plan.num_steps:,} optimizer steps, {plan.trained_samples:,} samples"
    )
    for note in plan.notes:
        console.print(f"note: {note}")
    if cost:
        console.print(
            f"estimate at {cost.samples_per_s_per_device:,.1f} samples/s per device: "
            f"{_hours(cost.duration_s)} h, {cost.node_hours:,.2f} node-hours; a pool held at max_nodes="
            f"{plan.max_nodes} would cost {cost.static_pool_node_hours:,.2f} node-hours "
            f"({cost.saving_ratio:.0%} saved by resizing per stage)"
        )
    else:
        console.print(
            "add --samples-per-s-per-device (or --explore explore.json) for durations and node-hours"
        )
