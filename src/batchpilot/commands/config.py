"""`batchpilot config schema|check`: the config's JSON Schema, and validating a file."""

from __future__ import annotations

import argparse
import json
from typing import Any

from batchpilot.config import config_schema, load_config
from batchpilot.errors import BatchpilotError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print the config JSON Schema or check a config file",
        description="The config file: its JSON Schema, and the checks every command runs on it.",
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    schema = actions.add_parser(
        "schema",
        help="print the JSON Schema of the config file",
        description="Prints the config's JSON Schema (unknown keys are errors) on stdout, for editors and CI.",
    )
    schema.set_defaults(handler=_schema)
    check = actions.add_parser(
        "check",
        help="validate a config file; exit 2 with one line per problem",
        description="Runs the checks that `plan` and `compile` run first, before any accelerator is asked "
        "for, and prints one line: ok with the stage count, or one error line per problem (exit 2).",
    )
    check.add_argument("--config", metavar="FILE", help="YAML config file (required)")
    # The old spelling, `config check FILE`: still taken, not shown.
    check.add_argument("file", nargs="?", help=argparse.SUPPRESS)
    check.set_defaults(handler=_check)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_schema(), indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    from batchpilot.kfp.shape import expected_stage_count
    from batchpilot.planning.units import format_bytes
    from batchpilot.workflow.plan import check_data, preflight

    path = _config_path(args)
    config = load_config(path)
    document = preflight(config)
    check_data(config)
    if config.batch.global_batch_size == "auto":
        detail = (
            f"global_batch_size auto: explore's study sets it, at most {config.batch.target_bound}; the stages "
            "at that bound are placeable, the chosen target's are checked when it is planned"
        )
    elif document is None:
        count = expected_stage_count(config)
        detail = (
            f"{count} stage(s), each placeable at some micro batch; their divisibility at the chosen micro "
            "batch is checked once it is explored"
        )
    else:
        detail = f"{len(document.plan.stages)} stage(s) valid, parallelism {document.plan.parallelism}"
        if document.memory is not None:
            detail += f" at most {format_bytes(document.memory.peak.estimate.total)} per device"
    print(f"{path}: ok (name={config.name}, {config.total_samples:,} samples, {detail})")
    return 0


def _config_path(args: argparse.Namespace) -> str:
    if args.config and args.file and args.config != args.file:
        raise BatchpilotError(
            "--config", f"two config files given ({args.config} and {args.file})", "give one"
        )
    path = args.config or args.file
    if not path:
        raise BatchpilotError("--config", "is required", "batchpilot config check --config FILE")
    return str(path)
