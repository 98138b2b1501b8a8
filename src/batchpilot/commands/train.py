"""`batchpilot train` (one rank, under torchrun) and `batchpilot launch` (a stage through torchx)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from batchpilot.config import Config, load_config
from batchpilot.errors import BatchpilotError
from batchpilot.planner import build_plan, load_plan
from batchpilot.planning import Plan, Stage


def register(subparsers: Any) -> None:
    train = subparsers.add_parser(
        "train",
        help="train stage(s) of a plan in this process (one rank; run under torchrun or `batchpilot launch`)",
        description="Resumes from the checkpoint `latest`, trains to the stage's end sample, checkpoints and "
        "exits 0. SIGTERM checkpoints at the next micro-batch boundary and exits 75.",
    )
    _common(train)
    train.set_defaults(handler=run_train)
    launch = subparsers.add_parser(
        "launch",
        help="run a stage on its planned node count through torchx (local_cwd: a node = local processes; "
        "gke: a JobSet or Volcano Job)",
    )
    _common(launch)
    launch.add_argument("--log-dir", help="torchx log folder (default: OUTPUT_DIR/torchx)")
    launch.add_argument(
        "--dryrun",
        action="store_true",
        help="gke: print the JobSet or Volcano Job as YAML and exit, without any API call",
    )
    launch.set_defaults(handler=run_launch)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--plan", required=True, help="plan.json from `batchpilot plan --out`")
    parser.add_argument(
        "--stage", required=True, help="stage index, `final`, or `all` (every stage in one job)"
    )
    parser.add_argument("--output-dir", help="metrics.jsonl and logs go here (default: runs/<name>)")
    parser.add_argument(
        "--audit",
        action="store_true",
        help="record the sample positions each rank trained (OUTPUT_DIR/audit)",
    )


def load_config_and_plan(config_path: str, plan_path: str) -> tuple[Config, Plan]:
    """The config and a plan that was made from it (same stages), or a one-line error."""
    config = load_config(config_path)
    try:
        text = Path(plan_path).read_text()
    except OSError as error:
        raise BatchpilotError("--plan", f"cannot read {plan_path}: {error.strerror}") from None
    _, plan = load_plan(text)
    if build_plan(config, micro_batch_size=plan.micro_batch_size).stages != plan.stages:
        raise BatchpilotError(
            "--plan",
            f"{plan_path} was not made from {config_path} (its stages differ)",
            "re-run `batchpilot plan --config ... --out plan.json`",
        )
    return config, plan


def _output_dir(args: argparse.Namespace, config: Config) -> Path:
    return Path(args.output_dir or f"runs/{config.name}")


def run_train(args: argparse.Namespace) -> int:
    from batchpilot.train.trainer import train

    config, plan = load_config_and_plan(args.config, args.plan)
    return train(
        config=config, plan=plan, stage=args.stage, output_dir=_output_dir(args, config), audit=args.audit
    )


def run_launch(args: argparse.Namespace) -> int:
    # No trainer import here: a launcher (a pipeline task, a laptop) needs no torch.
    from batchpilot.cluster.launch import launch_stage, run_local, stage_launch_spec

    config, plan = load_config_and_plan(args.config, args.plan)
    stage = launch_stage(plan, args.stage)
    if config.cluster.backend == "gke":
        return _launch_gke(args, config, stage)
    if args.dryrun:
        raise BatchpilotError(
            "--dryrun", "renders the JobSet or Volcano Job of a gke config", "this config's backend is local"
        )
    output_dir = _output_dir(args, config)
    spec = stage_launch_spec(
        run_name=config.name,
        stage=stage,
        devices_per_node=plan.devices_per_node,
        config_path=str(Path(args.config).absolute()),
        plan_path=str(Path(args.plan).absolute()),
        output_dir=str(output_dir.absolute()),
        audit=args.audit,
    )
    return run_local(spec, log_dir=Path(args.log_dir) if args.log_dir else output_dir / "torchx")


def _launch_gke(args: argparse.Namespace, config: Config, stage: Stage) -> int:
    """Submits (or with --dryrun, prints) the stage's JobSet or Volcano Job; returns the trainers' exit code."""
    from batchpilot.cluster.gke import require_gke_settings
    from batchpilot.cluster.launch import cluster_launch_spec, run_cluster

    require_gke_settings(config.cluster)
    if args.output_dir or args.log_dir:
        raise BatchpilotError(
            "--output-dir" if args.output_dir else "--log-dir",
            "applies to local launches; gke trainers write checkpoints to train.checkpoint_uri",
            "remove the option",
        )
    spec = cluster_launch_spec(
        run_name=config.name,
        stage=stage,
        devices_per_node=config.cluster.devices_per_node,
        config_text=Path(args.config).read_text(),
        plan_text=Path(args.plan).read_text(),
        audit=args.audit,
    )
    return run_cluster(spec, cluster=config.cluster, dryrun=args.dryrun)
