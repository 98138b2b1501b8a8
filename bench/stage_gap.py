"""The gap between two launches: from one launch's last step to the next launch's first step, by goodput category,
with the next launch's nodes asked for ahead (`cluster.capacity_ahead: auto`) and without (`off`).

The demo's pipeline runs locally (`batchpilot run --local`, micro batch 16, no explore): stages-0-2 on 1 node,
then final on 2. A local pool grows at once, so a cloud pool's resize is modelled: its new nodes are ready
`--resize-delay-s` after the resize (`cluster.local_resize_delay_s`; the report of each run says it is
modelled). The canary's resize (0 -> 2 nodes) is the run's first resize up, so both arms measure the same lead.
The gap is split as the goodput ledger splits time (planning/goodput.py): the last launch's tail (its last
checkpoint, the job's end), waiting for nodes, idle (between the tasks), the next job's pod start (process
launch) and start-up (rendezvous, model build, checkpoint load). Target: with capacity ahead the gap has no
wait for nodes: it is the tail, the process start and the start-up. Runs the arms in interleaved pairs.

    .venv/bin/python bench/stage_gap.py [--pairs 2] [--resize-delay-s 10]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from batchpilot.planning.goodput import EARLY_CAPACITY, PRIORITY, build_ledger, intervals
from batchpilot.runstate import read_events

REPO = Path(__file__).resolve().parents[1]
ARMS = ("off", "auto")


def gap(events: list[dict]) -> dict[str, float]:
    """Seconds of each category from stages-0-2's last step to final's first step."""
    trainers = {tuple(e["stages"]): e for e in events if e["kind"] == "trainer"}
    start, end = float(trainers[(0, 2)]["last_step_s"]), float(trainers[(3, 3)]["first_step_s"])
    spans = intervals(events)
    cuts = sorted({start, end} | {t for s in spans for t in (s.start_s, s.end_s) if start < t < end})
    shares: dict[str, float] = {}
    for left, right in itertools.pairwise(cuts):
        middle = (left + right) / 2
        active = [s for s in spans if s.start_s <= middle < s.end_s]
        chosen = min(active, key=lambda s: PRIORITY.index(s.category), default=None)
        category = chosen.category if chosen is not None else "idle"
        shares[category] = shares.get(category, 0.0) + right - left
    shares["total"] = end - start
    return shares


def run(arm: str, *, root: Path, data: str, delay_s: float) -> dict[str, float]:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = data
    config["batch"]["micro_batch_size"] = 16
    config["explore"] = {"study": False}
    config["cluster"].update(capacity_ahead=arm, local_resize_delay_s=delay_s)
    path = root / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = root / f"run-{arm}"
    command = [sys.executable, "-m", "batchpilot", "run", "--local", "--config", str(path), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{arm}: the run failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    report = (out / "report.html").read_text()
    assert "cluster.local_resize_delay_s" in report, "the report does not say that a resize delay is modelled"
    events = read_events(f"file://{out / 'ckpt'}")
    ledger = build_ledger(events, now_s=max(e.get("ended_s", e.get("ready_s", 0.0)) for e in events))
    early = ledger.categories.get(EARLY_CAPACITY) if ledger is not None else None
    return {**gap(events), "early node-seconds": early.node_hours * 3600 if early else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--resize-delay-s", type=float, default=10.0)
    args = parser.parse_args()
    data = REPO / "runs" / "demo" / "data"
    if not (data / "manifest.json").exists():
        subprocess.run(
            [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", f"file://{data}"],
            check=True,
        )
    print(f"# {platform.processor() or platform.machine()}, resize delay modelled: {args.resize_delay_s:g} s")
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as folder:
        for pair in range(args.pairs):
            for arm in ARMS if pair % 2 == 0 else reversed(ARMS):
                root = Path(folder) / f"pair-{pair}"
                root.mkdir(exist_ok=True)
                results[arm].append(run(arm, root=root, data=f"file://{data}", delay_s=args.resize_delay_s))
                print(f"pair {pair} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[arm][-1].items()))
    columns = ["total", "tail", "waiting_for_nodes", "idle", "pod_start", "start_up", "early node-seconds"]
    print("\ncapacity_ahead | " + " | ".join(f"{c} (s, median)" for c in columns))
    medians = {
        arm: {c: statistics.median(r.get(c, 0.0) for r in results[arm]) for c in columns} for arm in ARMS
    }
    for arm in ARMS:
        print(f"{arm:>14} | " + " | ".join(f"{medians[arm][c]:.1f}" for c in columns))
    ahead = medians["auto"]
    print(
        f"\ngap with capacity ahead / without: {ahead['total'] / medians['off']['total']:.3f}; waiting for nodes "
        f"in the gap with capacity ahead: {ahead['waiting_for_nodes']:.1f} s (target 0); the rest of it: tail "
        f"{ahead['tail']:.1f} + idle {ahead['idle']:.1f} + process start {ahead['pod_start']:.1f} + start-up "
        f"{ahead['start_up']:.1f} s"
    )


if __name__ == "__main__":
    main()
