"""The critical batch two ways on the demo model: the batch trials (branches raced on validation loss from one
warm-up checkpoint, Merrill-style) against explore's gradient-noise study, over several seeds.

    .venv/bin/python bench/trials_vs_study.py [--data file://runs/demo/data] [--seeds 0 1 2]
        [--tokens 32768] [--lr-multipliers 0.5 1 2] [--out runs/bench-trials]
        [--results bench/results/trials_vs_study.json]

Per seed (`train.seed`: the same initial weights and sample order in both measurements), with the demo
config at micro batch 16:

1. `batchpilot explore --micro-batch-sizes 16`: the study's critical batch (the noise scale B_simple
   after its warm-up steps) and the target it recommends;
2. `batchpilot plan --explore` with `trials.enabled`, then `batchpilot trials`: a warm-up at the ramp's start
   batch, then batches 16, 32, 64 (the demo's start to its target) x LR multipliers (default 0.5, 1, 2), each for
   `--tokens` tokens, and the critical batch the trials decide (the largest batch whose validation loss at
   the budget stays within trials.tolerance of every smaller batch's best).

Prints a table per seed and the two estimates' means; the trials' batches are bounded by the demo's target
(64), so a study estimate above 64 and a trials answer of 64 agree that the whole range is below critical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def batchpilot(*args: str) -> None:
    """Runs a batchpilot command in a real process; stops the bench with its output when it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(
            f"batchpilot {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}"
        )


def config_for(
    seed: int, *, data: str, tokens: int, multipliers: list[float], folder: Path
) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = data
    config["batch"]["micro_batch_size"] = 16
    config["train"].update(seed=seed, checkpoint_uri=f"file://{folder / 'ckpt'}")
    config["trials"] = {
        "enabled": True,
        "tokens": tokens,
        "lr_multipliers": multipliers,
        "budget_fraction": 0.5,
    }
    return config


def measure(seed: int, *, data: str, tokens: int, multipliers: list[float], root: Path) -> dict[str, Any]:
    folder = root / f"seed-{seed}"
    if folder.exists():
        raise SystemExit(
            f"{folder} exists: give another --out (the bench never trains into an old run's folders)"
        )
    folder.mkdir(parents=True)
    config_path = folder / "config.yaml"
    config_path.write_text(
        yaml.safe_dump(config_for(seed, data=data, tokens=tokens, multipliers=multipliers, folder=folder))
    )
    started = time.monotonic()
    batchpilot(
        "explore", "--config", str(config_path), "--micro-batch-sizes", "16", "--out", str(folder / "explore")
    )
    explored_s = time.monotonic() - started
    study = json.loads((folder / "explore" / "explore.json").read_text()).get("noise_scale") or {}
    batchpilot(
        "plan", "--config", str(config_path), "--explore", str(folder / "explore" / "explore.json"),
        "--out", str(folder / "plan.json"), "--force",
    )  # fmt: skip
    started = time.monotonic()
    batchpilot("trials", "--plan", str(folder / "plan.json"), "--out", str(folder / "trials"))
    trials_s = time.monotonic() - started
    outcome = json.loads((folder / "trials" / "trials.json").read_text())["outcome"]
    decision = outcome["decision"]
    return {
        "seed": seed,
        "study_critical_batch": study.get("critical_batch_size"),
        "study_recommended_batch": study.get("recommended_global_batch_size"),
        "trials_critical_batch": decision["critical_batch"],
        "trials_lr_multiplier": decision["lr_multiplier"],
        "trials_best": decision["best"],
        "trials_reason": decision["reason"],
        "failed_branches": decision["excluded"],
        "explore_s": explored_s,
        "trials_s": trials_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="file://runs/demo/data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--lr-multipliers", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-trials"))
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results" / "trials_vs_study.json")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        row = measure(
            seed,
            data=args.data,
            tokens=args.tokens,
            multipliers=args.lr_multipliers,
            root=args.out.absolute(),
        )
        rows.append(row)
        best = ", ".join(
            f"{batch}: {loss:.4f} (LR x {mult:g})" for batch, (mult, loss) in row["trials_best"].items()
        )
        print(
            f"seed {seed}: study critical batch {row['study_critical_batch']} (recommends "
            f"{row['study_recommended_batch']}); trials critical batch {row['trials_critical_batch']} "
            f"(LR x {row['trials_lr_multiplier']}); best loss per batch {best}; "
            f"explore {row['explore_s']:.0f} s, trials {row['trials_s']:.0f} s",
            flush=True,
        )
    study = [r["study_critical_batch"] for r in rows if r["study_critical_batch"] is not None]
    trials = [r["trials_critical_batch"] for r in rows if r["trials_critical_batch"] is not None]
    print(
        f"study critical batch: mean {statistics.mean(study):.3g} over {len(study)} seed(s) "
        f"({', '.join(f'{v:.3g}' for v in study)})"
        if study
        else "study: no critical batch measured"
    )
    print(
        f"trials critical batch: mean {statistics.mean(trials):.3g} over {len(trials)} seed(s) "
        f"({', '.join(map(str, trials))})"
        if trials
        else "trials: no critical batch decided"
    )
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(
        json.dumps(
            {"tokens_per_branch": args.tokens, "lr_multipliers": args.lr_multipliers, "seeds": rows}, indent=2
        )
        + "\n"
    )
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
