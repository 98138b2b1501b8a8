"""The micro-batch search against an exhaustive sweep, on the CPU demo model with a memory budget.

Both run in this process's run, on the same machine, one after the other: the search
(`run_exploration`, default budgets of configs/explore_bench.yaml) and a sweep of every micro batch from
1 up to the first that does not fit, for each activation-checkpointing setting (`--micro-batch-sizes`).
Prints both side by side. Targets: the recommended size's throughput within 3% of the sweep's best,
using at most 40% of the sweep's probes.

How the two are compared: on a shared virtual machine the CPU's speed jumps by a third for seconds at a
time, which one probe process cannot escape; the search and the sweep both rank sizes by their pass-by-
pass ratio to the base probe (see docs/explore.md), which that drift does not move. The sweep's best is
still the maximum of ~45 such estimates, biased upwards (the winner's curse). So at the end the
recommended size and the sweep's best are measured directly against each other, in one process, pass by
pass in alternation for `--paired-seconds`; the median of the per-pair ratios is checked against the
target. The sweep's own estimate of the recommended size is printed beside it.

Run: .venv/bin/python bench/explore_search.py [--config src/batchpilot/configs/explore_bench.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchpilot.config import Config, load_config
from batchpilot.explore import run_exploration
from batchpilot.explore.records import Setting
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


def progress(name: str):
    """Probe lines on stderr, so a long sweep shows it is alive."""
    return lambda line: (
        print(f"[{name}] {line}", file=sys.stderr, flush=True) if line.startswith("probe ") else None
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "src/batchpilot/configs/explore_bench.yaml"))
    parser.add_argument("--max-sweep-size", type=int, default=256, help="the sweep stops here at the latest")
    parser.add_argument(
        "--paired-seconds", type=float, default=30.0, help="how long the two sizes are measured pass by pass"
    )
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
        rec, best = search.recommendation, sweep.recommendation
        head_to_head = paired_throughput(
            config,
            [
                (rec.micro_batch_size, Setting(rec.activation_checkpointing, rec.compile)),
                (best.micro_batch_size, Setting(best.activation_checkpointing, best.compile)),
            ],
            seconds=args.paired_seconds,
        )
    report(search=search, sweep=sweep, search_s=search_s, sweep_s=sweep_s, head_to_head=head_to_head)
    return 0


def paired_throughput(
    config: Config, sizes: list[tuple[int, Setting]], *, seconds: float, min_pairs: int = 20
) -> tuple[float, float, float]:
    """Tokens/s of two (micro batch, setting) measured pass by pass in alternation, in one process.

    Both sizes share the model, the data and every moment of the machine's state: a pair of passes takes
    a fraction of a second, far less than the seconds a busy neighbour slows this CPU for, so the ratio
    of each pair is free of that drift. The order inside a pair alternates too.

    Returns:
        (median tokens/s of the first, of the second, median of the per-pair ratios first / second).
    """
    from batchpilot.explore.probe import open_session

    (micro_a, setting_a), (micro_b, setting_b) = sizes
    if setting_a.compile or setting_b.compile:
        raise SystemExit("the paired measurement does not switch torch.compile on and off")
    request = probe_request(config=config, micro_batch_size=micro_a, setting=setting_a)
    first: list[float] = []
    second: list[float] = []
    ratios: list[float] = []
    with open_session(request) as session:

        def one_pass(micro: int, setting: Setting) -> float:
            elapsed = session.timed_pass(micro, setting.activation_checkpointing)
            return micro * config.data.seq_len / elapsed

        one_pass(micro_a, setting_a)  # warm-up of both
        one_pass(micro_b, setting_b)
        started = time.monotonic()
        while time.monotonic() - started < seconds or len(ratios) < min_pairs:
            if len(ratios) % 2:
                b = one_pass(micro_b, setting_b)
                a = one_pass(micro_a, setting_a)
            else:
                a = one_pass(micro_a, setting_a)
                b = one_pass(micro_b, setting_b)
            first.append(a)
            second.append(b)
            ratios.append(a / b)
    return statistics.median(first), statistics.median(second), statistics.median(ratios)


def report(*, search, sweep, search_s: float, sweep_s: float, head_to_head) -> None:
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
    rec_tokens, best_tokens, ratio = head_to_head
    same = (rec.micro_batch_size, rec.activation_checkpointing) == (
        best.micro_batch_size,
        best.activation_checkpointing,
    )
    print(
        f"paired, pass by pass in one process: recommended {rec_tokens:,.0f} tokens/s vs sweep best "
        f"{best_tokens:,.0f} (medians){' (the same size)' if same else ''}"
    )
    print(
        f"probes: search / sweep = {probe_ratio:.2f} (target <= 0.40): {'PASS' if probe_ratio <= 0.40 else 'FAIL'}"
    )
    print(
        f"throughput: recommended / sweep best = {ratio:.3f} (target >= 0.97): {'PASS' if ratio >= 0.97 else 'FAIL'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
