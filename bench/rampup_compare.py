"""Ramp-up arms raced on the demo model: constant start batch, constant target batch, the NeMo fixed ramp,
a doubling warm-up, the adaptive ramp-up and Seesaw, several seeds each, at equal samples.

    .venv/bin/python bench/rampup_compare.py [--data file://runs/demo/data] [--seeds 0 1 2]
        [--out runs/bench-rampup] [--plot bench/results/rampup_compare.png] [--base bench/rampup_gpu.yaml]

Whole local pipelines (`batchpilot run --local`) of configs/demo_adaptive.yaml's model, data, 16,384
samples, micro batch 2 and sqrt LR rule, differing only in `batch.rampup` (and `train.seed`):

- start: the adaptive start batch (4) from the first step to the last;
- target: the target batch (16) from the first step;
- nemo: NeMo's fixed ramp `[target/4, target/4, samples/4]` (4 -> 8 -> 12 -> 16 over the first quarter);
- doubling: a batch-size warm-up that doubles the batch each time the measured critical batch passes the
  next size (`adaptive.doubling: true`: candidate sizes start x 2^k; the same evidence rule);
- adaptive: configs/demo_adaptive.yaml as it is;
- seesaw: Seesaw (`rampup: {seesaw: ...}`) in place of a step decay with cuts at 1/4, 1/2 and 3/4 of the samples
  and factor 2: the batch doubles at the first two (4 -> 8 -> 16, the LR divided by sqrt 2 each time), the third
  halves the LR; its LR at the start batch is the other arms' (the sqrt rule's at 4), with no cosine decay.

Every run evaluates the same 256 validation samples every 1,024 samples and at each stage's end. Per arm
(mean and spread over seeds): the validation loss at equal samples (the loss-vs-samples plot), and the
optimizer steps, samples and node-hours each run needs to reach the final validation loss of the
`start` run of its seed (first evaluation at or below it; the same seed: the same initial weights and
sample order). Node-hours are the sum over steps of the step's node count x its step time, plus, for
each launch (a stage is a launch; relaunches are what a ramp-up pays for), the launch's node count x the
launch overhead measured in the same runs (the pipeline's wall time not spent in steps, per launch, of
the single-launch arms). Local "nodes" are processes on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from batchpilot.runstate import parse_metrics

REPO = Path(__file__).resolve().parents[1]
EVAL_EVERY = 1024
ARMS = ("start", "target", "nemo", "doubling", "adaptive", "seesaw")


def arms(base: dict) -> dict[str, dict]:
    target = base["batch"]["global_batch_size"]
    samples = base["train"]["total_samples"]
    adaptive = base["batch"]["rampup"]["adaptive"]
    constant = {key: value for key, value in base["batch"].items() if key != "rampup"}
    doubling = {"adaptive": {**adaptive, "doubling": True, "max_growth": 2.0}}
    train = base["train"]
    start_lr = train["lr"] * (adaptive["start"] / train.get("lr_reference_batch", target)) ** 0.5  # sqrt rule
    seesaw_train = {
        k: v for k, v in train.items() if k not in ("lr_scaling", "lr_reference_batch", "lr_decay")
    }
    seesaw = {
        **base,
        "batch": {**constant, "rampup": {"seesaw": {"start": adaptive["start"], "factor": 2,
                                                     "cuts": [samples // 4, samples // 2, 3 * samples // 4]}}},
        "train": {**seesaw_train, "lr": start_lr, "lr_decay": "constant"},
    }  # fmt: skip
    return {
        "seesaw": seesaw,
        "start": {**base, "batch": {**constant, "global_batch_size": adaptive["start"]}},
        "target": {**base, "batch": constant},
        "nemo": {**base, "batch": {**base["batch"], "rampup": [target // 4, target // 4, samples // 4]}},
        "doubling": {**base, "batch": {**base["batch"], "rampup": doubling}},
        "adaptive": base,
    }


def run(name: str, seed: int, config: dict, folder: Path) -> dict[str, Any]:
    """One whole local pipeline; its per-step records, stages and wall time."""
    tag = f"{name}-s{seed}"
    config = {**config, "name": f"bench-{name}"}
    config["train"] = {
        **config["train"],
        "seed": seed,
        "eval_every_samples": EVAL_EVERY,
        "checkpoint_uri": f"file://{folder / tag / 'ckpt'}",
    }
    path = folder / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot", "run", "--local", "--config", str(path), "--output", str(folder / tag)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{tag}: the pipeline failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # step records only: the report step appends a record per launch (`{"record": "launch", ...}`)
    records = parse_metrics((folder / tag / "metrics.jsonl").read_text())
    plan = json.loads((folder / tag / "plan.json").read_text())
    return {"records": records, "plan": plan, "wall_s": time.monotonic() - started}


def summary(run_: dict[str, Any], *, reference_loss: float, overhead_s: float) -> dict[str, Any]:
    """Steps, samples and node-hours to the reference loss (None: never reached), the final validation
    loss, the number of launches and the stages."""
    records, plan = run_["records"], run_["plan"]
    devices = plan["devices_per_node"]
    launches = len(plan["stages"])
    node_s = 0.0
    reached = None
    for record in records:
        node_s += record["world_size"] / devices * record["step_time_s"]
        if reached is None and record.get("val_loss") is not None and record["val_loss"] <= reference_loss:
            reached = {"steps": record["step"], "samples": record["consumed_samples"], "node_s": node_s}
    relaunch_s = sum(stage["num_nodes"] * overhead_s for stage in plan["stages"])
    validated = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "final_val_loss": validated[-1],
        "steps": len(records),
        "launches": launches,
        "stages": " -> ".join(f"{s['global_batch_size']}@{s['num_nodes']}n" for s in plan["stages"]),
        "to_reference": None
        if reached is None
        else {**reached, "node_hours": (reached["node_s"] + relaunch_s) / 3600},
        "node_hours": (node_s + relaunch_s) / 3600,
        "curve": [(r["consumed_samples"], r["val_loss"]) for r in records if r.get("val_loss") is not None],
    }


def launch_overhead_s(runs: list[dict[str, Any]]) -> float:
    """Seconds per launch not spent in steps, from single-launch runs: the pipeline's wall time minus its
    steps' time (start-up, explore, plan, checkpoints, report); a median over the runs."""
    values = [
        r["wall_s"] - sum(x["step_time_s"] for x in r["records"])
        for r in runs
        if len(r["plan"]["stages"]) == 1
    ]
    return statistics.median(values) if values else 0.0


def mean_spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{mean:.4g} +- {spread:.2g}"


def at_multiples(curve: list[tuple[int, float]]) -> dict[int, float]:
    """A run's evaluations by the multiple of EVAL_EVERY each one crossed (the first evaluation after it:
    a stage of batch 6 crosses 2,048 at 2,052), and its last at the multiple it ends on, so every arm has a
    point at every multiple."""
    points: dict[int, float] = {}
    for samples, loss in curve:
        points.setdefault(samples // EVAL_EVERY * EVAL_EVERY, loss)
    last_samples, last_loss = curve[-1]  # the run's end (a ramp may end a few samples short of a multiple)
    points[-(-last_samples // EVAL_EVERY) * EVAL_EVERY] = last_loss
    return {samples: loss for samples, loss in points.items() if samples > 0}


def plot(results: dict[str, list[dict[str, Any]]], path: Path, *, model: str) -> None:
    """Validation loss against samples, mean over seeds with the min-max band, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, rows in results.items():
        points: dict[int, list[float]] = {}
        for row in rows:
            for samples, loss in at_multiples(row["curve"]).items():
                points.setdefault(samples, []).append(loss)
        xs = sorted(x for x, ys in points.items() if len(ys) == len(rows))
        means = [statistics.fmean(points[x]) for x in xs]
        axes.plot(xs, means, label=name)
        axes.fill_between(xs, [min(points[x]) for x in xs], [max(points[x]) for x in xs], alpha=0.2)
    axes.set_xlabel("samples trained (x 128 tokens)")
    axes.set_ylabel("validation loss (256 samples)")
    axes.set_title(f"Ramp-up arms on {model}, mean over seeds (band: min-max)")
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def report(results: dict[str, list[dict[str, Any]]], *, overhead: float | None, seeds: int) -> None:
    """The table (mean +- standard error over seeds) and the issue's two targets for the adaptive arm."""
    if overhead is not None:
        print(f"\nlaunch overhead {overhead:.1f} s per launch (median over single-launch runs)")
    print(f"{seeds} seeds; mean +- standard error over seeds")
    print(
        "arm | final val loss | steps | to start's final val loss: runs, steps, samples, node-hours | launches | stages"
    )
    for name, rows in results.items():
        reached = [row["to_reference"] for row in rows if row["to_reference"] is not None]
        print(
            f"{name} | {mean_spread([r['final_val_loss'] for r in rows])} | {mean_spread([r['steps'] for r in rows])} | "
            f"{len(reached)}/{len(rows)}, {mean_spread([r['steps'] for r in reached])}, "
            f"{mean_spread([r['samples'] for r in reached])}, {mean_spread([r['node_hours'] for r in reached])} | "
            f"{rows[0]['launches']} | {rows[0]['stages']}"
        )
    if "adaptive" not in results:
        return
    start_steps = statistics.fmean(row["steps"] for row in results["start"])
    reached = [row["to_reference"]["steps"] for row in results["adaptive"] if row["to_reference"] is not None]
    ratio = (
        f"{statistics.fmean(reached) / start_steps:.3f}"
        if len(reached) == len(results["adaptive"])
        else "not reached"
    )
    print(f"target 1, adaptive's steps to start's final loss / start's steps <= 0.6: {ratio}")
    finals = {name: [row["final_val_loss"] for row in rows] for name, rows in results.items()}
    best = min(finals, key=lambda name: statistics.fmean(finals[name]))
    error = statistics.stdev(finals[best]) / len(finals[best]) ** 0.5 if len(finals[best]) > 1 else 0.0
    gap = statistics.fmean(finals["adaptive"]) - statistics.fmean(finals[best])
    print(
        f"target 2, adaptive's final val loss within one standard error of the best arm ({best}, +- {error:.4f}): "
        f"{'yes' if gap <= error else 'no'} (adaptive - {best} = {gap:+.4f})"
    )


def base_name(path: str) -> str:
    """The model the arms train, for the plot's title: the base config's name and model shape."""
    config = yaml.safe_load(Path(path).read_text())
    args = config["model"]["args"]
    return f"{config['name']} ({args['n_layer']} x {args['n_embd']})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=f"file://{REPO / 'runs' / 'demo' / 'data'}", help="demo token shards"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--plot", default=str(REPO / "bench" / "results" / "rampup_compare.png"))
    parser.add_argument(
        "--base",
        default=str(REPO / "configs" / "demo_adaptive.yaml"),
        help="the adaptive config the arms are made from (bench/rampup_gpu.yaml: a larger model on one GPU)",
    )
    parser.add_argument(
        "--from-summary", help="print and plot an earlier run's summary.json instead of running"
    )
    args = parser.parse_args(argv)
    if args.from_summary:
        results = json.loads(Path(args.from_summary).read_text())
        report(results, overhead=None, seeds=len(results["start"]))
        plot(results, Path(args.plot), model=base_name(args.base))
        return 0
    if "start" not in args.arms:
        raise SystemExit("--arms: the start arm is the reference (its final validation loss); keep it")
    base = yaml.safe_load(Path(args.base).read_text())
    base["data"]["uri"] = args.data
    folder = Path(args.out or tempfile.mkdtemp(prefix="bench-rampup-")).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    configs = arms(base)
    raw: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in args.arms}
    for seed in args.seeds:
        for name in args.arms:
            print(f"seed {seed}: {name} ...", flush=True)
            raw[name][seed] = run(name, seed, configs[name], folder)
    overhead = launch_overhead_s([r for runs in raw.values() for r in runs.values()])
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.arms}
    for seed in args.seeds:
        reference = [r["val_loss"] for r in raw["start"][seed]["records"] if r.get("val_loss") is not None][
            -1
        ]
        for name in args.arms:
            results[name].append(summary(raw[name][seed], reference_loss=reference, overhead_s=overhead))
    report(results, overhead=overhead, seeds=len(args.seeds))
    plot(results, Path(args.plot), model=base_name(args.base))
    (folder / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"plot: {args.plot}; runs and summary.json in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
