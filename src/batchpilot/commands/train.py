"""`batchpilot train` (one rank, under torchrun) and `batchpilot launch` (a stage through torchx).

Both take the run document (`plan.json` of `batchpilot plan --out`): it carries the resolved config.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

from batchpilot.commands.options import add_dry_run, add_out
from batchpilot.errors import BatchpilotError
from batchpilot.files import check_output_dir
from batchpilot.plan.rundoc import RunDocument, read_run_document

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    train = subparsers.add_parser(
        "train",
        help="train stage(s) of a plan in this process (one rank; run under torchrun or `batchpilot launch`)",
        description="Resumes from the checkpoint `latest`, trains to the stage's end sample, checkpoints and "
        "exits 0. SIGTERM checkpoints at the end of the current step and exits 75.",
    )
    _common(
        train,
        stage_help="stage index or name (`stage-1`, `final`), a range A-B of stages on one node count (one "
        "launch) or its name (e.g. stages-0-3; `batchpilot plan` lists them), or `all` (every stage in one job)",
    )
    train.set_defaults(handler=run_train)
    launch = subparsers.add_parser(
        "launch",
        help="run a stage, or a launch (consecutive stages on one node count), on its planned node count "
        "through torchx (local_cwd: a node = local processes; gke: a JobSet or Volcano Job)",
        description="Starts `batchpilot train` for the chosen stages on their planned node count (the pool "
        "is resized by `batchpilot pool resize`, not here). Local backend: one torchx local_cwd job, a node "
        "being devices_per_node processes on this machine; gke: a JobSet or Volcano Job carrying the plan. "
        "Exits 0 when the stages are trained, 75 when preempted, 1 on failure.",
    )
    _common(
        launch,
        stage_help="stage index or name (`stage-1`, `final`), a range A-B of stages on one node count, or a "
        "launch's name (e.g. stages-0-3; `batchpilot plan` lists them)",
    )
    launch.add_argument("--log-dir", metavar="DIR", help="torchx log folder (default: OUT/torchx)")
    add_dry_run(launch, help="gke: print the JobSet or Volcano Job as YAML and exit, without any API call")
    launch.set_defaults(handler=run_launch)


def _common(parser: argparse.ArgumentParser, *, stage_help: str) -> None:
    parser.add_argument(
        "--plan", required=True, metavar="FILE", help="the run document, plan.json of `batchpilot plan --out`"
    )
    parser.add_argument("--stage", required=True, help=stage_help)
    add_out(parser, metavar="DIR", help="the folder metrics.jsonl and logs go to (default: runs/<name>)")
    parser.add_argument(
        "--audit", action="store_true", help="record the sample positions each rank trained (OUT/audit)"
    )


STAGE_NAME = re.compile(r"stage-(\d+)|stages-(\d+)-(\d+|final)")
"""The plan's names of a stage (`stage-1`) and of a launch of several (`stages-0-2`, `stages-3-final`)."""


def stage_arg(text: str) -> str:
    """`--stage` as the plan selects stages: a stage's or a launch's name (`stage-1`, `stages-0-2`) becomes
    the index or range it names (`1`, `0-2`); an index, `final`, a range and `all` are kept."""
    match = STAGE_NAME.fullmatch(text)
    if not match:
        return text
    index, first, last = match.groups()
    return index if index is not None else f"{first}-{last}"


def selected_stage(text: str, document: RunDocument) -> str:
    """`stage_arg(text)`, refused in one line naming `text` as the user gave it when the plan has no such
    stage (`'stage-9' is not a stage of this plan`, not the index it became). An adaptive ramp-up's stages
    are decided as it trains: its provisional plan does not list them, `adaptive_stage` checks them."""
    from batchpilot.plan.adaptive import is_adaptive

    stage = stage_arg(text)
    if is_adaptive(document.config):
        return stage
    try:
        document.plan.select(stage, allow_all=True)
    except BatchpilotError as error:
        raise BatchpilotError(error.field, f"{text!r} is not a stage of this plan", error.fix) from None
    return stage


def run_train(args: argparse.Namespace) -> int:
    from batchpilot.config import resolved_runtime
    from batchpilot.plan.adaptive import is_adaptive
    from batchpilot.train.accelerators import require_planned_accelerator
    from batchpilot.train.trainer import train
    from batchpilot.workflow.stage import adaptive_stage

    document = read_run_document(args.plan)
    args.stage = selected_stage(args.stage, document)
    cluster = document.config.cluster
    # Before anything reads the checkpoints or joins a process group: a GPU or TPU plan without its
    # devices refuses in one line instead of training on the CPU while the pool bills.
    require_planned_accelerator(
        accelerator_type=cluster.accelerator_type,
        runtime=resolved_runtime(document.config),
    )
    output_dir = check_output_dir(args.out or f"runs/{document.config.name}", field="--out")
    adaptive = None
    if is_adaptive(document.config):
        document, adaptive = adaptive_stage(document, stage=args.stage)
    return train(
        config=document.config,
        plan=document.plan,
        stage=args.stage,
        output_dir=output_dir,
        audit=args.audit,
        adaptive=adaptive,
    )


def run_launch(args: argparse.Namespace) -> int:
    # No trainer import here: a launcher (a pipeline task, a laptop) needs no torch.
    from batchpilot.logs import configure_console
    from batchpilot.workflow.stage import render_stage_job, run_stage

    document = read_run_document(args.plan)
    args.stage = selected_stage(args.stage, document)
    if args.dry_run:
        configure_console(stream=sys.stderr)  # stdout carries the YAML alone
        print(render_stage_job(document, stage=args.stage, audit=args.audit), end="")
        return 0
    return run_stage(
        document,
        stage=args.stage,
        work_dir=check_output_dir(args.out, field="--out") if args.out else None,
        audit=args.audit,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
