"""`batchpilot compile`: the pipeline for a config as KFP YAML (the KFP UI's upload, CI's golden files)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compile",
        help="compile the Kubeflow pipeline for a config into a YAML file",
        description="Writes the pipeline (explore, plan, one task group per stage, report, scale-down exit "
        "handler) as KFP YAML for the KFP UI or `batchpilot submit`. Same config, same bytes.",
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--output", required=True, help="the YAML file to write")
    parser.add_argument(
        "--image", help="the batchpilot image every component runs (default: batchpilot:<version>)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.kfp.compile import compile_file

    compile_file(args.config, args.output, image=args.image)
    return 0
