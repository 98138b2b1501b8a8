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
    parser.add_argument(  # new with --dry-run itself: no old spelling (`--dryrun`) to keep
        "--dry-run",
        action="store_true",
        help="compile, print the file it would write and what the pipeline holds, and write nothing",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.kfp.compile import compile_file

    check_output_file(args.out, field="--out", force=args.force)
    if args.dry_run:
        print(_dry_run(args))
        return 0
    compile_file(args.config, args.out, image=args.image, target=args.target)
    return 0


def _dry_run(args: argparse.Namespace) -> str:
    """`would write OUT (N bytes): pipeline NAME, T task(s), S stage(s) in launches ...`, having compiled it."""
    import yaml

    from batchpilot.config import load_config
    from batchpilot.kfp.compile import check_target, compile_pipeline
    from batchpilot.kfp.shape import expected_stage_count, pipeline_launch_names

    check_target(args.target)
    config = load_config(args.config)
    text = compile_pipeline(config, image=args.image, target=args.target)
    spec = next(yaml.safe_load_all(text))  # the pipeline spec; a platform spec may follow it
    dags = [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]
    num_tasks = sum(len(dag.get("tasks", {})) for dag in dags)
    return (
        f"would write {args.out} ({len(text.encode()):,} bytes): pipeline {spec['pipelineInfo']['name']}, "
        f"{num_tasks} task(s), {expected_stage_count(config)} stage(s) in launch group(s) "
        f"{', '.join(pipeline_launch_names(config))}; nothing written (--dry-run)"
    )
