"""The run report (report.html): what a practitioner asks of a finished run, in that order. Its status
(completed or failed, and for a failed run why, where it stopped and what ran) and the date of its last
record; a headline (losses, steps, samples, tokens, the wall time from the run's first task, time and
node-hours against the plan's estimate, the micro batch trained and why, parallelism, MFU, nodes), each
launch and stage with its actuals beside the plan, the plots over consumed samples, the plan, and the
exploration as explore.html presents it. Numbers are formatted for people
(`batchpilot.planning.units`); the page is one self-contained file (plots embedded as PNG) that the KFP UI
shows for the pipeline's report step and that `batchpilot run` leaves behind, beside the Markdown plan table.
The plots are `report.figures`; the sections of what not every run has are `report.sections`; the wall
clock is `report.clock`, the status and a failed run's account `report.status`.
"""

from __future__ import annotations

import html
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.explore.records import Setting
from batchpilot.explore.report import (
    THROUGHPUT_EXPLAINED,
    probe_table,
    rebuilt_state,
    recommendation_sentence,
    size_speedups,
    study_caveat,
    study_section,
)
from batchpilot.files import write_atomically
from batchpilot.htmlpage import Html, bullets, figure, page, table
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning import CostEstimate, Plan
from batchpilot.planning.goodput import Ledger
from batchpilot.planning.launches import launches
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.table import plan_table
from batchpilot.planning.units import (
    format_bytes,
    format_duration,
    format_int,
    format_loss,
    format_node_hours,
    format_ratio,
)
from batchpilot.report.clock import RunClock, run_clock, wall_detail
from batchpilot.report.figures import loss_figure, run_figures, validation_points
from batchpilot.report.goodput import goodput_section, goodput_summary
from batchpilot.report.sections import (
    canary_section,
    capacity_section,
    decisions_section,
    trials_section,
    trials_summary,
)
from batchpilot.report.status import records_table, run_header, stopped_section

__all__ = ["loss_figure", "plan_html", "plan_markdown", "write_report", "write_unplanned_report"]


def plan_markdown(plan: Plan, cost: CostEstimate | None = None, memory: MemoryPlan | None = None) -> str:
    """The stage table as Markdown (the KFP UI renders it), with its footer lines."""
    model = plan_table(plan, cost, memory)
    lines = [
        "| " + " | ".join(c.name for c in model.columns) + " |",
        "| " + " | ".join("---" if c.align == "left" else "---:" for c in model.columns) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in model.rows]
    return "\n".join(lines) + "\n\n" + "\n\n".join(model.footer) + "\n"


def plan_html(plan: Plan, cost: CostEstimate | None = None, memory: MemoryPlan | None = None) -> str:
    """The stage table as an HTML table, with its footer lines."""
    model = plan_table(plan, cost, memory)
    align = "".join("l" if c.align == "left" else "r" for c in model.columns)
    return table([c.name for c in model.columns], model.rows, align=align) + bullets(model.footer)


@dataclass(frozen=True)
class StageActuals:
    """What one stage did, from its metrics records."""

    index: int
    num_steps: int
    num_samples: int
    trained_s: float
    """The sum of the stage's step times: training alone, without the launch's start or a resize."""
    num_nodes: int
    last_loss: float
    val_loss: float | None
    mfu: float | None


def stage_actuals(document: RunDocument, records: list[dict[str, Any]]) -> dict[int, StageActuals]:
    """Per stage that trained: steps, samples, training time, nodes, the last losses and the mean MFU."""
    plan = document.plan
    actuals = {}
    for stage in plan.stages:
        rows = [r for r in records if r["stage"] == stage.index]
        if not rows:
            continue
        validation = validation_points(rows)
        mfu = [float(r["mfu"]) for r in rows if r.get("mfu") is not None]
        actuals[stage.index] = StageActuals(
            index=stage.index,
            num_steps=len(rows),
            num_samples=rows[-1]["consumed_samples"] - stage.start_sample,
            trained_s=sum(float(r.get("step_time_s") or 0.0) for r in rows),
            num_nodes=max(int(r.get("world_size") or stage.world_size) for r in rows)
            // max(1, stage.world_size // stage.num_nodes),
            last_loss=float(rows[-1]["loss"]),
            val_loss=validation[-1][1] if validation else None,
            mfu=statistics.mean(mfu) if mfu else None,
        )
    return actuals


def _summary(
    document: RunDocument, records: list[dict[str, Any]], actuals: dict[int, StageActuals], clock: RunClock
) -> dict[str, float]:
    """The headline numbers for KFP Metrics (what was not measured is left out)."""
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
            trained_hours=sum(a.trained_s for a in actuals.values()) / 3600,
            trained_node_hours=sum(a.trained_s * a.num_nodes for a in actuals.values()) / 3600,
        )
        if clock.wall_s is not None:
            summary["wall_hours"] = clock.wall_s / 3600
        mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
        if mfu:
            summary["mean_mfu"] = sum(mfu) / len(mfu)
        validation = validation_points(records)
        if validation:
            summary["final_val_loss"] = validation[-1][1]
        noise = [r["noise_scale"] for r in records if r.get("noise_scale")]
        if noise:
            summary["noise_scale_last"] = float(noise[-1])
    return summary


def _card(label: str, value: str, detail: str = "", *, wide: bool = False) -> str:
    return (
        f"<div class='{'card wide' if wide else 'card'}'><div class='label'>{html.escape(label)}</div><div class='value'>{html.escape(value)}"
        f"</div><div class='detail'>{html.escape(detail)}</div></div>"
    )


def explore_speedup(explore: dict[str, Any], setting: Setting, micro_batch_size: int) -> float | None:
    """A size's throughput over the base micro batch's as explore rated it (`size_speedups`: the figure of
    the recommendation, the plot's line and the plan's notes), or None when explore did not measure it."""
    state = rebuilt_state(explore) if explore.get("probes") else None
    return size_speedups(state).get((setting, micro_batch_size)) if state is not None else None


def micro_batch_reason(document: RunDocument, explore: dict[str, Any] | None) -> str:
    """Why the run trained at its micro batch, and how that compares with explore's pick, in one figure:
    the throughput over the base micro batch's (`THROUGHPUT_MEANING`)."""
    trained = document.plan.micro_batch_size
    data = explore or document.explore or {}
    rec = data.get("recommendation")
    if document.micro_batch_source == "config":
        reason = "set by batch.micro_batch_size in the config"
    elif document.micro_batch_source == "override":
        reason = "set on the command line or as a pipeline parameter"
    elif rec and rec["micro_batch_size"] == trained:
        return (
            f"explore's pick: the fastest measured size, {format_ratio(rec['estimated_speedup'])} the base micro "
            f"batch's tokens/s (micro_batch_size={rec['base_micro_batch_size']})"
        )
    else:
        reason = (
            "the fastest measured size that splits every stage's global batch over its data-parallel size"
        )
    if not rec or rec["micro_batch_size"] == trained:
        return reason
    fastest = (
        f"explore's fastest was {rec['micro_batch_size']} at {format_ratio(rec['estimated_speedup'])} the base "
        f"micro batch's tokens/s (micro_batch_size={rec['base_micro_batch_size']})"
    )
    train = document.config.train
    ours = explore_speedup(data, Setting(train.activation_checkpointing, train.compile), trained)
    if ours is None:
        return f"{reason}; {fastest}, this size was not measured"
    versus = format_ratio(ours / rec["estimated_speedup"])
    return f"{reason}; {fastest}, this size at {format_ratio(ours)}: {versus} the fastest's throughput"


Card = tuple[str, str, str]
"""A headline card: (label, value, detail)."""


def _training_cards(document: RunDocument, records: list[dict[str, Any]]) -> list[Card]:
    """Losses, steps, samples and tokens, against the plan."""
    plan, seq_len = document.plan, document.config.data.seq_len
    first, last = records[0]["loss"], records[-1]["loss"]
    cards = [("final training loss", format_loss(last), f"from {format_loss(first)} at the first step")]
    validation = validation_points(records)
    if validation:
        at, loss = validation[-1]
        cards.append(("validation loss", format_loss(loss), f"last evaluated at sample {format_int(at)}"))
    samples = records[-1]["consumed_samples"]
    return [
        *cards,
        ("optimizer steps", format_int(len(records)), f"planned {format_int(plan.num_steps)}"),
        ("samples", format_int(samples), f"planned {format_int(plan.trained_samples)}"),
        ("tokens", format_int(samples * seq_len), f"{format_int(seq_len)} per sample"),
    ]


def _cost_cards(document: RunDocument, actuals: dict[int, StageActuals]) -> list[Card]:
    """Training time and node-hours against the plan's estimate and a pool held at max nodes."""
    plan, cost = document.plan, document.cost
    trained_s = sum(a.trained_s for a in actuals.values())
    node_hours = sum(a.trained_s * a.num_nodes for a in actuals.values()) / 3600
    if cost is None:
        return [
            (
                "training time",
                format_duration(trained_s),
                "the sum of step times, without starts and resizes",
            ),
            ("node-hours", format_node_hours(node_hours), "no estimate: no measured throughput"),
        ]
    held = format_node_hours(cost.static_pool_node_hours)
    return [
        (
            "training time",
            format_duration(trained_s),
            f"estimated {format_duration(cost.duration_s)}; the sum of step times, without starts and resizes",
        ),
        (
            "node-hours",
            format_node_hours(node_hours),
            f"estimated {format_node_hours(cost.node_hours)}; a pool held at {plan.max_nodes} nodes: {held}",
        ),
    ]


def wall_card(clock: RunClock) -> list[Card]:
    """The wall time from the run's first task (the canary's or explore's start, else the first step) to its
    last record, and what it covers."""
    wall = clock.wall_s
    if wall is None:
        return []
    return [("wall time", format_duration(wall), wall_detail(clock))]


def _setup_cards(document: RunDocument, actuals: dict[int, StageActuals]) -> list[Card]:
    """Parallelism, MFU and the nodes planned and used (the micro batch has its own, wider card)."""
    plan = document.plan
    memory = document.memory
    per_device = f"; {format_bytes(memory.peak.estimate.total)} per device estimated" if memory else ""
    mfu = [a.mfu for a in actuals.values() if a.mfu is not None]
    planned = max((s.planned_nodes or s.num_nodes) for s in plan.stages)
    used = max((a.num_nodes for a in actuals.values()), default=0)
    short = [
        a
        for a in actuals.values()
        if a.num_nodes < (plan.stages[a.index].planned_nodes or plan.stages[a.index].num_nodes)
    ]
    if short:
        nodes_detail = f"{len(short)} stage(s) on fewer nodes than planned"
    elif not actuals:
        nodes_detail = "nothing trained yet"
    else:  # a run that stopped early used fewer nodes than its later stages plan: not a shortfall
        every = "every stage" if len(actuals) == len(plan.stages) else "every stage that trained"
        nodes_detail = f"{every} on its planned nodes"
    return [
        ("parallelism", plan.parallelism, f"{plan.devices_per_node} device(s) per node{per_device}"),
        (
            "MFU",
            f"{statistics.mean(mfu):.1%}" if mfu else "not measured",
            "model FLOPs utilisation, mean over steps" if mfu else "the trainer reports it on GPUs and TPUs",
        ),
        (
            "nodes",
            f"{used} of {planned} planned" if short and used != planned else str(planned),
            nodes_detail,
        ),
    ]


def _headline(
    document: RunDocument,
    records: list[dict[str, Any]],
    actuals: dict[int, StageActuals],
    explore: dict[str, Any] | None,
    clock: RunClock,
) -> str:
    """The cards a practitioner reads first: what was trained, what it cost, and how."""
    cards = _training_cards(document, records) if records else []
    cards += wall_card(clock) + (_cost_cards(document, actuals) if records else [])
    micro = _card(
        "micro batch trained",
        document.plan.micro_batches_label(),
        micro_batch_reason(document, explore),
        wide=True,
    )
    rest = "".join(_card(*card) for card in _setup_cards(document, actuals))
    return "<div class='cards'>" + "".join(_card(*card) for card in cards) + micro + rest + "</div>"


def _stage_rows(document: RunDocument, actuals: dict[int, StageActuals]) -> Html:
    """Per launch and stage: the plan's nodes and estimate beside what the stage did."""
    plan, cost = document.plan, document.cost
    seq_len = document.config.data.seq_len
    rows = []
    for launch in launches(plan):
        for index in range(launch.first_stage, launch.last_stage + 1):
            stage = plan.stages[index]
            actual = actuals.get(index)
            planned = stage.planned_nodes or stage.num_nodes
            est = format_duration(cost.stages[index].duration_s) if cost else ""
            if actual is None:
                rows.append(
                    [
                        launch.name,
                        stage.name,
                        format_int(stage.global_batch_size),
                        format_int(stage.num_samples),
                        str(planned),
                        "not trained",
                        est,
                        "",
                        "",
                        "",
                        "",
                    ]
                )
                continue
            rate = actual.num_samples * seq_len / actual.trained_s if actual.trained_s else None
            rows.append(
                [
                    launch.name,
                    stage.name,
                    format_int(stage.global_batch_size),
                    format_int(actual.num_samples),
                    str(planned),
                    str(actual.num_nodes),
                    est,
                    format_duration(actual.trained_s),
                    format_int(rate) if rate else "",
                    format_loss(actual.last_loss),
                    format_loss(actual.val_loss) if actual.val_loss is not None else "",
                ]
            )
    header = [
        "launch",
        "stage",
        "global batch",
        "samples",
        "nodes planned",
        "nodes used",
        "est. time",
        "time",
        "tokens/s",
        "last loss",
        "validation loss",
    ]
    return table(header, rows, align="llrrrrrrrrr")


def _explore_plots(explore_html: Path | None) -> str:
    """The plots of explore.html (self-contained <figure> or <img> elements), when that file is at hand."""
    if explore_html is None or not explore_html.is_file():
        return ""
    text = explore_html.read_text()
    return "".join(re.findall(r"<figure>.*?</figure>", text) or re.findall(r"<img [^>]*>", text))


def explore_section(
    explore: dict[str, Any],
    explore_html: Path | None,
    *,
    trained: tuple[int, bool] | None = None,
    trained_reason: str | None = None,
) -> str:
    """The exploration as explore.html presents it, with the trained size (`trained`: micro batch, activation
    checkpointing, and why: `trained_reason`) marked beside the recommended."""
    rec = explore["recommendation"]
    trained_line = (
        f"<p><b>Trained:</b> micro_batch_size={trained[0]}: {html.escape(trained_reason or '')}.</p>"
        if trained is not None
        else ""
    )
    return (
        f"<h2>Exploration</h2><p><b>Recommendation:</b> {html.escape(recommendation_sentence(rec))}</p>"
        f"{trained_line}{bullets(rec['reasoning'] + rec.get('plan_notes', []))}"
        f"<div class='figures'>{_explore_plots(explore_html)}</div>"
        f"<p class='muted'>{html.escape(THROUGHPUT_EXPLAINED)}</p>"
        f"<h3>Probes</h3>{probe_table(explore, trained=trained)}"
        f"{study_section(explore.get('noise_scale'), explore.get('study_error'), heading='h3')}"
    )


def _trials_part(document: RunDocument, study: dict[str, Any]) -> str:
    """The batch trials, beside explore's critical batch with its caveat when the study measured one."""
    critical = study.get("critical_batch_size")
    caveat = study_caveat(study) if critical else None
    return trials_section(document, study_critical_batch=critical, study_caveat=caveat)


def write_report(
    *,
    document: RunDocument,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    html_path: Path,
    markdown_path: Path | None = None,
    explore_html: Path | None = None,
    canary: dict[str, Any] | None = None,
    failure: str | None = None,
    ledger: Ledger | None = None,
) -> dict[str, float]:
    """Writes the HTML report (and the Markdown table); returns the headline numbers for KFP Metrics.

    Args:
        explore: this run's explore.json (its times count in the wall time), when its explore ran.
        canary: the run's canary.json, when its canary ran.
        failure: why the run failed (its report says where it stopped, and what ran); None: it completed.
        ledger: the goodput ledger as of now (`planning.goodput`), when the run recorded its events.
    """
    plan, cost = document.plan, document.cost
    actuals = stage_actuals(document, records)
    clock = run_clock(records=records, canary=canary, explore=explore)
    summary = _summary(document, records, actuals, clock)
    name = document.config.name
    parts = [run_header(name, clock, failure=failure)]
    if failure is not None:  # why, where it stopped and what ran: first, before what it reached
        where = stopped_section(
            document=document, records=records, explore=explore, canary=canary, failure=failure
        )
        parts.append(where)
    headline = _headline(document, records, actuals, explore, clock)
    if ledger is not None and ledger.goodput is not None:
        card = _card(
            "goodput",
            f"{ledger.goodput:.2f}",
            "training-step node-hours over all node-hours (Where the node-hours went, below)",
        )
        headline = headline.replace("<div class='cards'>", "<div class='cards'>" + card, 1)
    parts.append(headline)
    study = (explore or document.explore or {}).get("noise_scale") or {}
    if document.trials_outcome is not None:
        parts.append(_trials_part(document, study))
        summary.update(trials_summary(document))
    if ledger is not None:
        cluster = document.config.cluster
        modelled = cluster.local_resize_delay_s if cluster.backend == "local" else 0.0
        parts.append(goodput_section(ledger, modelled_resize_delay_s=modelled))
        summary.update(goodput_summary(ledger))
    parts.append("<h2>Launches and stages: plan and actuals</h2>" + _stage_rows(document, actuals))
    parts.append(
        "<p class='muted'>Time is the sum of a stage's step times (training alone); tokens/s is the stage's tokens "
        "over that time, all devices together.</p>"
    )
    figures = run_figures(plan, records, critical_batch_size=study.get("critical_batch_size"))
    parts.append(
        "<h2>Over the run</h2><div class='figures'>" + "".join(figure(t, p) for t, p in figures) + "</div>"
    )
    if document.capacity:
        section, capacity_figures = capacity_section(document, records)
        parts.append(section)
        summary.update(capacity_figures)
    if document.decisions:
        parts.append(decisions_section(document))
        summary["adaptive_decisions"] = len(document.decisions)
    parts.append("<h2>Plan</h2>" + plan_html(plan, cost, document.memory))
    if document.notes:  # how the plan was made: explore's setting taken, the study's advice beside it
        parts.append("<h3>How the plan was made</h3>" + bullets(document.notes))
    if explore is not None:
        trained = (document.plan.micro_batch_size, document.config.train.activation_checkpointing)
        reason = micro_batch_reason(document, explore)
        parts.append(explore_section(explore, explore_html, trained=trained, trained_reason=reason))
    if canary is not None:
        parts.append(canary_section(canary))
    write_atomically(html_path, page(f"batchpilot run: {name}", "\n".join(parts)))
    if markdown_path is not None:
        write_atomically(markdown_path, plan_markdown(plan, cost, document.memory))
    return summary


def write_unplanned_report(
    *,
    name: str,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    html_path: Path,
    failure: str,
    explore_html: Path | None = None,
    canary: dict[str, Any] | None = None,
) -> None:
    """The report of a run that failed before its plan.json was written (or with one that cannot be read):
    its status, why, where it stopped and what ran, the wall time, the steps it recorded, the exploration
    and the canary, as far as each left a record."""
    clock = run_clock(records=records, canary=canary, explore=explore)
    parts = [
        run_header(name, clock, failure=failure),
        stopped_section(document=None, records=records, explore=explore, canary=canary, failure=failure),
        "<div class='cards'>" + "".join(_card(*card) for card in wall_card(clock)) + "</div>",
    ]
    if records:
        parts.append("<h2>Steps recorded</h2>" + records_table(records))
    if explore is not None:
        parts.append(explore_section(explore, explore_html))
    if canary is not None:
        parts.append(canary_section(canary))
    write_atomically(html_path, page(f"batchpilot run: {name}", "\n".join(parts)))
