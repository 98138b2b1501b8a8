"""`batchpilot explore`: the fastest micro batch that fits one device, and the gradient noise scale."""

from __future__ import annotations

import argparse
from typing import Any

from batchpilot.commands.options import add_config, add_out
from batchpilot.config import load_config
from batchpilot.errors import BatchpilotError
from batchpilot.files import check_output_dir


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "explore",
        help="measure the fastest micro batch that fits one device, and the critical batch size",
        description="Runs probes (fresh processes each: one, or a node of devices_per_node under fsdp/hsdp, "
        "as the stages run) of micro batch x activation checkpointing, prints "
        "a recommendation after every probe, then studies the effective batch at the recommended size. "
        "Writes explore.json, explore.html and explore_metrics.json.",
    )
    add_config(parser)
    add_out(parser, metavar="DIR", help="the folder the outputs go to (default: runs/<name>/explore)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace the results of an earlier exploration in --out (refused without it when explore.json "
        "is there)",
    )
    parser.add_argument("--max-probes", type=int, help="overrides explore.max_probes")
    parser.add_argument("--max-minutes", type=float, help="overrides explore.max_minutes")
    parser.add_argument(
        "--micro-batch-sizes",
        help="probe exactly these sizes for every setting, e.g. 1,2,3,4 (an exhaustive sweep, no search)",
    )
    parser.add_argument(
        "--no-study", action="store_true", help="skip the effective-batch study (default: explore.study)"
    )
    parser.add_argument(
        "--memory-budget-bytes", help="overrides explore.memory_budget_bytes (e.g. 600MiB; CPU only)"
    )
    parser.set_defaults(handler=run)


def parse_sizes(text: str | None) -> list[int] | None:
    """`1,2,3` -> [1, 2, 3]; a one-line error otherwise."""
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BatchpilotError(
            "--micro-batch-sizes", f"{text!r} is not a comma-separated list of integers", "e.g. 1,2,4,8"
        ) from None
    if not sizes or min(sizes) <= 0:
        raise BatchpilotError("--micro-batch-sizes", f"needs positive integers, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    from batchpilot.planning.units import parse_bytes
    from batchpilot.workflow.explore import explore

    config = load_config(args.config)
    output_dir = check_output_dir(args.out or f"runs/{config.name}/explore", field="--out")
    if (output_dir / "explore.json").exists() and not args.force:
        raise BatchpilotError(
            "--out",
            f"{output_dir} already holds explore.json (an earlier exploration)",
            "pass --force to replace it, or choose another folder with --out",
        )
    if args.memory_budget_bytes is not None:
        budget = parse_bytes(args.memory_budget_bytes, field="--memory-budget-bytes")
        config = config.model_copy(
            update={"explore": config.explore.model_copy(update={"memory_budget_bytes": budget})}
        )
    result = explore(
        config,
        output_dir=output_dir,
        max_probes=args.max_probes,
        max_minutes=args.max_minutes,
        micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
        study=False if args.no_study else None,
    )
    _summary(result)
    return 0


def _summary(result: Any) -> None:
    from batchpilot.explore.study import format_samples

    rec = result.recommendation
    print(
        f"\nexplore finished ({result.stopped_because}) after {len(result.probes)} probes in {result.elapsed_s:.0f} s"
    )
    print(rec.line().replace("current recommendation", "recommendation"))
    for line in rec.reasoning + rec.plan_notes:
        print(f"  {line}")
    if result.noise_scale is not None:
        noise = result.noise_scale
        if noise.critical_batch_size:
            critical = format_samples(noise.critical_batch_size)
        elif noise.critical_batch_at_most:
            critical = f"not measurable (at most {noise.critical_batch_at_most}, the smallest batch measured)"
        else:
            critical = "not measurable"
        print(
            f"critical batch size {critical}; recommended global batch "
            f"{noise.recommended_global_batch_size or '-'}; LR scaling {noise.lr_scaling}"
        )
        for line in noise.reasoning:
            print(f"  {line}")
    for name in ("explore.json", "explore.html", "explore_metrics.json"):
        print(f"wrote {result.output_dir / name}")
