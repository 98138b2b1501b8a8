"""What each pipeline step does, as plain functions: the KFP components only convert parameters and call
these. Every step runs the same code path as the `batchpilot` command a user would type.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from batchpilot.cli import main as cli_main
from batchpilot.config import Config, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.planner import (
    build_plan,
    dump_plan,
    load_plan,
    micro_batch_from_explore,
    resolve_micro_batch_size,
)


def config_from_yaml(config_yaml: str, *, micro_batch_size: int = 0, total_samples: int = 0) -> Config:
    """The run's config: the YAML text with the run-time overrides (0 = keep the config's value)."""
    data = yaml.safe_load(config_yaml)
    if not isinstance(data, dict):
        raise BatchpilotError("config_yaml", "is not a YAML mapping")
    if micro_batch_size:
        data.setdefault("batch", {})["micro_batch_size"] = micro_batch_size
    if total_samples:
        data.setdefault("train", {}).update(total_samples=total_samples, total_tokens=None)
    return parse_config(data)


def run_command(*args: str) -> None:
    """Runs `batchpilot ARGS` in this process; any non-zero exit fails the step with that command named."""
    print(f"[batchpilot] $ batchpilot {' '.join(args)}", flush=True)
    code = cli_main(list(args))
    if code != 0:
        raise RuntimeError(f"`batchpilot {' '.join(args)}` exited with {code}; see the lines above")


def write_config(config: Config, folder: Path) -> Path:
    """The resolved config as a file the commands can read."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def explore_step(*, config_yaml: str, micro_batch_size: int, output_dir: str) -> dict[str, Any]:
    """Runs `batchpilot explore`; returns explore.json (its recommendation feeds the plan)."""
    config = config_from_yaml(config_yaml, micro_batch_size=micro_batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        run_command("explore", "--config", str(write_config(config, Path(tmp))), "--output-dir", output_dir)
    return dict(json.loads((Path(output_dir) / "explore.json").read_text()))


def plan_step(
    *,
    config_yaml: str,
    micro_batch_size: int,
    total_samples: int,
    explore_json: str,
    expected_num_stages: int,
) -> str:
    """The plan.json text; fails early when the config implies another stage count than was compiled."""
    config = config_from_yaml(config_yaml, micro_batch_size=micro_batch_size, total_samples=total_samples)
    override = micro_batch_size or None
    if override is None and config.batch.micro_batch_size == "explore":
        override, note = micro_batch_from_explore(json.loads(Path(explore_json).read_text()))
        if note:
            print(f"[batchpilot] {note}", flush=True)
    plan = build_plan(config, micro_batch_size=resolve_micro_batch_size(config, override))
    if len(plan.stages) != expected_num_stages:
        raise BatchpilotError(
            "config_yaml",
            f"implies {len(plan.stages)} stage(s) but this pipeline was compiled for {expected_num_stages}",
            "recompile it with `python pipelines/compile.py --config <your config>` and upload the result",
        )
    return dump_plan(config, plan)


def _materialise(plan_json: str, folder: Path) -> tuple[Config, Path, Path]:
    """config.yaml and plan.json files for the commands (the plan carries the resolved config)."""
    config, _ = load_plan(plan_json)
    config_path = write_config(config, folder)
    plan_path = folder / "plan.json"
    plan_path.write_text(plan_json)
    return config, config_path, plan_path


def resize_step(*, plan_json: str, stage_index: int) -> int:
    """Resizes the node pool to the stage's node count and waits until the nodes are ready."""
    _, plan = load_plan(plan_json)
    stage = plan.stages[stage_index]
    with tempfile.TemporaryDirectory() as tmp:
        _, config_path, _ = _materialise(plan_json, Path(tmp))
        run_command("pool", "resize", "--config", str(config_path), "--nodes", str(stage.num_nodes))
    return stage.num_nodes


def train_stage_step(*, plan_json: str, stage_index: int, run_dir: str) -> dict[str, float]:
    """Launches the stage's trainers on the pool and returns the stage's last metrics."""
    folder = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="batchpilot-"))
    config, config_path, plan_path = _materialise(plan_json, folder / "inputs" / f"stage-{stage_index}")
    args = ["launch", "--config", str(config_path), "--plan", str(plan_path), "--stage", str(stage_index)]
    if config.cluster.backend == "local":  # cluster trainers keep their metrics beside the checkpoints only
        args += ["--output-dir", str(folder)]
    run_command(*args)
    from batchpilot.data.storage import open_storage
    from batchpilot.train.metrics import METRICS_OBJECT

    lines = open_storage(config.train.checkpoint_uri).read(METRICS_OBJECT).decode().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    stage_records = [r for r in records if r["stage"] == stage_index]
    if not stage_records:
        raise BatchpilotError(f"stage {stage_index}", "finished without recording a single step")
    last = stage_records[-1]
    return {
        key: float(last[key]) for key in ("loss", "consumed_samples", "global_batch_size", "tokens_per_s")
    }


def scale_down_step(*, config_yaml: str) -> None:
    """Scales the pool back down (the exit handler: runs whether the stages succeeded or failed).

    It reads the YAML itself, not the plan, so it still runs when planning failed.
    """
    config = config_from_yaml(config_yaml)
    with tempfile.TemporaryDirectory() as tmp:
        run_command("pool", "scale-down", "--config", str(write_config(config, Path(tmp))))


def report_step(
    *, plan_json: str, explore_json: str, run_dir: str, html_path: str, markdown_path: str
) -> dict[str, float]:
    """Writes the run report (HTML + Markdown plan table) and returns its headline metrics."""
    from batchpilot.data.storage import ObjectNotFound, open_storage
    from batchpilot.report import write_report
    from batchpilot.train.metrics import METRICS_OBJECT

    config, plan = load_plan(plan_json)
    try:
        text = open_storage(config.train.checkpoint_uri).read(METRICS_OBJECT).decode()
    except ObjectNotFound:
        text = ""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    explore_path = Path(explore_json)
    explore = json.loads(explore_path.read_text()) if explore_path.is_file() else None
    summary = write_report(
        plan=plan, run_name=config.name, records=records, explore=explore,
        html_path=Path(html_path), markdown_path=Path(markdown_path),
        explore_html=explore_path.with_name("explore.html"),
    )  # fmt: skip
    if run_dir:
        keep_copies(run_dir, {"report.html": Path(html_path), "plan.md": Path(markdown_path)})
        (Path(run_dir) / "metrics.jsonl").write_text(text)
    return summary


def keep_copies(run_dir: str, files: dict[str, Path]) -> None:
    """Copies step outputs into the local run folder (`batchpilot run --output DIR`)."""
    for name, source in files.items():
        destination = Path(run_dir) / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(source.read_bytes())
