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

from batchpilot.planning import Plan


def plan_markdown(plan: Plan) -> str:
    """The stage table as Markdown (the KFP UI renders it)."""
    lines = [
        "| stage | global batch | samples | steps | nodes | data parallel | accumulation | lr |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in plan.stages:
        lines.append(
            f"| {s.name} | {s.global_batch_size} | {s.start_sample:,} - {s.end_sample:,} | {s.num_steps:,} | "
            f"{s.num_nodes} | {s.data_parallel_size} | {s.gradient_accumulation_steps} | {s.lr:.3g} |"
        )
    return "\n".join(lines) + f"\n\nmicro_batch_size = {plan.micro_batch_size}; {plan.num_steps:,} steps.\n"


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def ramp_and_loss_figures(plan: Plan, records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of the batch-size ramp with node counts, and of the loss curve."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

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
        fig, axis = plt.subplots(figsize=(7, 3.2))
        for stage in plan.stages:
            points = [(r["consumed_samples"], r["loss"]) for r in records if r["stage"] == stage.index]
            if points:
                axis.plot(*zip(*points, strict=True), label=f"{stage.name} (batch {stage.global_batch_size})")
        axis.set_xlabel("consumed samples")
        axis.set_ylabel("training loss")
        axis.legend(fontsize=7)
        figures.append(("Loss", _png(fig)))
        plt.close(fig)
    return figures


def write_report(
    *,
    plan: Plan,
    run_name: str,
    records: list[dict[str, Any]],
    explore: dict[str, Any] | None,
    html_path: Path,
    markdown_path: Path | None = None,
    explore_html: Path | None = None,
) -> dict[str, float]:
    """Writes the HTML report (and the Markdown table); returns the headline numbers for KFP Metrics."""
    summary: dict[str, float] = {"num_stages": len(plan.stages), "micro_batch_size": plan.micro_batch_size}
    if records:
        summary.update(
            final_loss=float(records[-1]["loss"]),
            first_loss=float(records[0]["loss"]),
            trained_samples=float(records[-1]["consumed_samples"]),
            mean_tokens_per_s=sum(r["tokens_per_s"] for r in records) / len(records),
        )
        noise = [r["noise_scale"] for r in records if r.get("noise_scale")]
        if noise:
            summary["noise_scale_last"] = float(noise[-1])
    parts = [f"<h1>batchpilot run: {html.escape(run_name)}</h1>"]
    if explore is not None:
        parts.append(_explore_section(explore, explore_html))
    parts.append("<h2>Plan</h2>" + _plan_table_html(plan))
    for title, png in ramp_and_loss_figures(plan, records):
        parts.append(
            f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
        )
    parts.append(
        "<h2>Summary</h2><ul>" + "".join(f"<li>{k}: {v:,.4g}</li>" for k, v in summary.items()) + "</ul>"
    )
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>batchpilot</title></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
    if markdown_path is not None:
        markdown_path.write_text(plan_markdown(plan))
    return summary


def _plan_table_html(plan: Plan) -> str:
    head = "".join(
        f"<th>{h}</th>" for h in ("stage", "batch", "samples", "steps", "nodes", "dp", "accum", "lr")
    )
    rows = "".join(
        f"<tr><td>{s.name}</td><td>{s.global_batch_size}</td><td>{s.start_sample:,} - {s.end_sample:,}</td>"
        f"<td>{s.num_steps:,}</td><td>{s.num_nodes}</td><td>{s.data_parallel_size}</td>"
        f"<td>{s.gradient_accumulation_steps}</td><td>{s.lr:.3g}</td></tr>"
        for s in plan.stages
    )
    return f"<table border='1' cellpadding='4'><tr>{head}</tr>{rows}</table>"


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
