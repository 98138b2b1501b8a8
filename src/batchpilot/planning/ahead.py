"""When to ask for the next launch's nodes while the current launch trains (`cluster.capacity_ahead`).

A launch that needs more nodes than the one before it used to wait, after that one's last step, for the pool to
grow: minutes of a GPU pool's resize on GKE, paid on every node already up. The next launch's nodes are asked
for ahead instead, so that they are ready when the current launch's last step ends:

- the lead time is the longest resize up measured so far in this run (`pool` events of the goodput ledger:
  asked for to every node ready), else the configured bound `cluster.resize_lead_s`;
- the current launch's remaining time is its remaining samples over its measured rate (the main trainer's
  progress record, extrapolated from when it was written);
- the nodes are asked for `LEAD_MARGIN` times the lead time (plus the interval at which the progress is read)
  before the launch's end, and never for fewer nodes than the pool has (a pool never shrinks early: the
  current launch trains on it).

Nodes that arrive before the launch that needs them starts are paid and idle (the ledger's `early_capacity`).
With flex-start each launch has its own ProvisioningRequest: the next one is queued while the current launch
trains, no earlier than its booking could be held (`flex_start_seconds_until_ask`).
Pure arithmetic: the pool step (`workflow.ahead`) reads the events and the progress and does the resize.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LEAD_MARGIN = 1.25
"""The nodes are asked for this many lead times before the current launch's end (a resize can take longer than
the longest one measured; early nodes cost less than a late launch's idle ones)."""


@dataclass(frozen=True)
class Lead:
    """How long a resize up takes, and where that figure came from (for the log)."""

    seconds: float
    source: str


def resize_lead(events: Sequence[Mapping[str, Any]], *, configured_s: float) -> Lead:
    """The longest resize up the ledger's `pool` events measured (asked for to ready), else `configured_s`."""
    grows = [
        float(e["ready_s"]) - float(e["requested_s"])
        for e in events
        if e.get("kind") == "pool" and int(e["after"]) > int(e["before"])
    ]
    if grows:
        return Lead(max(grows), f"the longest of {len(grows)} resize(s) up measured in this run")
    return Lead(float(configured_s), "cluster.resize_lead_s (no resize up measured yet in this run)")


@dataclass(frozen=True)
class Progress:
    """The main trainer's progress record: `consumed` samples at unix time `at_s`, training `samples_per_s`."""

    consumed: int
    at_s: float
    samples_per_s: float


def remaining_s(progress: Progress, *, end_sample: int, now_s: float) -> float:
    """Seconds until the launch's last step ends, from the progress extrapolated to `now_s` (>= 0)."""
    if progress.samples_per_s <= 0:
        raise ValueError(f"samples_per_s must be positive, got {progress.samples_per_s}")
    done = progress.consumed + max(0.0, now_s - progress.at_s) * progress.samples_per_s
    return max(0.0, end_sample - done) / progress.samples_per_s


def seconds_until_ask(
    progress: Progress, *, end_sample: int, now_s: float, lead: Lead, poll_s: float
) -> float:
    """How long to wait before asking for the next launch's nodes (<= 0: ask now). `poll_s`: how long until
    the progress is looked at again, so the ask is made that much earlier (it would come late by up to one
    poll otherwise; with a lead of 0, as on a local pool, it would come at the launch's end)."""
    return remaining_s(progress, end_sample=end_sample, now_s=now_s) - LEAD_MARGIN * lead.seconds - poll_s


FLEX_START_BOOKING_S = 600.0
"""How long the cluster autoscaler holds a Provisioned request's nodes for pods that have not come yet, after
which the request is BookingExpired (its defaultReservationTime, 10 minutes: cluster-autoscaler's
provisioningrequest processors; the simulator's ProvisioningController keeps the same figure)."""
BOOKING_MARGIN_S = 120.0
"""Of that booking, what is kept for the current launch's tail and the next launch's tasks to create its pods."""


def flex_start_seconds_until_ask(progress: Progress, *, end_sample: int, now_s: float) -> float:
    """How long to wait before queueing the next launch's flex-start request (<= 0: now). It is queued no
    earlier than its booking can be held: were GKE to provision it at once, its nodes must still be booked
    when the next launch's pods come (`FLEX_START_BOOKING_S` less `BOOKING_MARGIN_S` before this launch's
    end). How long GKE queues it is not known ahead, so it is queued as early as that allows."""
    return remaining_s(progress, end_sample=end_sample, now_s=now_s) - (
        FLEX_START_BOOKING_S - BOOKING_MARGIN_S
    )


def nodes_to_ask(*, current_nodes: int, next_nodes: int | None) -> int | None:
    """The node count to ask for ahead, or None when the next launch needs no more nodes than the current one
    (or there is none): a pool is never shrunk while a launch trains on it."""
    if next_nodes is None or next_nodes <= current_nodes:
        return None
    return next_nodes
