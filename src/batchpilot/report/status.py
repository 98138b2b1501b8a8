"""The run's status on its report: the header's completed or failed and the date of the last record, and for
a failed run, what ran (the tasks and stages that left records), where it stopped and why (with a table of
the steps recorded, for a run that stopped before its plan.json was written)."""

from __future__ import annotations

import html
from itertools import groupby
from typing import Any

from batchpilot.htmlpage import Html, bullets, table
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.launches import launches
from batchpilot.planning.units import format_int, format_loss, format_ratio
from batchpilot.report.clock import RunClock, local_time


def run_header(name: str, clock: RunClock, *, failure: str | None) -> str:
    """`batchpilot run: demo` and, under it, `completed` or `failed` with the local time of the last record."""
    status = "failed" if failure is not None else "completed"
    ended = clock.ended_at
    when = f"last record {local_time(ended)}" if ended is not None else "no record carries a wall clock"
    return (
        f"<h1>batchpilot run: {html.escape(name)}</h1><p class='status'><span class='state {status}'>{status}"
        f"</span> <span class='muted'>{html.escape(when)}</span></p>"
    )


def _canary_line(canary: dict[str, Any]) -> str:
    problem = canary.get("transport_problem") or canary.get("bandwidth_problem")
    figures = (
        f"canary: {canary['num_nodes']} node(s), {canary['backend']} all-reduce "
        f"{canary['bus_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s bus bandwidth"
    )
    return f"{figures}; it failed: {problem}" if problem else f"{figures}; passed"


def _explore_line(explore: dict[str, Any]) -> str:
    rec = explore["recommendation"]
    return (
        f"explore: {len(explore['probes'])} probe(s), recommended micro_batch_size={rec['micro_batch_size']} "
        f"({format_ratio(rec['estimated_speedup'])} the base micro batch's tokens/s)"
    )


def _stage_lines(document: RunDocument | None, records: list[dict[str, Any]]) -> list[str]:
    """Per stage with records: its steps and samples; then the planned stages no step reached."""
    lines = []
    names = {s.index: s.name for s in document.plan.stages} if document else {}
    for index, rows in groupby(records, key=lambda r: r["stage"]):
        steps = list(rows)
        name = names.get(index, f"stage {index}")
        lines.append(
            f"{name}: {len(steps)} step(s) to sample {format_int(steps[-1]['consumed_samples'])}, last loss "
            f"{format_loss(float(steps[-1]['loss']))}"
        )
    if document is not None:
        trained = {r["stage"] for r in records}
        left = [s.name for s in document.plan.stages if s.index not in trained]
        if left:
            lines.append(f"not reached: {', '.join(left)}")
    return lines


def ran_lines(
    *,
    document: RunDocument | None,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    canary: dict[str, Any] | None,
) -> list[str]:
    """What ran, in the pipeline's order, as far as the records tell: canary, explore, plan, the stages."""
    lines = [_canary_line(canary) if canary else "canary: no canary.json (it did not run or did not finish)"]
    lines.append(_explore_line(explore) if explore else "explore: no explore.json")
    if document is None:
        lines.append("plan: no plan.json (planning did not finish)")
    else:
        plan = document.plan
        lines.append(
            f"plan: {len(plan.stages)} stage(s) in {len(launches(plan))} launch(es), "
            f"{format_int(plan.num_steps)} optimizer steps, {format_int(plan.trained_samples)} samples"
        )
    return lines + (_stage_lines(document, records) if records else ["training: no step recorded"])


def stopped_at(
    *,
    document: RunDocument | None,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    canary: dict[str, Any] | None,
) -> str:
    """Where the run stopped: the last stage and sample it recorded, or the last task that left a file."""
    if records:
        last = records[-1]
        stage = (
            next((s for s in document.plan.stages if s.index == last["stage"]), None) if document else None
        )
        planned = f" of {format_int(document.plan.trained_samples)} planned" if document else ""
        name = stage.name if stage else f"stage {last['stage']}"
        return (
            f"in {name} after step {format_int(last['step'])}, at sample {format_int(last['consumed_samples'])}"
            f"{planned}"
        )
    done = [
        task
        for task, record in (("the canary", canary), ("explore", explore), ("planning", document))
        if record is not None
    ]
    return f"before the first training step, after {done[-1]}" if done else "before any task left a record"


def stopped_section(
    *,
    document: RunDocument | None,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    canary: dict[str, Any] | None,
    failure: str,
) -> str:
    """Why, where and after what the run stopped, for the top of a failed run's report."""
    where = stopped_at(document=document, records=records, explore=explore, canary=canary)
    ran = ran_lines(document=document, records=records, explore=explore, canary=canary)
    return (
        f"<div class='warn'><p><b>Why it failed:</b> {html.escape(failure)}</p>"
        f"<p><b>Where it stopped:</b> {html.escape(where)}</p><b>What ran:</b>{bullets(ran)}</div>"
    )


def records_table(records: list[dict[str, Any]]) -> Html:
    """Per stage with records (a run without its plan): steps, the samples reached, the last losses."""
    rows = []
    for index, group in groupby(records, key=lambda r: r["stage"]):
        steps = list(group)
        validation = [r["val_loss"] for r in steps if r.get("val_loss") is not None]
        rows.append(
            [
                str(index),
                format_int(len(steps)),
                format_int(steps[-1]["consumed_samples"]),
                format_int(steps[-1].get("global_batch_size") or 0),
                format_loss(float(steps[-1]["loss"])),
                format_loss(float(validation[-1])) if validation else "",
            ]
        )
    header = ["stage", "steps", "to sample", "global batch", "last loss", "validation loss"]
    return table(header, rows, align="rrrrrr")
