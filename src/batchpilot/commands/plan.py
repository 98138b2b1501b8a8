"""`batchpilot plan`: config (+ micro batch) -> validated ramp-up plan, as a table or plan.json."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from batchpilot.commands.options import add_config, add_out
from batchpilot.config import load_config
from batchpilot.files import check_output_file, write_atomically
from batchpilot.planning import CostEstimate, Plan
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.table import plan_table


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="turn a config into a validated ramp-up plan with node scheduling",
        description="Checks every stage for divisibility and prints the stage table (or plan.json). "
        "Nothing is launched and no accelerator is requested.",
    )
    add_config(parser)
    parser.add_argument("--micro-batch-size", type=int, help="overrides batch.micro_batch_size")
    parser.add_argument(
        "--explore", metavar="EXPLORE_JSON", help="take the micro batch and throughput from explore.json"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan.json document instead of the table"
    )
    add_out(
        parser, metavar="FILE", help="also write plan.json to this file (refuses to overwrite unless --force)"
    )
    parser.add_argument("--force", action="store_true", help="allow --out to overwrite an existing file")
    parser.add_argument(
        "--samples-per-s-per-device",
        type=float,
        help="measured training throughput of one device, for the duration and node-hour estimate",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.logs import configure_console
    from batchpilot.workflow.explore import read_explore
    from batchpilot.workflow.plan import check_data, plan

    if args.json:  # stdout carries the document alone; notes go to stderr
        configure_console(stream=sys.stderr)
    config = load_config(args.config)
    explore = read_explore(args.explore) if args.explore else None
    if args.out:
        check_output_file(args.out, field="--out", force=args.force)
    document = plan(
        config,
        micro_batch_size=args.micro_batch_size,
        explore=explore,
        samples_per_s_per_device=args.samples_per_s_per_device,
    )
    check_data(config)  # before anything is written
    text = document.to_json()
    if args.out:
        write_atomically(args.out, text)
    if args.json:
        print(text, end="")
        return 0
    console = wide_console()
    print_plan(config.name, document.plan, document.cost, document.memory, console=console)
    if document.cost is None:
        console.print(
            "add --samples-per-s-per-device (or --explore explore.json) for durations and node-hours"
        )
    if args.out:
        console.print(f"wrote {args.out}")
    return 0


def wide_console() -> Console:
    """A console that does not squeeze the table into 80 columns when output is piped."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(width=140, soft_wrap=True)


def print_plan(
    name: str, plan: Plan, cost: CostEstimate | None, memory: MemoryPlan | None = None, *, console: Console
) -> None:
    """The stage table (the one plan-table model, rendered with rich) and its footer lines."""
    model = plan_table(plan, cost, memory)
    table = Table(title=f"batchpilot plan: {name}", title_justify="left")
    for column in model.columns:
        table.add_column(column.name, justify="left" if column.align == "left" else "right")
    for row in model.rows:
        table.add_row(*row)
    console.print(table)
    for line in model.footer:
        console.print(line, markup=False)
