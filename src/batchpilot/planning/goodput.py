"""The goodput ledger: where a run's wall time and node-hours went, from the timestamped events its tasks and
trainers record beside the checkpoints (`runstate.record_event`).

Events (unix seconds):
- `pool`: a resize from `before` to `after` nodes, asked for at `requested_s`, every node ready at `ready_s`
  (the pool tasks, the explore pool's and the exit handler's scale-down included);
- `launch`: a launch (`launch`, its name; `stages`, its first and last stage) whose job was submitted at
  `submitted_s` and was over at `ended_s`, with its `exit_code` (the train task);
- `trainer`: the main trainer process of the job training `stages`: started at `started_s` (the process, from
  the kernel's
  record), its first step begun at `first_step_s`, its last ended at `last_step_s`, with the seconds its steps
  were blocked by checkpoints (`checkpoint_blocked_s`) and spent validating (`evaluation_s`).

Each instant from the first resize to `now_s` belongs to one category, the first in `PRIORITY` whose interval
holds it: a launch's `training_steps` (first step to last), its `start_up` (process start to first step:
rendezvous, model build, checkpoint load, the first step's compile), its `pod_start` (submitted to process
start: scheduling, image pull), its `tail` (last step to the job's end: the last checkpoint, teardown),
`failed` (a launch whose trainer never reported: the whole launch), `waiting_for_nodes` (a resize up, from
asked to ready), else `idle` (nodes up with no launch on them: explore, plan, report, between launches, a
scale-down in progress). So the categories add up to the wall time exactly. Node-hours integrate the nodes
up: `before` until a resize's `ready_s`, `after` from it (a node that is coming is not counted; on GKE it is
billed from its creation, so the paid figure is a lower bound by at most one resize's new nodes x its wait).
Nodes beyond the ones a launch runs on, while it runs (the next launch's, asked for ahead: `planning.ahead`),
are paid and idle: their node-hours go to `early_capacity` (a share of node-hours only: the wall time is the
launch's). Goodput = training-step node-hours / all node-hours.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PRIORITY = ("training_steps", "start_up", "pod_start", "tail", "failed", "waiting_for_nodes", "idle")
"""The categories, in the order an instant is given to them when intervals overlap."""
EARLY_CAPACITY = "early_capacity"
"""Node-hours of the nodes up beyond those of the launch that runs (no wall time of its own)."""


@dataclass(frozen=True)
class Interval:
    category: str
    start_s: float
    end_s: float
    launch: str | None = None
    nodes: int | None = None
    """The nodes the launch runs on (None: not a launch's interval, or not recorded)."""


@dataclass
class Share:
    """One category's wall seconds and node-hours (of a launch, or of the run)."""

    wall_s: float = 0.0
    node_hours: float = 0.0


@dataclass
class Ledger:
    """Per category (and per launch and category) the wall seconds and node-hours, over `start_s`..`end_s`.

    Attributes:
        checkpoint_blocked_s, evaluation_s, data_wait_s: seconds of the training steps blocked by checkpoints,
            spent validating, and waiting for the next step's data (the main trainers' own sums; part of
            `training_steps`).
    """

    start_s: float
    end_s: float
    categories: dict[str, Share] = field(default_factory=dict)
    launches: dict[str, dict[str, Share]] = field(default_factory=dict)
    checkpoint_blocked_s: float = 0.0
    evaluation_s: float = 0.0
    data_wait_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def node_hours(self) -> float:
        return sum(share.node_hours for share in self.categories.values())

    @property
    def goodput(self) -> float | None:
        """Training-step node-hours over all node-hours (None: no node was up)."""
        paid = self.node_hours
        training = self.categories.get("training_steps", Share()).node_hours
        return training / paid if paid > 0 else None

    def to_dict(self) -> dict[str, Any]:
        def shares(items: Mapping[str, Share]) -> dict[str, dict[str, float]]:
            return {name: {"wall_s": s.wall_s, "node_hours": s.node_hours} for name, s in items.items()}

        return {
            "start_s": self.start_s,
            "end_s": self.end_s,
            "wall_s": self.wall_s,
            "node_hours": self.node_hours,
            "goodput": self.goodput,
            "categories": shares(self.categories),
            "launches": {name: shares(items) for name, items in self.launches.items()},
            "checkpoint_blocked_s": self.checkpoint_blocked_s,
            "evaluation_s": self.evaluation_s,
            "data_wait_s": self.data_wait_s,
        }


def intervals(events: Sequence[Mapping[str, Any]]) -> list[Interval]:
    """The categories' intervals the events describe (see the module docstring)."""
    found: list[Interval] = []
    trainers = [event for event in events if event["kind"] == "trainer"]
    for event in events:
        kind = event["kind"]
        if kind == "pool" and event["after"] > event["before"]:
            found.append(Interval("waiting_for_nodes", event["requested_s"], event["ready_s"]))
        elif kind == "launch":
            name, submitted, ended = event["launch"], float(event["submitted_s"]), float(event["ended_s"])
            mine = [  # the launch's stages, started while its job ran
                t
                for t in trainers
                if list(t["stages"]) == list(event["stages"]) and submitted <= float(t["started_s"]) <= ended
            ]
            if not mine:
                found.append(Interval("failed", submitted, ended, name, event.get("nodes")))
                continue
            trainer = min(mine, key=lambda t: float(t["started_s"]))
            started, first, last = (
                float(trainer[key]) for key in ("started_s", "first_step_s", "last_step_s")
            )
            nodes = int(event["nodes"]) if event.get("nodes") is not None else None
            found += [
                Interval("pod_start", submitted, started, name, nodes),
                Interval("start_up", started, first, name, nodes),
                Interval("training_steps", first, last, name, nodes),
                Interval("tail", last, ended, name, nodes),
            ]
    return found


def nodes_timeline(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """(time, nodes up from then) at every resize's `ready_s`, in time order, starting from 0 nodes."""
    changes = sorted((float(e["ready_s"]), int(e["after"])) for e in events if e["kind"] == "pool")
    return [(float("-inf"), 0), *changes]


def build_ledger(events: Sequence[Mapping[str, Any]], *, now_s: float) -> Ledger | None:
    """The ledger from the first resize to `now_s` (None: no resize recorded)."""
    pools = [e for e in events if e["kind"] == "pool"]
    if not pools:
        return None
    start = min(float(e["requested_s"]) for e in pools)
    end = max(now_s, start)
    spans = intervals(events)
    timeline = nodes_timeline(events)
    cuts = sorted(
        {start, end}
        | {t for span in spans for t in (span.start_s, span.end_s) if start < t < end}
        | {t for t, _ in timeline if start < t < end}
    )
    ledger = Ledger(start_s=start, end_s=end)
    for left, right in itertools.pairwise(cuts):
        middle = (left + right) / 2
        active = [span for span in spans if span.start_s <= middle < span.end_s]
        chosen = min(active, key=lambda s: PRIORITY.index(s.category), default=None)
        category = chosen.category if chosen is not None else "idle"
        nodes = next(n for t, n in reversed(timeline) if t <= middle)
        early = max(0, nodes - chosen.nodes) if chosen is not None and chosen.nodes is not None else 0
        seconds = right - left
        for name, wall_s, node_count in ((category, seconds, nodes - early), (EARLY_CAPACITY, 0.0, early)):
            if name == EARLY_CAPACITY and not early:
                continue
            for share in (
                ledger.categories.setdefault(name, Share()),
                *(
                    [ledger.launches.setdefault(chosen.launch, {}).setdefault(name, Share())]
                    if chosen is not None and chosen.launch is not None
                    else []
                ),
            ):
                share.wall_s += wall_s
                share.node_hours += seconds * node_count / 3600
    for event in events:
        if event["kind"] == "trainer":
            ledger.checkpoint_blocked_s += float(event.get("checkpoint_blocked_s") or 0.0)
            ledger.evaluation_s += float(event.get("evaluation_s") or 0.0)
            ledger.data_wait_s += float(event.get("data_wait_s") or 0.0)
    return ledger


def describe(ledger: Ledger) -> str:
    """One line: `goodput 0.62: 1.3 of 2.1 node-hours trained; wall 6.9 min = training 3.1 + ...`."""
    goodput = "n/a" if ledger.goodput is None else f"{ledger.goodput:.2f}"
    parts = " + ".join(
        f"{name.replace('_', ' ')} {ledger.categories[name].wall_s / 60:.1f}"
        for name in PRIORITY
        if name in ledger.categories
    )
    trained = ledger.categories.get("training_steps", Share()).node_hours
    early = ledger.categories.get(EARLY_CAPACITY)
    return (
        f"goodput {goodput}: {trained:.3g} of {ledger.node_hours:.3g} node-hours trained; "
        f"wall {ledger.wall_s / 60:.1f} min = {parts}"
        + (f"; nodes up early for the next launch: {early.node_hours:.3g} node-hours" if early else "")
    )
