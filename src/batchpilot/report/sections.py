"""The report's sections of what not every run has: the canary's checks, the launches that trained on fewer
nodes than planned, an adaptive ramp-up's decisions and the batch trials (with the figures the KFP UI
shows for them).
"""

from __future__ import annotations

import html
from typing import Any

from batchpilot.htmlpage import bullets, figure, table
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.units import (
    format_duration,
    format_int,
    format_loss,
    format_node_hours,
    format_number,
)
from batchpilot.report.figures import png, trials_figure


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
    # canary.json before the canary failed on them carried the bandwidth verdict as a warning
    problem = (
        canary.get("transport_problem") or canary.get("bandwidth_problem") or canary.get("bandwidth_warning")
    )
    if canary.get("nccl_version"):
        networks = ", ".join(canary.get("nccl_networks") or []) or "not logged"
        versus += f"; NCCL {html.escape(str(canary['nccl_version']))} over {html.escape(networks)}"
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
        + (f"<p><strong>The canary failed: {html.escape(problem)}</strong></p>" if problem else "")
        + "<table><tr><th>node</th><th>host</th><th>processes</th><th>GPUs seen</th>"
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
            f"<td>{record.nodes}</td><td>{format_duration(record.waited_s)}</td><td>{format_node_hours(waiting)}</td>"
            f"<td>{format_duration(trained_s)}</td><td>{format_node_hours(trained)}</td>"
            f"<td>{format_duration(later * 3600)}</td>"
            f"<td>{html.escape(record.reason)}</td></tr>"
        )
    section = (
        "<h2>Capacity: launches on fewer nodes than planned</h2><p>These launches got only some of their planned "
        "nodes within cluster.capacity_timeout_s and, with cluster.fewer_nodes: allow, trained on the largest node "
        "count their global batches split over: the same batches, samples and learning rate, with more gradient "
        "accumulation. At the same throughput per device the training node-hours are those the plan expected; the "
        "shortfall cost the wait (the ready nodes, idle) and a later finish.</p>"
        "<table><tr><th>launch</th><th>planned nodes</th><th>ready</th><th>trained on"
        "</th><th>waited</th><th>waiting node-hours</th><th>training time</th><th>training node-hours</th>"
        "<th>later than on the planned nodes by</th><th>why</th></tr>" + "".join(rows) + "</table>"
    )
    figures = {
        "launches_on_fewer_nodes": float(len(document.capacity)),
        "capacity_wait_node_hours": waiting_node_hours,
        "fewer_nodes_hours_later": later_h,
    }
    return section, figures


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def decisions_section(document: RunDocument) -> str:
    """The adaptive ramp-up's decision log: why each stage ended and what came next."""
    rows = []
    for taken in document.decisions:
        decision = taken.decision
        estimate = "" if decision.estimate is None else format_number(decision.estimate)
        stderr = "" if decision.stderr is None else format_number(decision.stderr)
        lower = "" if decision.lower_bound is None else format_number(decision.lower_bound)
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
        "<table><tr><th>stage</th><th>ended at sample</th><th>samples in stage</th>"
        "<th>estimate</th><th>+- (jackknife)</th><th>lower bound</th><th>k</th><th>threshold</th><th>reason</th>"
        "<th>next batch</th></tr>" + "".join(rows) + "</table>"
    )


def trials_section(
    document: RunDocument, *, study_critical_batch: float | None, study_caveat: str | None = None
) -> str:
    """The batch trials (#25): the decision, one row per branch (the best LR per batch and the chosen branch
    marked, a failed branch with its reason), the validation loss of each branch over its tokens, and the
    chosen batch and LR beside the study's critical batch when explore measured one (with `study_caveat`,
    what to make of it, beside it)."""
    outcome, trials = document.trials_outcome, document.trials
    assert outcome is not None and trials is not None  # a decided document carries both
    decision = outcome.decision
    branches = {branch.index: branch for branch in trials.branches}
    rows = []
    for result in outcome.results:
        branch = branches[result.index]
        best = decision.best.get(result.global_batch_size)
        is_best = result.status == "ok" and best is not None and best[0] == result.lr_multiplier
        chosen = is_best and result.global_batch_size == decision.critical_batch
        rows.append(
            [
                branch.name, format_int(branch.global_batch_size), f"{branch.lr_multiplier:g}",
                format_number(branch.lr), str(branch.num_nodes), result.status,
                format_loss(result.final_loss) if result.final_loss is not None else "",
                "best, chosen" if chosen else "best" if is_best else "", result.reason,
            ]
        )  # fmt: skip
    header = [
        "branch", "global batch", "LR multiplier", "LR", "nodes", "status", "final validation loss",
        "best at its batch", "why it failed",
    ]  # fmt: skip
    if decision.critical_batch is None or decision.lr_multiplier is None:
        chosen_text = "<p><b>Chosen:</b> nothing: the trials decided no critical batch.</p>"
    else:
        chosen_branch = next(
            branches[r.index]
            for r in outcome.results
            if (r.global_batch_size, r.lr_multiplier) == (decision.critical_batch, decision.lr_multiplier)
        )
        study = (
            f"; explore's noise-scale study measured a critical batch of {format_number(study_critical_batch)}"
            + (f" ({study_caveat})" if study_caveat else "")
            if study_critical_batch
            else ""
        )
        chosen_text = (
            f"<p><b>Chosen:</b> global batch {format_int(decision.critical_batch)} with LR x "
            f"{decision.lr_multiplier:g} ({format_number(chosen_branch.lr)}){html.escape(study)}. The run's target "
            f"global batch: {format_int(document.plan.stages[-1].global_batch_size)}.</p>"
        )
    if outcome.scale_calibration is not None and outcome.noise_scale_at_start is not None:
        chosen_text += (
            f"<p><b>Calibration:</b> B_simple at the branch point (the warm-up's last measurement) was "
            f"{format_number(outcome.noise_scale_at_start)} samples; the critical batch over it is "
            f"{format_number(outcome.scale_calibration)}, the adaptive ramp-up's <code>scale</code> for this model "
            "and data (trials.calibrate_adaptive applies it).</p>"
        )
    start = (
        f"from {trials.from_checkpoint}"
        if trials.from_checkpoint
        else f"after a warm-up of {format_int(trials.warmup_samples)} samples at batch {format_int(trials.start_batch)}"
    )
    plot = figure(
        "Validation loss of each branch over its tokens",
        png(trials_figure(outcome.results, seq_len=trials.seq_len)),
    )
    return (
        f"<h2>Batch trials</h2><p><b>Decision:</b> {html.escape(decision.reason)}.</p>{chosen_text}"
        f"<p>{len(trials.branches)} branches {html.escape(start)}, each {format_int(trials.branch_samples)} samples "
        f"({format_int(trials.branch_samples * trials.seq_len)} tokens) on the same samples, evaluated every "
        f"{format_int(trials.eval_every_samples)} samples; tolerance {trials.tolerance:.1%}.</p>"
        + (bullets([f"excluded: {line}" for line in decision.excluded]) if decision.excluded else "")
        + table(header, rows, align="lrrrrlrll")
        + f"<div class='figures'>{plot}</div>"
    )


def trials_summary(document: RunDocument) -> dict[str, float]:
    """The trials' decision for KFP metrics: branches, failed ones, and the critical batch and LR multiplier
    when one was decided."""
    outcome = document.trials_outcome
    assert outcome is not None
    summary = {
        "trials_branches": float(len(outcome.results)),
        "trials_failed_branches": float(sum(r.status != "ok" for r in outcome.results)),
    }
    if outcome.decision.critical_batch is not None and outcome.decision.lr_multiplier is not None:
        summary |= {
            "trials_critical_batch": float(outcome.decision.critical_batch),
            "trials_lr_multiplier": outcome.decision.lr_multiplier,
        }
    return summary
