"""The run report's plots, all over consumed samples (the run's one position counter): the training and
validation loss, the batch-size ramp with the measured gradient noise scale and the nodes, tokens/s and
the learning rate. Axes are scaled to the data, labelled with units, with whole-number ticks where the
values are whole numbers."""

from __future__ import annotations

import base64
import io
from typing import Any

from batchpilot.planning import Plan
from batchpilot.planning.trials import BranchResult
from batchpilot.planning.units import format_int, format_number

FIGSIZE = (6.6, 3.4)


def pyplot() -> Any:
    """matplotlib's pyplot drawing off-screen (reports are files, often made where there is no display)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def png(figure: Any) -> str:
    """`figure` as a base64 PNG, closed afterwards."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _whole_ticks(axis: Any) -> None:
    """Whole-number ticks with thousands separators on `axis` (an x or y axis)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))
    axis.set_major_formatter(FuncFormatter(lambda value, _: format_int(value)))


def _samples_axis(axes: Any) -> None:
    axes.set_xlabel("consumed samples")
    _whole_ticks(axes.xaxis)
    axes.grid(True, alpha=0.3)


def validation_points(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(consumed samples, validation loss) of the steps that ended with an evaluation (`val_loss` not null;
    records of runs before validation have no such key)."""
    return [(r["consumed_samples"], float(r["val_loss"])) for r in records if r.get("val_loss") is not None]


def loss_figure(plan: Plan, records: list[dict[str, Any]]) -> Any:
    """The training loss of each stage as lines and the validation loss as markers, over consumed samples."""
    fig, axes = pyplot().subplots(figsize=FIGSIZE)
    for stage in plan.stages:
        points = [(r["consumed_samples"], r["loss"]) for r in records if r["stage"] == stage.index]
        if points:
            axes.plot(*zip(*points, strict=True), label=f"{stage.name} (batch {stage.global_batch_size})")
    validation = validation_points(records)
    if validation:
        axes.plot(
            *zip(*validation, strict=True), linestyle="none", marker="o", markersize=4, color="black",
            label="validation",
        )  # fmt: skip
    _samples_axis(axes)
    axes.set_ylabel("loss")
    axes.legend(fontsize=7)
    return fig


def ramp_figure(plan: Plan, records: list[dict[str, Any]], *, critical_batch_size: float | None) -> Any:
    """The planned global batch per stage (a step line) against the gradient noise scale the trainer measured
    (markers, in samples like the batch), the exploration's critical batch, and the nodes per stage."""
    fig, axes = pyplot().subplots(figsize=FIGSIZE)
    xs = [x for s in plan.stages for x in (s.start_sample, s.end_sample)]
    batches = [s.global_batch_size for s in plan.stages for _ in (0, 1)]
    axes.step(xs, batches, where="post", label="global batch (plan)")
    noise = [(r["consumed_samples"], r["noise_scale"]) for r in records if r.get("noise_scale")]
    values = batches + [n for _, n in noise]
    if noise:
        axes.plot(*zip(*noise, strict=True), linestyle="none", marker=".", color="tab:green",
                  label="measured noise scale")  # fmt: skip
    if critical_batch_size:
        axes.axhline(
            critical_batch_size,
            color="tab:green",
            linestyle=":",
            label="explore's critical batch (a lower estimate)",
        )
        values.append(critical_batch_size)
    if max(values) / max(min(values), 1e-9) > 30:  # a noise scale far from the batch: both stay readable
        from matplotlib.ticker import FuncFormatter

        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_number(value)))
    else:
        axes.set_ylim(0, max(values) * 1.1)
        _whole_ticks(axes.yaxis)
    axes.set_ylabel("samples per optimizer step")
    nodes = axes.twinx()
    nodes.step(xs, [s.num_nodes for s in plan.stages for _ in (0, 1)], where="post", color="tab:orange",
               linestyle="--", label="nodes")  # fmt: skip
    nodes.set_ylabel("nodes", color="tab:orange")
    nodes.set_ylim(0, max(s.num_nodes for s in plan.stages) + 1)
    _whole_ticks(nodes.yaxis)
    _samples_axis(axes)
    axes.legend(handles=axes.get_lines() + nodes.get_lines(), loc="lower right", fontsize=7)
    return fig


def series_figure(records: list[dict[str, Any]], *, key: str, label: str, scientific: bool = False) -> Any:
    """One number per optimizer step (`key` of the records) over consumed samples."""
    from matplotlib.ticker import FuncFormatter

    fig, axes = pyplot().subplots(figsize=FIGSIZE)
    points = [(r["consumed_samples"], r[key]) for r in records if r.get(key) is not None]
    axes.plot(*zip(*points, strict=True), linewidth=1)
    axes.set_ylabel(label)
    if scientific:  # a learning rate: 3e-4, not 0.00030
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.1e}".replace("e-0", "e-")))
    else:
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_number(value)))
    _samples_axis(axes)
    return fig


def run_figures(
    plan: Plan, records: list[dict[str, Any]], *, critical_batch_size: float | None
) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every plot the records allow (the ramp alone before any step)."""
    figures = []
    if records:
        figures.append(("Training and validation loss", png(loss_figure(plan, records))))
    ramp = ramp_figure(plan, records, critical_batch_size=critical_batch_size)
    figures.append(("Batch-size ramp, measured noise scale and nodes", png(ramp)))
    if records:
        tokens = series_figure(records, key="tokens_per_s", label="tokens/s (all devices)")
        figures.append(("Throughput", png(tokens)))
        figures.append(
            ("Learning rate", png(series_figure(records, key="lr", label="learning rate", scientific=True)))
        )
    return figures


def trials_figure(results: tuple[BranchResult, ...], *, seq_len: int) -> Any:
    """Each branch's validation loss over the tokens it trained after the warm-up: one colour per batch, one
    line style per LR multiplier (failed branches have no curve and are left out)."""
    fig, axes = pyplot().subplots(figsize=FIGSIZE)
    batches = sorted({r.global_batch_size for r in results})
    multipliers = sorted({r.lr_multiplier for r in results})
    styles = ["-", "--", ":", "-."]
    for result in results:
        if result.status != "ok" or not result.curve:
            continue
        tokens = [samples * seq_len for samples, _ in result.curve]
        losses = [loss for _, loss in result.curve]
        axes.plot(
            tokens, losses, marker="o", markersize=3, color=f"C{batches.index(result.global_batch_size)}",
            linestyle=styles[multipliers.index(result.lr_multiplier) % len(styles)],
            label=f"batch {format_int(result.global_batch_size)}, LR x {result.lr_multiplier:g}",
        )  # fmt: skip
    axes.set_xlabel("tokens trained after the warm-up")
    _whole_ticks(axes.xaxis)
    axes.grid(True, alpha=0.3)
    axes.set_ylabel("validation loss")
    axes.legend(fontsize=7)
    return fig
