"""The report's goodput: where the run's wall time and node-hours went (`planning.goodput`), a bar per launch
and a table per category, and the headline numbers for KFP Metrics."""

from __future__ import annotations

import html

from batchpilot.htmlpage import Html, table
from batchpilot.planning.goodput import EARLY_CAPACITY, PRIORITY, Ledger, Share, describe
from batchpilot.planning.units import format_duration

COLOURS = {
    "training_steps": "#2da44e",
    "start_up": "#bf8700",
    "pod_start": "#d4a72c",
    "tail": "#8250df",
    "failed": "#cf222e",
    "waiting_for_nodes": "#0969da",
    "idle": "#afb8c1",
    EARLY_CAPACITY: "#eac54f",
}
"""One colour per category, the same in every bar and in the table's key."""

MEANING = {
    "training_steps": "first step to last (checkpoints blocking and validation included)",
    "start_up": "process start to first step: rendezvous, model build, checkpoint load, first compile",
    "pod_start": "job submitted to process start: scheduling, image pull",
    "tail": "last step to the job's end: the last checkpoint, teardown",
    "failed": "a launch whose trainer never reported",
    "waiting_for_nodes": "a resize up, from asked to ready",
    "idle": "nodes up with no launch on them: explore, plan, report, between launches",
    EARLY_CAPACITY: "nodes up for the next launch beside a running one (cluster.capacity_ahead): node-hours "
    "only, the wall time is the running launch's",
}


def _bar(shares: dict[str, Share], total_s: float) -> Html:
    parts = "".join(
        f"<span title='{name.replace('_', ' ')}: {shares[name].wall_s:.1f} s' style='display:inline-block;height:14px;"
        f"width:{100 * shares[name].wall_s / total_s:.2f}%;background:{COLOURS[name]}'></span>"
        for name in PRIORITY
        if name in shares and total_s > 0
    )
    return Html(f"<div style='width:420px;border:1px solid #d1d9e0;line-height:0'>{parts}</div>")


def goodput_section(ledger: Ledger, *, modelled_resize_delay_s: float = 0.0) -> str:
    """`<h2>Where the node-hours went</h2>`: the summary line, a bar per launch, the run's bar, and a table
    of the categories (wall time, node-hours, what each holds). `modelled_resize_delay_s`: a local pool's
    modelled resize (`cluster.local_resize_delay_s`), said beside the figures it is in."""
    rows = [
        (
            name,
            _bar(shares, sum(s.wall_s for s in shares.values())),
            format_duration(sum(s.wall_s for s in shares.values())),
        )
        for name, shares in ledger.launches.items()
    ]
    rows.append(("the run", _bar(ledger.categories, ledger.wall_s), format_duration(ledger.wall_s)))
    key = [
        (
            Html(
                f"<span style='display:inline-block;width:10px;height:10px;background:{COLOURS[name]}'></span> "
            )
            + html.escape(name.replace("_", " ")),
            format_duration(ledger.categories[name].wall_s),
            f"{ledger.categories[name].node_hours:.4g}",
            MEANING[name],
        )
        for name in (*PRIORITY, EARLY_CAPACITY)
        if name in ledger.categories
    ]
    of_training = (
        f"Of the training steps, checkpoints blocked {ledger.checkpoint_blocked_s:.1f} s, validation took "
        f"{ledger.evaluation_s:.1f} s and the steps waited {ledger.data_wait_s:.1f} s for their data (the main "
        "trainers' own sums)."
    )
    modelled = (
        f"<p><b>A resize delay is modelled</b>: the local pool's new nodes were ready "
        f"{modelled_resize_delay_s:g} s after each resize up (<code>cluster.local_resize_delay_s</code>), a "
        "stand-in for a cloud pool's; waiting for nodes holds that wait.</p>"
        if modelled_resize_delay_s
        else ""
    )
    return (
        "<h2>Where the node-hours went</h2>"
        f"<p>{html.escape(describe(ledger))}</p>"
        + modelled
        + table(["launch", "wall time by category", "wall"], rows, align="llr")
        + table(["category", "wall", "node-hours", "what it holds"], key, align="lrrl")
        + f"<p class='muted'>{html.escape(of_training)} From the events the pool tasks, the train tasks and the "
        "trainers record beside the checkpoints (<code>ledger/</code>); a node counts from the moment its resize "
        "was ready, so the node-hours are a lower bound by at most one resize's new nodes times its wait.</p>"
    )


def goodput_summary(ledger: Ledger) -> dict[str, float]:
    """KFP Metrics: goodput, paid and training node-hours."""
    summary = {
        "paid_node_hours": ledger.node_hours,
        "training_step_node_hours": ledger.categories.get("training_steps", Share()).node_hours,
    }
    if ledger.goodput is not None:
        summary["goodput"] = ledger.goodput
    return summary
