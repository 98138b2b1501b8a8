"""The next launch's nodes, asked for while the current launch trains (`cluster.capacity_ahead`).

In the pipeline this step runs beside a launch's train task (a pool task of its own): it follows the launch's
progress record and, when the remaining time falls to the resize's lead time (`planning.ahead`), grows the pool
to the next launch's node count, so that the next launch's own resize finds its nodes ready. It never shrinks
the pool, changes nothing the current launch trains on, and ends when the launch ends (whether or not it asked:
the next launch's resize then does it as before) or at its bound, saying which.
"""

from __future__ import annotations

import logging
import time

from batchpilot import runstate
from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.adaptive import is_adaptive
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.ahead import (
    BOOKING_MARGIN_S,
    FLEX_START_BOOKING_S,
    LEAD_MARGIN,
    Lead,
    Progress,
    flex_start_seconds_until_ask,
    nodes_to_ask,
    remaining_s,
    resize_lead,
    seconds_until_ask,
)
from batchpilot.planning.launches import Launch
from batchpilot.planning.tpu import is_tpu
from batchpilot.planning.units import format_duration
from batchpilot.workflow.document import current_document
from batchpilot.workflow.pool import prepare_pool, record_pool_event
from batchpilot.workflow.stage import cluster_spec, pipeline_launch
from batchpilot.workflow.timeouts import task_timeouts

logger = logging.getLogger(__name__)

POLL_S = 10.0
"""How often the launch's progress is read (the trainer writes it about as often)."""
END_POLL_S = 2.0
"""How often the launch's end is looked for: the next launch starts only once this task has ended too."""


def ahead_unavailable(config: Config) -> str | None:
    """Why this config's next launch's nodes cannot be asked for ahead (None: they can)."""
    cluster = config.cluster
    if cluster.capacity_ahead == "off":
        return "cluster.capacity_ahead is off"
    if is_adaptive(config):
        return "an adaptive ramp-up decides the next launch's batch, and so its nodes, when this launch ends"
    if cluster.backend == "gke":
        if is_tpu(cluster.accelerator_type) and cluster.pool_mode == "resize":
            if cluster.tpu_slice_change != "create-first":
                return (
                    "cluster.tpu_slice_change is delete-first: the next launch's slice may stand beside the "
                    "current one only with create-first (the TPU quota must hold both)"
                )
            return None
        if cluster.provisioning == "flex-start" and cluster.kueue_queue:
            return (
                "with cluster.kueue_queue, Kueue's ProvisioningRequest admission check asks GKE for a launch's "
                "nodes once it reserves that launch's quota; a request of batchpilot's ahead would ask twice"
            )
        if cluster.pool_mode == "autoscale":
            return "an autoscaled pool grows when the next launch's pods ask for nodes"
        if cluster.pool_mode == "static":
            return "a static pool is never resized"
    return None


def bring_next_nodes(document: RunDocument, *, launch_index: int, poll_s: float = POLL_S) -> str:
    """Follows the launch in `launch_index` and grows the pool to the next launch's nodes in time (module
    docstring); returns what it did, in words (also logged)."""
    config = document.config
    current = pipeline_launch(document, slot=launch_index)
    why_not = ahead_unavailable(config)
    if current is None or why_not is not None:
        return _said(f"launch-{launch_index}: nothing to ask for ahead: {why_not or 'an unused launch slot'}")
    following = pipeline_launch(document, slot=launch_index + 1)
    flex = config.cluster.backend == "gke" and config.cluster.provisioning == "flex-start"
    tpu = config.cluster.backend == "gke" and is_tpu(config.cluster.accelerator_type)
    next_nodes = None if following is None else following.requested_nodes
    # flex-start: every launch has its own request and nodes, and TPU slices their own pool (another shape),
    # so any next launch on other nodes is asked for; a resized pool only ever grows early
    if flex or tpu:
        wanted = None if tpu and next_nodes == current.num_nodes else next_nodes
    else:
        wanted = nodes_to_ask(current_nodes=current.num_nodes, next_nodes=next_nodes)
    if following is None or wanted is None:
        after = "the last launch" if following is None else f"{following.name} needs {next_nodes}"
        return _said(
            f"{current.name}: nothing to ask for ahead ({after}; it trains on {current.num_nodes} node(s) and a "
            "pool is never shrunk early)"
        )
    uri, stages = config.train.checkpoint_uri, [current.first_stage, current.last_stage]
    end_sample = document.plan.stages[current.last_stage].end_sample
    started_s = time.time()
    lead = resize_lead(runstate.read_events(uri), configured_s=config.cluster.resize_lead_s)
    bound_s = task_timeouts(config).train_s
    if flex:
        logger.info(
            "%s: %s's ProvisioningRequest for %d node(s) will be queued %s before this launch's last step (no "
            "earlier: a provisioned request's nodes are booked %s); following it for at most %s",
            current.name, following.name, wanted, format_duration(FLEX_START_BOOKING_S - BOOKING_MARGIN_S),
            format_duration(FLEX_START_BOOKING_S), format_duration(bound_s),
        )  # fmt: skip
    else:
        logger.info(
            "%s: %d node(s) for %s will be asked for %.0f s before this launch's last step (a resize up takes "
            "%.0f s: %s); following it for at most %s",
            current.name, wanted, following.name, lead.seconds * LEAD_MARGIN + poll_s, lead.seconds,
            lead.source, format_duration(bound_s),
        )  # fmt: skip
    wait_s = 0.0  # until the progress is read next
    while True:
        ended = _launch_ended(uri, current.name, since_s=started_s)
        if ended is not None:
            return _said(
                f"{current.name} ended (exit code {ended}) before its next launch's nodes were due: "
                f"{following.name}'s own task asks for them"
            )
        if time.time() - started_s > bound_s:
            return _said(
                f"{current.name}: waited {bound_s:.0f} s (the train task's timeout) for this launch's progress "
                f"without asking; {following.name}'s own task asks for its nodes"
            )
        if wait_s <= 0:
            due = _seconds_until_due(
                uri, stages=stages, end_sample=end_sample, lead=lead, poll_s=poll_s, flex=flex
            )
            if due is not None and due <= 0:
                if flex:
                    return _queue_request(document, current=current.name, following=following)
                if tpu:
                    return _next_slice(config, current=current.name, following=following.name, hosts=wanted)
                return _grow(config, current=current.name, following=following.name, nodes=wanted)
            wait_s = END_POLL_S if due is None else min(poll_s, due)  # no progress yet: the launch starts
        time.sleep(min(END_POLL_S, wait_s))
        wait_s -= END_POLL_S


def _seconds_until_due(
    uri: str, *, stages: list[int], end_sample: int, lead: Lead, poll_s: float, flex: bool
) -> float | None:
    """Seconds until the next launch's nodes are to be asked for (None: the launch wrote no progress yet)."""
    record = runstate.read_progress(uri, stages=stages)
    if record is None:
        return None
    progress = Progress(
        consumed=int(record["consumed"]),
        at_s=float(record["at_s"]),
        samples_per_s=float(record["samples_per_s"]),
    )
    now = time.time()
    if flex:
        return flex_start_seconds_until_ask(progress, end_sample=end_sample, now_s=now)
    due = seconds_until_ask(progress, end_sample=end_sample, now_s=now, lead=lead, poll_s=poll_s)
    if due <= 0:
        logger.info(
            "about %.0f s of training left at %.1f samples/s (a resize up takes %.0f s)",
            remaining_s(progress, end_sample=end_sample, now_s=now), progress.samples_per_s, lead.seconds,
        )  # fmt: skip
    return due


def _grow(config: Config, *, current: str, following: str, nodes: int) -> str:
    """Grows the pool to `nodes` for the launch `following` while `current` trains."""
    logger.info("%s: asking for %s's %d node(s) now", current, following, nodes)
    try:
        change = prepare_pool(config, num_nodes=nodes, early=True)
    except BatchpilotError as error:  # not this launch's failure: the next launch's resize tries again
        logger.warning("%s: the pool did not grow ahead: %s", current, error)
        return _said(f"{current}: nothing asked ahead ({error}); {following}'s own resize tries again")
    return _said(
        f"{current}: the pool grew {change.before} -> {change.after} node(s) for {following} in "
        f"{change.elapsed_s:.1f} s, while this launch trained"
    )


def _next_slice(config: Config, *, current: str, following: str, hosts: int) -> str:
    """TPU (`tpu_slice_change: create-first`): brings up the slice of `hosts` for `following` beside the slice
    `current` trains on; the next launch's resize deletes the old one."""
    from batchpilot.cluster.tpu_pool import tpu_node_pool

    pool = tpu_node_pool(config.cluster, run=config.name)
    before = pool.current_size()
    requested_s = time.time()
    logger.info("%s: bringing up %s's slice of %d host(s) now", current, following, hosts)
    try:
        after = pool.create_ahead(hosts)
    except BatchpilotError as error:  # not this launch's failure: the next launch's resize tries again
        logger.warning("%s: no slice brought up ahead: %s", current, error)
        return _said(f"{current}: nothing asked ahead ({error}); {following}'s own resize tries again")
    record_pool_event(config, before=before, after=after, requested_s=requested_s, early=True)
    return _said(
        f"{current}: {following}'s slice of {hosts} host(s) is up beside this launch's ({before} -> {after} "
        "node(s)), while this launch trained"
    )


def _queue_request(document: RunDocument, *, current: str, following: Launch) -> str:
    """Flex-start: queues the ProvisioningRequest of the launch `following` while `current` trains; its train
    task adopts it (`cluster.provisioning.adopt_or_clear`)."""
    from batchpilot.cluster.launch import ask_capacity_ahead

    current_run = current_document(document)
    try:
        done = ask_capacity_ahead(cluster_spec(current_run, following), cluster=current_run.config.cluster)
    except BatchpilotError as error:  # not this launch's failure: the next launch's task asks again
        logger.warning("%s: no ProvisioningRequest queued ahead: %s", current, error)
        return _said(f"{current}: nothing asked ahead ({error}); {following.name}'s own task asks")
    return _said(f"{current}: {done}, for {following.name}, while this launch trained")


def _launch_ended(uri: str, name: str, *, since_s: float) -> int | None:
    """The exit code of the launch `name` if its train task recorded its end after `since_s` (None: not yet)."""
    for event in reversed(runstate.read_events(uri, kind="launch")):
        if event["launch"] == name and float(event["ended_s"]) >= since_s:
            return int(event["exit_code"])
    return None


def _said(line: str) -> str:
    logger.info("%s", line)
    return line
