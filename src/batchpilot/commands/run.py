"""`batchpilot run --local`: compile the pipeline for a config and run all of it on this machine.

kfp.local's SubprocessRunner runs every task in this Python environment; the embedded defaults are a
local folder for storage, a local node pool (a node = a group of processes) and torchx `local_cwd`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from batchpilot.config import Config, load_config, parse_config
from batchpilot.errors import BatchpilotError

EMBEDDED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
SOURCE_TREE = Path(__file__).resolve().parents[3]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="compile the pipeline and run all of it locally (explore, plan, every stage, report)",
        description="Runs the whole batchpilot pipeline with kfp.local on this machine and leaves the "
        "report, metrics, plan and checkpoints in --output.",
    )
    parser.add_argument(
        "--local", action="store_true", help="run with kfp.local here (the only mode of `run`)"
    )
    parser.add_argument(
        "--config", default=str(EMBEDDED_CONFIG), help="config file (default: the embedded demo)"
    )
    parser.add_argument(
        "--output", required=True, help="folder for the run's report, metrics, plan, checkpoints"
    )
    parser.add_argument("--resume", action="store_true", help="continue a run in an existing --output folder")
    parser.add_argument(
        "--micro-batch-size", type=int, default=0, help="skip the explored value (0: explore)"
    )
    parser.set_defaults(handler=run)


def _absolute_file_uri(uri: str) -> str:
    if not uri.startswith("file://"):
        return uri
    return f"file://{Path(uri.removeprefix('file://')).absolute()}"


def local_run_config(config: Config, *, output: Path) -> Config:
    """The config for a local run: file URIs made absolute; checkpoints and pool state in the output folder."""
    data = config.model_dump(mode="json")
    data["data"]["uri"] = _absolute_file_uri(data["data"]["uri"])
    data["train"]["checkpoint_uri"] = f"file://{output.absolute()}/ckpt"
    data["cluster"]["pool_state_path"] = str(output.absolute() / "pool.json")
    return parse_config(data)


def _check_inputs(config: Config, output: Path, *, resume: bool) -> None:
    if config.cluster.backend != "local":
        raise BatchpilotError(
            "cluster.backend",
            f"is {config.cluster.backend!r}; `batchpilot run --local` runs local configs",
            "compile with `python pipelines/compile.py --config ...` and submit it to Kubeflow Pipelines",
        )
    if output.exists() and any(output.iterdir()) and not resume:
        raise BatchpilotError("--output", f"{output} is not empty", "choose a new folder, or pass --resume")
    manifest = Path(config.data.uri.removeprefix("file://")) / "manifest.json"
    if config.data.uri.startswith("file://") and not manifest.exists():
        raise BatchpilotError(
            "data.uri",
            f"{config.data.uri} holds no shard set (no manifest.json)",
            f"prepare one, e.g. `batchpilot data prepare --demo --out {config.data.uri}`",
        )


def _pipeline_module() -> Any:
    """pipelines/ and components/ live beside src/ in the source tree (the image puts them on PYTHONPATH)."""
    try:
        return importlib.import_module("pipelines.batchpilot_pipeline")
    except ModuleNotFoundError:
        pass
    if not (SOURCE_TREE / "pipelines" / "batchpilot_pipeline.py").exists():
        raise BatchpilotError(
            "batchpilot run",
            f"needs the batchpilot source tree (pipelines/, components/), not found at {SOURCE_TREE}",
            "install batchpilot from a checkout (`pip install -e .`) or use the batchpilot image",
        )
    if str(SOURCE_TREE) not in sys.path:
        sys.path.insert(0, str(SOURCE_TREE))
    return importlib.import_module("pipelines.batchpilot_pipeline")


def run(args: argparse.Namespace) -> int:
    if not args.local:
        raise BatchpilotError("--local", "is required: `batchpilot run` only runs pipelines on this machine")
    output = Path(args.output)
    config = local_run_config(load_config(args.config), output=output)
    _check_inputs(config, output, resume=args.resume)
    pipeline_module = _pipeline_module()
    from kfp import local

    output.mkdir(parents=True, exist_ok=True)
    config_yaml = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    (output / "config.yaml").write_text(config_yaml)
    pipeline = pipeline_module.build_pipeline(config)
    stages = pipeline_module.num_stages(config)
    print(
        f"[batchpilot] running pipeline batchpilot-{config.name} locally: explore, plan, {stages} stage(s), "
        f"report -> {output}",
        flush=True,
    )
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(output / "kfp"))
    started = time.monotonic()
    try:
        pipeline(micro_batch_size=args.micro_batch_size, run_dir=str(output.absolute()))
    except RuntimeError as error:
        print(f"batchpilot: error: the pipeline failed: {error}", file=sys.stderr)
        print(
            f"batchpilot: error: the exit handler scaled the pool down; task logs under {output / 'kfp'}",
            file=sys.stderr,
        )
        return 1
    _summary(output, elapsed_s=time.monotonic() - started)
    return 0


def _summary(output: Path, *, elapsed_s: float) -> None:
    records = [
        json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    plan = json.loads((output / "plan.json").read_text())
    nodes = " -> ".join(f"{s['global_batch_size']}@{s['num_nodes']}n" for s in plan["stages"])
    print(
        f"[batchpilot] done in {elapsed_s / 60:.1f} min: micro_batch_size {plan['micro_batch_size']}, "
        f"stages {nodes}, {len(records)} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}"
    )
    for name in ("report.html", "plan.json", "plan.md", "metrics.jsonl", "explore/explore.json", "ckpt"):
        print(f"[batchpilot]   {output / name}")
