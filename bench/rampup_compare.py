"""Adaptive ramp-up vs a fixed ramp vs the target batch from the start, on the demo model at equal samples.

    .venv/bin/python bench/rampup_compare.py [--data file://runs/demo/data] [--out runs/bench-rampup]

Three whole local pipelines (`batchpilot run --local`) of configs/demo_adaptive.yaml's model, data,
samples, micro batch and LR rule, differing only in `batch.rampup`:

- adaptive: the config as it is (stages decided at run time by the measured noise scale);
- fixed: the demo's fixed-ramp shape for the same target, NeMo `[target/4, target/4, samples/4]`;
- target: no ramp-up, the target batch from the first step.

Printed side by side: stages, optimizer steps, the final validation loss (the same 256 validation samples
at the end of each run) and node-hours, measured as the sum over steps of the step's node count x its
step time (trainer start-up, checkpoints and pool changes not included; local "nodes" are processes
on this machine, so the node-hours say how much node time each schedule asks for, not what GKE would
bill). One run each, on a noisy shared machine: read differences of a few percent as noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def variants(base: dict) -> dict[str, dict]:
    target = base["batch"]["global_batch_size"]
    samples = base["train"]["total_samples"]
    fixed = {**base["batch"], "rampup": [target // 4, target // 4, samples // 4]}
    constant = {key: value for key, value in base["batch"].items() if key != "rampup"}
    return {
        "adaptive": base,
        "fixed": {**base, "batch": fixed},
        "target": {**base, "batch": constant},
    }


def run(name: str, config: dict, folder: Path) -> dict[str, float | int | str]:
    config = {**config, "name": f"bench-{name}"}
    config["train"] = {**config["train"], "checkpoint_uri": f"file://{folder / name / 'ckpt'}"}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot", "run", "--local", "--config", str(path), "--output", str(folder / name)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{name}: the pipeline failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((folder / name / "plan.json").read_text())
    devices = plan["devices_per_node"]
    validated = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "stages": " -> ".join(f"{s['global_batch_size']}@{s['num_nodes']}n" for s in plan["stages"]),
        "steps": len(records),
        "samples": records[-1]["consumed_samples"],
        "final_val_loss": validated[-1],
        "final_loss": records[-1]["loss"],
        "node_hours": sum(r["world_size"] / devices * r["step_time_s"] for r in records) / 3600,
        "wall_s": time.monotonic() - started,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=f"file://{REPO / 'runs' / 'demo' / 'data'}", help="demo token shards"
    )
    parser.add_argument("--out", default=None, help="folder for the three runs (default: a temporary one)")
    args = parser.parse_args(argv)
    base = yaml.safe_load((REPO / "configs" / "demo_adaptive.yaml").read_text())
    base["data"]["uri"] = args.data
    folder = Path(args.out or tempfile.mkdtemp(prefix="bench-rampup-")).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, config in variants(base).items():
        print(f"running {name} ...", flush=True)
        results[name] = run(name, config, folder)
    print(
        f"\n{'':>10} {'steps':>7} {'samples':>8} {'val loss':>9} {'loss':>7} {'node-hours':>11} {'wall s':>7}  stages"
    )
    for name, row in results.items():
        print(
            f"{name:>10} {row['steps']:>7} {row['samples']:>8} {row['final_val_loss']:>9.4f} "
            f"{row['final_loss']:>7.4f} {row['node_hours']:>11.5f} {row['wall_s']:>7.0f}  {row['stages']}"
        )
    target = results["target"]
    for name in ("adaptive", "fixed"):
        row = results[name]
        print(
            f"{name} vs target: steps x{row['steps'] / target['steps']:.2f}, val loss "
            f"{row['final_val_loss'] - target['final_val_loss']:+.4f}, node-hours x{row['node_hours'] / target['node_hours']:.2f}"
        )
    print(f"runs in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
