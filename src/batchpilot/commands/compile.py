"""`batchpilot compile`: the pipeline for a config as KFP YAML (the KFP UI's upload, CI's golden files)."""

from __future__ import annotations

import argparse
from typing import Any

from batchpilot.commands.options import add_config, add_out
from batchpilot.files import check_output_file
from batchpilot.kfp.compile import TARGETS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compile",
        help="compile the Kubeflow pipeline for a config into a YAML file",
        description="Writes the pipeline (explore, plan, one task group per stage, report, scale-down exit "
        "handler) as KFP YAML for the KFP UI or `batchpilot submit`. Same config, same bytes.",
    )
    add_config(parser)
    add_out(
        parser,
        required=True,
        metavar="FILE",
        help="the YAML file to write (refuses to overwrite unless --force)",
    )
    parser.add_argument("--force", action="store_true", help="allow --out to overwrite an existing file")
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

    check_output_file(args.out, field="--out", force=args.force)
    compile_file(args.config, args.out, image=args.image, target=args.target)
    return 0
