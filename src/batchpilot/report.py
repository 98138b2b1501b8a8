"""The run report: the plan table, the batch-size ramp, the loss curve and the exploration summary.

`write_report` makes one self-contained HTML file (plots embedded as PNG) and a Markdown plan table;
both are what the KFP UI shows for the pipeline's report step, and what `batchpilot run` leaves behind.
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path
from typing import Any

from batchpilot.files import write_atomically
from batchpilot.planning import CostEstimate, Plan
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.table import plan_table
from batchpilot.rundoc import RunDocument


def plan_markdown(plan: Plan, cost: CostEstimate | None = None, memory: MemoryPlan | None = None) -> str:
    """The stage table as Markdown (the KFP UI renders it), with its footer lines."""
    table = plan_table(plan, cost, memory)
    lines = [
        "| " + " | ".join(c.name for c in table.columns) + " |",
        "| " + " | ".join("---" if c.align == "left" else "---:" for c in table.columns) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n\n" + "\n\n".join(table.footer) + "\n"


def plan_html(plan: Plan, cost: CostEstimate | None = None, memory: MemoryPlan | None = None) -> str:
    """The stage table as an HTML table, with its footer lines."""
    table = plan_table(plan, cost, memory)
    head = "".join(f"<th>{html.escape(c.name)}</th>" for c in table.columns)
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td style='text-align:{c.align}'>{html.escape(cell)}</td>"
            for c, cell in zip(table.columns, row, strict=True)
        )
        + "</tr>"
        for row in table.rows
    )
    footer = "".join(f"<li>{html.escape(line)}</li>" for line in table.footer)
    return f"<table border='1' cellpadding='4'><tr>{head}</tr>{rows}</table><ul>{footer}</ul>"


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _pyplot() -> Any:
    """matplotlib's pyplot drawing off-screen (reports are files, often made where there is no display)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def ramp_and_loss_figures(plan: Plan, records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of the batch-size ramp with node counts, and of the loss curves (training and
    validation; none without records)."""
    plt = _pyplot()
    figures = []
    fig, axis = plt.subplots(figsize=(7, 3.2))
    xs = [x for s in plan.stages for x in (s.start_sample, s.end_sample)]
    axis.step(
        xs, [s.global_batch_size for s in plan.stages for _ in (0, 1)], where="post", label="global batch"
    )
    axis.set_xlabel("consumed samples")
    axis.set_ylabel("global batch size")
    nodes = axis.twinx()
    nodes.step(
        xs, [s.num_nodes for s in plan.stages for _ in (0, 1)], where="post", color="tab:orange",
        linestyle="--", label="nodes",
    )  # fmt: skip
    nodes.set_ylabel("nodes", color="tab:orange")
    nodes.set_ylim(0, max(s.num_nodes for s in plan.stages) + 1)
    axis.set_ylim(0, plan.stages[-1].global_batch_size * 1.1)
    axis.legend(handles=axis.get_lines() + nodes.get_lines(), loc="lower right", fontsize=8)
    figures.append(("Batch-size ramp and nodes per stage", _png(fig)))
    plt.close(fig)
    if records:
        fig = loss_figure(plan, records)
        figures.append(("Loss", _png(fig)))
        plt.close(fig)
    return figures


def validation_points(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(consumed samples, validation loss) of the steps that ended with an evaluation (`val_loss` not null;
    records of runs before validation have no such key)."""
    return [(r["consumed_samples"], float(r["val_loss"])) for r in records if r.get("val_loss") is not None]


def loss_figure(plan: Plan, records: list[dict[str, Any]]) -> Any:
    """The training loss of each stage as lines and the validation loss as markers, over consumed samples."""
    fig, axis = _pyplot().subplots(figsize=(7, 3.2))
    for stage in plan.stages:
        points = [(r["consumed_samples"], r["loss"]) for r in records if r["stage"] == stage.index]
        if points:
            axis.plot(*zip(*points, strict=True), label=f"{stage.name} (batch {stage.global_batch_size})")
    validation = validation_points(records)
    if validation:
        axis.plot(
            *zip(*validation, strict=True), linestyle="none", marker="o", markersize=4, color="black",
            label="validation",
        )  # fmt: skip
    axis.set_xlabel("consumed samples")
    axis.set_ylabel("loss")
    axis.legend(fontsize=7)
    return fig


def write_report(
    *,
    document: RunDocument,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    html_path: Path,
    markdown_path: Path | None = None,
    explore_html: Path | None = None,
    canary: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Writes the HTML report (and the Markdown table); returns the headline numbers for KFP Metrics.
    `canary`: the run's canary.json, when its canary ran."""
    plan, cost = document.plan, document.cost
    summary: dict[str, float] = {"num_stages": len(plan.stages), "micro_batch_size": plan.micro_batch_size}
    if document.memory is not None:
        summary["estimated_peak_memory_gib_per_device"] = document.memory.peak.estimate.total / 2**30
    if cost is not None:
        summary.update(estimated_hours=cost.duration_s / 3600, estimated_node_hours=cost.node_hours)
    if records:
        summary.update(
            final_loss=float(records[-1]["loss"]),
            first_loss=float(records[0]["loss"]),
            trained_samples=float(records[-1]["consumed_samples"]),
            mean_tokens_per_s=sum(r["tokens_per_s"] for r in records) / len(records),
        )
        mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
        if mfu:
            summary["mean_mfu"] = sum(mfu) / len(mfu)
        validation = validation_points(records)
        if validation:
            summary["final_val_loss"] = validation[-1][1]
        noise = [r["noise_scale"] for r in records if r.get("noise_scale")]
        if noise:
            summary["noise_scale_last"] = float(noise[-1])
    parts = [f"<h1>batchpilot run: {html.escape(document.config.name)}</h1>"]
    if explore is not None:
        parts.append(_explore_section(explore, explore_html))
    if canary is not None:
        parts.append(canary_section(canary))
    parts.append("<h2>Plan</h2>" + plan_html(plan, cost, document.memory))
    if document.notes:  # how the plan was made: explore's setting taken, the study's advice beside it
        parts.append("<ul>" + "".join(f"<li>{html.escape(note)}</li>" for note in document.notes) + "</ul>")
    if document.capacity:
        section, figures = capacity_section(document, records)
        parts.append(section)
        summary.update(figures)
    if document.decisions:
        parts.append(_decisions_section(document))
        summary["adaptive_decisions"] = len(document.decisions)
    for title, png in ramp_and_loss_figures(plan, records):
        parts.append(
            f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
        )
    parts.append(
        "<h2>Summary</h2><ul>" + "".join(f"<li>{k}: {v:,.4g}</li>" for k, v in summary.items()) + "</ul>"
    )
    write_atomically(
        html_path,
        "<!doctype html><html><head><meta charset='utf-8'><title>batchpilot</title></head><body>"
        + "\n".join(parts)
        + "</body></html>\n",
    )
    if markdown_path is not None:
        write_atomically(markdown_path, plan_markdown(plan, cost, document.memory))
    return summary


def canary_section(canary: dict[str, Any]) -> str:
    """The canary's figures (canary.json): nodes and devices, bus bandwidth against the expected figure,
    shard reads and checkpoint probes per node."""
    expected = canary.get("expected_bus_bandwidth_bytes_per_s")
    measured = canary["bus_bandwidth_bytes_per_s"]
    versus = (
        f" ({measured / expected:.0%} of the ~{expected / 1e9:.0f} GB/s expected between "
        f"{html.escape(str(canary.get('machine_type')))} nodes)"
        if expected
        else " (no expected figure: one node, or a machine type without a documented network bandwidth)"
    )
    warning = canary.get("bandwidth_warning")
    rows = "".join(
        f"<tr><td>{n['node']}</td><td>{html.escape(str(n['host']))}</td><td>{n['processes']}</td>"
        f"<td>{n['devices']}</td><td>{_figure(n.get('read_mb_per_s'), '.0f')}</td>"
        f"<td>{_figure(n.get('checkpoint_write_ms'), '.1f')}</td>"
        f"<td>{_figure(n.get('checkpoint_read_ms'), '.1f')}</td></tr>"
        for n in canary["nodes"]
    )
    return (
        f"<h2>Canary</h2><p>{canary['num_nodes']} node(s) x {canary['processes_per_node']} process(es), "
        f"{html.escape(canary['backend'])} all-reduce of {canary['all_reduce_bytes'] / 2**20:.0f} MiB: bus bandwidth "
        f"{measured / 1e9:.2f} GB/s{versus}.</p>"
        + (f"<p><strong>Warning: {html.escape(warning)}</strong></p>" if warning else "")
        + "<table border='1' cellpadding='4'><tr><th>node</th><th>host</th><th>processes</th><th>GPUs seen</th>"
        "<th>shard read MB/s</th><th>checkpoint write ms</th><th>checkpoint read ms</th></tr>"
        + rows
        + "</table>"
    )


def capacity_section(document: RunDocument, records: list[dict[str, Any]]) -> tuple[str, dict[str, float]]:
    """The launches that trained on fewer nodes than planned (`cluster.fewer_nodes: allow`): planned, ready
    and used nodes, the wait, and what it saved or cost, with the summary figures for KFP.

    The training time is the launch's measured step times. On fewer nodes the same samples take longer
    but, at the per-device throughput the plan assumes, the same node-hours; what the shortfall costs is
    the wait for capacity (the ready nodes, idle) and the later finish."""
    rows = []
    waiting_node_hours = trained_node_hours = later_h = 0.0
    for record in document.capacity:
        steps = [r for r in records if record.first_stage <= r["stage"] <= record.last_stage]
        trained_s = sum(float(r.get("step_time_s") or 0.0) for r in steps)
        trained = record.nodes * trained_s / 3600
        waiting = record.ready_nodes * record.waited_s / 3600
        later = trained_s * (1 - record.nodes / record.planned_nodes) / 3600
        waiting_node_hours += waiting
        trained_node_hours += trained
        later_h += later
        rows.append(
            f"<tr><td>{html.escape(record.launch)}</td><td>{record.planned_nodes}</td><td>{record.ready_nodes}</td>"
            f"<td>{record.nodes}</td><td>{record.waited_s:,.0f}</td><td>{waiting:,.3g}</td>"
            f"<td>{trained_s / 3600:,.3g}</td><td>{trained:,.3g}</td><td>{later:,.3g}</td>"
            f"<td>{html.escape(record.reason)}</td></tr>"
        )
    section = (
        "<h2>Capacity: launches on fewer nodes than planned</h2><p>These launches got only some of their planned "
        "nodes within cluster.capacity_timeout_s and, with cluster.fewer_nodes: allow, trained on the largest node "
        "count their global batches split over: the same batches, samples and learning rate, with more gradient "
        "accumulation. At the same throughput per device the training node-hours are those the plan expected; the "
        "shortfall cost the wait (the ready nodes, idle) and a later finish.</p>"
        "<table border='1' cellpadding='4'><tr><th>launch</th><th>planned nodes</th><th>ready</th><th>trained on"
        "</th><th>waited (s)</th><th>waiting node-hours</th><th>training hours</th><th>training node-hours</th>"
        "<th>hours later than on the planned nodes</th><th>why</th></tr>" + "".join(rows) + "</table>"
    )
    figures = {
        "launches_on_fewer_nodes": float(len(document.capacity)),
        "capacity_wait_node_hours": waiting_node_hours,
        "fewer_nodes_hours_later": later_h,
    }
    return section, figures


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _decisions_section(document: RunDocument) -> str:
    """The adaptive ramp-up's decision log: why each stage ended and what came next."""
    rows = []
    for taken in document.decisions:
        decision = taken.decision
        estimate = "" if decision.estimate is None else f"{decision.estimate:,.1f}"
        stderr = "" if decision.stderr is None else f"{decision.stderr:,.1f}"
        lower = "" if decision.lower_bound is None else f"{decision.lower_bound:,.1f}"
        k = "" if decision.confidence is None else f"{decision.confidence:g}"
        rows.append(
            f"<tr><td>stage-{taken.stage}</td><td>{taken.end_sample:,}</td><td>{decision.stage_samples:,}</td>"
            f"<td>{estimate}</td><td>{stderr}</td><td>{lower}</td><td>{k}</td><td>{decision.threshold or ''}</td>"
            f"<td>{html.escape(decision.reason)}</td><td>{taken.next_batch}</td></tr>"
        )
    return (
        "<h2>Adaptive ramp-up decisions</h2><p>Each stage ended when the lower bound of the smoothed gradient "
        "noise scale (the critical batch estimate less k jackknife standard errors, times "
        "<code>adaptive.scale</code>) stayed at or above the next batch size the node schedule accepts for the "
        "configured patience (reason noise_scale), or at the ramp's end (ramp_end).</p>"
        "<table border='1' cellpadding='4'><tr><th>stage</th><th>ended at sample</th><th>samples in stage</th>"
        "<th>estimate</th><th>+- (jackknife)</th><th>lower bound</th><th>k</th><th>threshold</th><th>reason</th>"
        "<th>next batch</th></tr>" + "".join(rows) + "</table>"
    )


def _explore_plots(explore_html: Path | None) -> str:
    """The plots of explore.html (self-contained <img> tags), when that file is at hand."""
    if explore_html is None or not explore_html.is_file():
        return ""
    return "".join(re.findall(r"<img [^>]*>", explore_html.read_text()))


def _explore_section(explore: dict[str, Any], explore_html: Path | None) -> str:
    recommendation = explore.get("recommendation") or {}
    items = "".join(
        f"<li>{html.escape(str(k))}: {html.escape(str(v))}</li>"
        for k, v in recommendation.items()
        if not isinstance(v, dict | list)
    )
    fits = [p for p in explore.get("probes", []) if p.get("fits")]
    rows = "".join(
        f"<tr><td>{p['micro_batch_size']}</td><td>{p['activation_checkpointing']}</td>"
        f"<td>{p.get('tokens_per_s', 0):,.0f}</td><td>{p.get('peak_memory_bytes', 0):,}</td></tr>"
        for p in sorted(fits, key=lambda p: (p["activation_checkpointing"], p["micro_batch_size"]))
    )
    table = (
        "<table border='1' cellpadding='4'><tr><th>micro batch</th><th>activation checkpointing</th>"
        f"<th>tokens/s</th><th>peak memory bytes</th></tr>{rows}</table>"
    )
    notes = "".join(f"<li>{html.escape(str(note))}</li>" for note in recommendation.get("plan_notes") or [])
    notes_html = f"<p>For the plan:</p><ul>{notes}</ul>" if notes else ""
    return f"<h2>Exploration</h2><ul>{items}</ul>{notes_html}{_explore_plots(explore_html)}{table}"
