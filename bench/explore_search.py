"""The micro-batch search against an exhaustive sweep, on the CPU demo model with a memory budget.

Both run in this process's run, on the same machine, one after the other: the search
(`run_exploration`, default budgets of configs/explore_bench.yaml) and a sweep of every micro batch from
1 up to the first that does not fit, for each activation-checkpointing setting (`--micro-batch-sizes`).
Prints both side by side. Targets (issue #34): the recommended size's throughput at least 0.98 of the
sweep's best, using at most 25% of the sweep's probes, in three runs in a row.

How the two are compared: on a shared virtual machine the CPU's speed jumps by a third for seconds at a
time, which one probe process cannot escape; the search and the sweep both rank sizes by their pass-by-
pass ratio to the base probe (see docs/explore.md), which that drift does not move. The sweep's best is
still the maximum of ~45 such estimates, biased upwards (the winner's curse). So at the end the
recommended size and the sweep's best are measured directly against each other: one probe of the
recommended size with the sweep's best as its reference, 200 pairs of passes in alternation; the median
of the per-pair ratios is checked against the target. The sweep's own estimate of the recommended size is printed beside it.

Run: .venv/bin/python bench/explore_search.py [--config src/batchpilot/configs/explore_bench.yaml]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from batchpilot.config import Config, load_config
from batchpilot.explore import run_exploration
from batchpilot.explore.probe import MAX_TIMED_STEPS
from batchpilot.explore.process import run_probe
from batchpilot.explore.recommend import Recommendation
from batchpilot.explore.records import ProbeResult, Setting
from batchpilot.explore.runner import probe_request

REPO = Path(__file__).resolve().parents[1]


def demo_data(root: Path) -> str:
    uri = f"file://{root}/data"
    subprocess.run(
        [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", uri],
        check=True,
        capture_output=True,
    )
    return uri


@contextlib.contextmanager
def progress(name: str) -> Iterator[None]:
    """Explore's probe lines on stderr while the block runs, so a long sweep shows it is alive."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{name}] %(message)s"))
    handler.addFilter(lambda record: record.getMessage().startswith("probe "))
    logger = logging.getLogger("batchpilot.explore.runner")
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


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
        with progress("search"):
            search = run_exploration(config=config, output_dir=root / "search", study=False)
        search_s = time.monotonic() - started
        started = time.monotonic()
        with progress("sweep"):
            sweep = run_exploration(
                config=config,
                output_dir=root / "sweep",
                max_probes=10_000,
                max_minutes=120,
                micro_batch_sizes=list(range(1, args.max_sweep_size + 1)),
                study=False,
            )
        sweep_s = time.monotonic() - started
        paired = head_to_head(config, search.recommendation, sweep.recommendation)
    report(search=search, sweep=sweep, search_s=search_s, sweep_s=sweep_s, paired=paired)
    return 0


def head_to_head(config: Config, recommended: Recommendation, best: Recommendation) -> ProbeResult:
    """The recommended size probed with the sweep's best as its reference: every timed pass of one is
    paired with a pass of the other in the same fresh process (the probe's own pairing, MAX_TIMED_STEPS
    pairs), so `relative_throughput` is recommended / best, free of the machine's drift.

    The memory budget is lifted for this probe: both sizes fit alone, and only their speed is compared.
    """
    if recommended.compile or best.compile:
        raise SystemExit("the head-to-head does not pair compiled probes")
    request = replace(
        probe_request(
            config=config,
            micro_batch_size=recommended.micro_batch_size,
            setting=Setting(recommended.activation_checkpointing),
        ),
        reference_micro_batch_size=best.micro_batch_size,
        reference_activation_checkpointing=best.activation_checkpointing,
        timed_steps=MAX_TIMED_STEPS,
        memory_budget_bytes=4 * config.explore.memory_budget_bytes,
    )
    result = run_probe(request=request, timeout_s=config.explore.probe_timeout_s)
    if not result.fits or result.relative_throughput is None:
        raise SystemExit(f"the head-to-head probe failed: {result.error}")
    return result


def report(*, search, sweep, search_s: float, sweep_s: float, paired: ProbeResult) -> None:
    rec, best = search.recommendation, sweep.recommendation
    # The sweep's own estimate of the recommended size, as a speed-up over its base (paired probes).
    at_recommended = [
        p.relative_throughput if p.relative_throughput is not None else 1.0
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
    print(f"{'speed-up over the base':28}{rec.estimated_speedup:>17.2f}x{best.estimated_speedup:>19.2f}x")
    print(f"{'confidence':28}{rec.confidence:>18}{best.confidence:>20}")
    print(
        f"sweep frontier: largest fitting micro batch {frontier[False]} (checkpointing off), {frontier[True]} (on)"
    )
    probe_ratio = len(search.probes) / len(sweep.probes)
    if at_recommended:
        print(
            "the sweep's own estimate of the recommended size / of its best = "
            f"{statistics.median(at_recommended) / best.estimated_speedup:.3f}"
        )
    ratio = paired.relative_throughput or 0.0
    same = (rec.micro_batch_size, rec.activation_checkpointing) == (
        best.micro_batch_size,
        best.activation_checkpointing,
    )
    print(
        f"head-to-head, {len(paired.pair_ratios)} pairs of passes in one process: recommended "
        f"{paired.tokens_per_s or 0:,.0f} tokens/s, {ratio:.3f}x the sweep best"
        f"{' (the same size)' if same else ''}"
    )
    print(
        f"probes: search / sweep = {probe_ratio:.2f} (target <= 0.25): {'PASS' if probe_ratio <= 0.25 else 'FAIL'}"
    )
    print(
        f"throughput: recommended / sweep best = {ratio:.3f} (target >= 0.98): {'PASS' if ratio >= 0.98 else 'FAIL'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
