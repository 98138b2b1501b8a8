"""`batchpilot compile`: the pipeline for a config as KFP YAML (the KFP UI's upload, CI's golden files)."""

from __future__ import annotations

import argparse
from typing import Any

from batchpilot.kfp.compile import TARGETS


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
        "--image",
        help="the batchpilot image every task runs, REGISTRY/PATH:TAG or @sha256:DIGEST (default: "
        "cluster.image; a local pipeline, which kfp.local never pulls, defaults to batchpilot:<version>)",
    )
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="kfp",
        help="kfp: Kubeflow Pipelines in the cluster (the only supported target; vertex is refused, see "
        "docs/pipeline.md)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.kfp.compile import compile_file

    compile_file(args.config, args.output, image=args.image, target=args.target)
    return 0
