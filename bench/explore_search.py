"""The micro-batch search against an exhaustive sweep, on the CPU demo model with a memory budget.

Both run in this process's run, on the same machine, one after the other: the search
(`run_exploration`, default budgets of configs/explore_bench.yaml) and a sweep of every micro batch from
1 up to the first that does not fit, for each activation-checkpointing setting (`--micro-batch-sizes`).
Prints both side by side. Targets: the recommended size's throughput (as the sweep measured it) within
3% of the sweep's best, using at most 40% of the sweep's probes.

Run: .venv/bin/python bench/explore_search.py [--config src/batchpilot/configs/explore_bench.yaml]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchpilot.config import load_config
from batchpilot.explore import run_exploration

REPO = Path(__file__).resolve().parents[1]


def demo_data(root: Path) -> str:
    uri = f"file://{root}/data"
    subprocess.run(
        [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", uri],
        check=True,
        capture_output=True,
    )
    return uri


def progress(name: str):
    """Probe lines on stderr, so a long sweep shows it is alive."""
    return lambda line: (
        print(f"[{name}] {line}", file=sys.stderr, flush=True) if line.startswith("probe ") else None
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "src/batchpilot/configs/explore_bench.yaml"))
    parser.add_argument("--max-sweep-size", type=int, default=256, help="the sweep stops here at the latest")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = load_config(args.config)
        config = config.model_copy(update={"data": config.data.model_copy(update={"uri": demo_data(root)})})
        started = time.monotonic()
        search = run_exploration(
            config=config, output_dir=root / "search", study=False, echo=progress("search")
        )
        search_s = time.monotonic() - started
        started = time.monotonic()
        sweep = run_exploration(
            config=config,
            output_dir=root / "sweep",
            max_probes=10_000,
            max_minutes=120,
            micro_batch_sizes=list(range(1, args.max_sweep_size + 1)),
            study=False,
            echo=progress("sweep"),
        )
        sweep_s = time.monotonic() - started
    report(search=search, sweep=sweep, search_s=search_s, sweep_s=sweep_s)
    return 0


def report(*, search, sweep, search_s: float, sweep_s: float) -> None:
    rec, best = search.recommendation, sweep.recommendation
    at_recommended = [
        p.tokens_per_s
        for p in sweep.probes
        if p.fits
        and p.micro_batch_size == rec.micro_batch_size
        and p.activation_checkpointing == rec.activation_checkpointing
    ]
    frontier = {
        ac: max(
            (p.micro_batch_size for p in sweep.probes if p.fits and p.activation_checkpointing == ac),
            default=0,
        )
        for ac in (False, True)
    }
    print(f"{'':28}{'search':>18}{'exhaustive sweep':>20}")
    print(f"{'probes':28}{len(search.probes):>18}{len(sweep.probes):>20}")
    print(f"{'wall-clock s':28}{search_s:>18.0f}{sweep_s:>20.0f}")
    print(
        f"{'micro batch (act. ckpt)':28}{f'{rec.micro_batch_size} ({rec.activation_checkpointing})':>18}"
        f"{f'{best.micro_batch_size} ({best.activation_checkpointing})':>20}"
    )
    print(f"{'tokens/s (own measurement)':28}{rec.tokens_per_s:>18,.0f}{best.tokens_per_s:>20,.0f}")
    print(f"{'confidence':28}{rec.confidence:>18}{best.confidence:>20}")
    print(
        f"sweep frontier: largest fitting micro batch {frontier[False]} (checkpointing off), {frontier[True]} (on)"
    )
    probe_ratio = len(search.probes) / len(sweep.probes)
    print(f"probes: search / sweep = {probe_ratio:.2f} (target <= 0.40)")
    if at_recommended:
        ratio = at_recommended[0] / best.tokens_per_s
        print(
            f"throughput of the recommended size as the sweep measured it / sweep best = {ratio:.3f} "
            f"(target >= 0.97); search's own measurement / sweep best = {rec.tokens_per_s / best.tokens_per_s:.3f}"
        )
    else:
        print("the sweep did not measure the recommended size (it did not fit in the sweep's run)")


if __name__ == "__main__":
    raise SystemExit(main())
