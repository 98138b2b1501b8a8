"""The outputs of an exploration: explore.json (the contract), explore_metrics.json (flat numbers for
KFP) and explore.html (self-contained: plots as base64 PNGs). Each is written atomically."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config, explore_fingerprint
from batchpilot.explore.records import ProbeResult, Setting
from batchpilot.explore.search import Point, SearchState
from batchpilot.files import write_atomically
from batchpilot.htmlpage import Html, bullets, figure, page, table
from batchpilot.planning.units import (
    format_bytes,
    format_duration,
    format_int,
    format_number,
    format_ratio,
)

if TYPE_CHECKING:
    from batchpilot.explore.result import ExploreResult

EXPLORE_FORMAT_VERSION = 1


def frontier(state: SearchState) -> list[dict[str, Any]]:
    """Per setting: the largest size that fits and the smallest that does not (None: not reached)."""
    rows = []
    for setting in state.settings:
        points = state.points(setting)
        rows.append(
            {
                "activation_checkpointing": setting.activation_checkpointing,
                "compile": setting.compile,
                "largest_fitting_micro_batch_size": points[-1].micro_batch_size if points else None,
                "smallest_not_fitting_micro_batch_size": state.smallest_not_fitting(setting),
            }
        )
    return rows


def explore_document(
    *, result: ExploreResult, state: SearchState, config: Config, study_error: str | None
) -> dict[str, Any]:
    """The explore.json contract (docs/architecture.md): probes, recommendation, noise_scale; `started_at` and
    `finished_at` (unix seconds) place the exploration in the run's wall clock (the run report's wall time)."""
    finished_at = time.time()
    return {
        "format_version": EXPLORE_FORMAT_VERSION,
        "name": config.name,
        "device": result.probes[0].device if result.probes else None,
        "probe_parallelism": result.layout.parallelism,
        "processes_per_probe": result.layout.processes,
        "seq_len": config.data.seq_len,
        "fingerprint": explore_fingerprint(config),
        "memory_budget_bytes": config.explore.memory_budget_bytes,
        "stopped_because": result.stopped_because,
        "elapsed_s": round(result.elapsed_s, 3),
        "started_at": round(finished_at - result.elapsed_s, 3),
        "finished_at": round(finished_at, 3),
        "probes": [probe.public() for probe in result.probes],
        "frontier": frontier(state),
        "recommendation": asdict(result.recommendation),
        "noise_scale": result.noise_scale.to_dict() if result.noise_scale else None,
        "study_error": study_error,
    }


def metrics_document(result: ExploreResult) -> dict[str, float]:
    """Flat numbers for a KFP Metrics artifact (values that were not measured are left out)."""
    rec = result.recommendation
    metrics: dict[str, float | None] = {
        "recommended_micro_batch_size": rec.micro_batch_size,
        "activation_checkpointing": int(rec.activation_checkpointing),
        "estimated_speedup": round(rec.estimated_speedup, 4),
        "confidence": rec.confidence,
        "tokens_per_s": round(rec.tokens_per_s, 1),
        "samples_per_s": round(rec.samples_per_s, 3),
        "num_probes": len(result.probes),
        "num_fitting_probes": sum(p.fits for p in result.probes),
        "elapsed_s": round(result.elapsed_s, 1),
    }
    if result.noise_scale is not None:
        metrics["critical_batch_size"] = result.noise_scale.critical_batch_size
        metrics["recommended_global_batch_size"] = result.noise_scale.recommended_global_batch_size
    return {key: float(value) for key, value in metrics.items() if value is not None}


THROUGHPUT_MEANING = "x the base micro batch's tokens/s, timed pass by pass"
"""What explore's one throughput figure per probe is: the probe's tokens/s over the base micro batch's, each pass
timed next to a pass of the base in the same process (a shared machine's changing speed cancels out of the ratio),
the median over its passes: the figure the console line prints as `2.05x the base pass by pass`."""


def rebuilt_state(document: dict[str, Any]) -> SearchState | None:
    """The search's state from explore.json's probes: the figures the recommendation was rated on (None: no
    probe fits)."""
    probes = [ProbeResult.from_dict(probe) for probe in document["probes"]]
    if not any(probe.fits for probe in probes):
        return None
    settings = list(dict.fromkeys(probe.setting for probe in probes))
    largest = max(probe.micro_batch_size for probe in probes)
    state = SearchState(settings=settings, max_micro_batch_size=largest, seq_len=document["seq_len"])
    for probe in probes:
        state.add(probe)
    return state


def _base_point(state: SearchState) -> Point | None:
    """The base micro batch's point: what every figure is a multiple of (as `recommend` divides by it)."""
    base = state.base()
    if base is None:
        return None
    return next((p for p in state.points(base.setting) if p.micro_batch_size == base.micro_batch_size), None)


def size_speedups(state: SearchState) -> dict[tuple[Setting, int], float]:
    """Per measured (setting, micro batch): its throughput over the base micro batch's as the recommendation
    rates it (`estimated_speedup`): the median over every paired pass of every probe of that size."""
    base = _base_point(state)
    if base is None:
        return {}
    return {(p.setting, p.micro_batch_size): p.tokens_per_s / base.tokens_per_s for p in state.all_points()}


def probe_speedups(state: SearchState) -> list[tuple[float, bool] | None]:
    """Per probe (in order): (its throughput over the base micro batch's, whether timed pass by pass next to
    the base). The base probe is 1; a probe without a reference (a compiled setting, a repeat of the base
    size) is its own tokens/s over the base's; None for a probe that does not fit."""
    base, base_point = state.base(), _base_point(state)
    figures: list[tuple[float, bool] | None] = []
    for probe in state.results:
        if probe is base:
            figures.append((1.0, True))
        elif probe.fits and probe.relative_throughput:
            figures.append((probe.relative_throughput, True))
        elif probe.fits and probe.tokens_per_s and base_point is not None:
            figures.append((probe.tokens_per_s / base_point.tokens_per_s, False))
        else:
            figures.append(None)
    return figures


def format_speedup(figure: tuple[float, bool] | None) -> str:
    """`2.05x`, `1.20x, timed alone` (no pass of the base beside it), or "" (does not fit)."""
    if figure is None:
        return ""
    return format_ratio(figure[0]) + ("" if figure[1] else ", timed alone")


def _png(figure: Any) -> str:
    from matplotlib import pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def _size_axis(axes: Any) -> None:
    import matplotlib.ticker

    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: format_int(x)))
    axes.set_xlabel("micro batch size")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)


def throughput_figure(state: SearchState) -> Any:
    """Per setting: each probe's figure (markers: the probe table's and the console's) and, through each
    size, the figure the recommendation rates it by (the line: the median over the size's paired passes)."""
    import matplotlib.ticker

    figure, axes = _pyplot().subplots(figsize=(7, 4))
    sizes, probes = size_speedups(state), probe_speedups(state)
    for setting in state.settings:
        per_size = [(m, x) for (s, m), x in sorted(sizes.items(), key=lambda i: i[0][1]) if s == setting]
        line = axes.plot(
            [m for m, _ in per_size], [x for _, x in per_size], marker="_", markersize=16,
            label=f"{setting.label()}: per size",
        )[0]  # fmt: skip
        mine = [
            (r.micro_batch_size, f[0])
            for r, f in zip(state.results, probes, strict=True)
            if f and r.setting == setting
        ]
        if mine:
            axes.plot(*zip(*mine, strict=True), linestyle="none", marker="o", color=line.get_color(),
                      label=f"{setting.label()}: each probe")  # fmt: skip
        _frontier_line(axes, state, setting, color=line.get_color())
    axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    axes.set_ylabel("x the base micro batch's tokens/s\n(timed pass by pass)")
    _size_axis(axes)
    return figure


def memory_figure(state: SearchState, *, budget_bytes: int, device: str | None) -> Any:
    """Peak memory per size and setting, the sizes that did not fit (x) and, on a CPU, the budget."""
    import matplotlib.ticker

    figure, axes = _pyplot().subplots(figsize=(7, 4))
    for setting in state.settings:
        points = state.points(setting)
        line = axes.plot(
            [p.micro_batch_size for p in points],
            [p.peak_memory_bytes / 2**20 for p in points],
            marker="o",
            label=setting.label(),
        )[0]
        failed = [r for r in state.results if r.setting == setting and not r.fits]
        if failed:
            axes.scatter(
                [r.micro_batch_size for r in failed],
                [(r.peak_memory_bytes or 0) / 2**20 for r in failed],
                marker="x",
                color=line.get_color(),
                label=f"does not fit ({setting.label()})",
            )
        _frontier_line(axes, state, setting, color=line.get_color())
    if device == "cpu":
        axes.axhline(budget_bytes / 2**20, color="red", linestyle=":", label="memory budget")
    axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: format_int(y)))
    axes.set_ylabel("peak memory (MiB)")
    _size_axis(axes)
    return figure


def _frontier_line(axes: Any, state: SearchState, setting: Setting, *, color: Any) -> None:
    points, limit = state.points(setting), state.smallest_not_fitting(setting)
    if points and limit is not None:
        largest = points[-1].micro_batch_size
        axes.axvline(largest, color=color, linestyle="--", alpha=0.6,
                     label=f"memory frontier ({setting.label()}): {largest}")  # fmt: skip


def plots(state: SearchState, *, budget_bytes: int, device: str | None) -> list[tuple[str, str]]:
    """(title, base64 PNG) of throughput and peak memory versus micro batch, one line per setting."""
    return [
        ("Throughput versus micro batch size", _png(throughput_figure(state))),
        (
            "Peak memory versus micro batch size",
            _png(memory_figure(state, budget_bytes=budget_bytes, device=device)),
        ),
    ]


MIN_TRUSTED_STUDY_STEPS = 100
"""Fewer training steps before the study than this and its advice is flagged: the noise scale grows as the loss
falls, and a barely trained model's is a lower estimate (explore.study_train_steps)."""


def recommendation_sentence(rec: dict[str, Any]) -> str:
    """`micro_batch_size=48 (activation checkpointing off): 1.88x the base micro batch's tokens/s
    (micro_batch_size=1, timed pass by pass: the median over every probe of this size), confidence 57/100,
    67,239 tokens/s`."""
    return (
        f"micro_batch_size={rec['micro_batch_size']} (activation checkpointing "
        f"{'on' if rec['activation_checkpointing'] else 'off'}): {format_ratio(rec['estimated_speedup'])} the base "
        f"micro batch's tokens/s (micro_batch_size={rec['base_micro_batch_size']}, timed pass by pass: the median "
        f"over every probe of this size), confidence {rec['confidence']}/100, {format_int(rec['tokens_per_s'])} "
        "tokens/s"
    )


def _base_index(probes: list[dict[str, Any]], base_micro_batch_size: int | None) -> int | None:
    """The base probe: the first fitting probe of the base size measured without a reference."""
    for index, probe in enumerate(probes):
        if (
            probe["fits"]
            and probe["micro_batch_size"] == base_micro_batch_size
            and not probe.get("relative_throughput")
        ):
            return index
    return None


def _marks(
    probes: list[dict[str, Any]],
    index: int,
    *,
    recommended: tuple[int, bool],
    trained: tuple[int, bool] | None,
    base: int | None,
) -> Html:
    probe = probes[index]
    key = (probe["micro_batch_size"], bool(probe["activation_checkpointing"]))
    marks = []
    if index == base:
        marks.append("<span class='mark'>base</span>")
    if probe["fits"] and key == recommended:
        marks.append("<span class='mark rec'>recommended</span>")
    if probe["fits"] and key == trained:
        marks.append("<span class='mark trained'>trained</span>")
    earlier = [
        p for p in probes[:index] if (p["micro_batch_size"], bool(p["activation_checkpointing"])) == key
    ]
    if earlier:
        marks.append(f"<span class='mark repeat'>repeat of #{probes.index(earlier[0]) + 1}</span>")
    if probe.get("error"):
        marks.append(html.escape(str(probe["error"])))
    return Html("".join(marks))


def probe_table(document: dict[str, Any], *, trained: tuple[int, bool] | None = None) -> Html:
    """Every probe in order: memory, pass time and its one throughput figure (`THROUGHPUT_MEANING`), with the
    base, the recommended size, the trained one (`trained`: micro batch, activation checkpointing) and
    repeated measurements marked; below it, what a size measured more than once is rated at."""
    probes = document["probes"]
    rec = document["recommendation"]
    base = _base_index(probes, rec.get("base_micro_batch_size"))
    state = rebuilt_state(document)
    figures = probe_speedups(state) if state is not None else [None] * len(probes)
    recommended = (rec["micro_batch_size"], bool(rec["activation_checkpointing"]))
    rows = []
    for index, probe in enumerate(probes):
        rows.append(
            [
                str(index + 1),
                format_int(probe["micro_batch_size"]),
                "on" if probe["activation_checkpointing"] else "off",
                "yes" if probe["fits"] else "no",
                format_bytes(probe["peak_memory_bytes"]) if probe["peak_memory_bytes"] else "",
                f"{format_number(probe['step_time_s'] * 1000)} ms" if probe["step_time_s"] else "",
                format_speedup(figures[index]),
                format_int(probe["repeats"]),
                _marks(probes, index, recommended=recommended, trained=trained, base=base),
            ]
        )
    header = [
        "#",
        "micro batch",
        "act. ckpt",
        "fits",
        "peak memory",
        "time/pass",
        THROUGHPUT_MEANING,
        "timed passes",
        "",
    ]
    return Html(
        table(header, rows, align="rrllrrrrl") + (_repeated_sizes(state) if state is not None else "")
    )


def _repeated_sizes(state: SearchState) -> str:
    """The figure of each size probed more than once: the median over all its probes' passes (the plot's line
    and the recommendation's figure), not any one probe's."""
    sizes = size_speedups(state)
    lines = []
    for (setting, micro), speedup in sizes.items():
        numbers = [
            f"#{i + 1}"
            for i, r in enumerate(state.results)
            if r.fits and (r.setting, r.micro_batch_size) == (setting, micro)
        ]
        if len(numbers) > 1:
            lines.append(
                f"micro_batch_size={micro} ({setting.label()}): {format_ratio(speedup)} over {', '.join(numbers)}"
            )
    if not lines:
        return ""
    return (
        "<p class='muted'>A size probed more than once is rated by the median over all its probes' passes (the "
        f"plot's line, and the recommendation's figure): {html.escape('; '.join(lines))}.</p>"
    )


def study_warnings(noise: dict[str, Any]) -> list[str]:
    """Why the study's advice should not be followed as it is (empty when nothing stands out)."""
    warnings = []
    steps = noise.get("train_steps")
    if steps is not None and steps < MIN_TRUSTED_STUDY_STEPS:
        warnings.append(
            f"measured after only {steps} training step(s) (fewer than {MIN_TRUSTED_STUDY_STEPS}): the noise scale "
            "grows as the loss falls, so this is a lower estimate; raise explore.study_train_steps"
        )
    critical = noise.get("critical_batch_size")
    if critical is not None and critical < 1:
        warnings.append(
            f"a critical batch of {format_number(critical)} samples, below one sample, is not a batch size to "
            "train at: the gradients barely differ from batch to batch this early, or the measurement is noise"
        )
    return warnings


def study_caveat(noise: dict[str, Any]) -> str:
    """What to make of the study's critical batch, to stand beside it wherever it is shown: always a lower
    estimate (the noise scale grows as the loss falls), and more so after few training steps."""
    steps = noise.get("train_steps")
    few = steps is not None and steps < MIN_TRUSTED_STUDY_STEPS
    after = f", measured after only {steps} training step(s)" if few else ""
    return f"a lower estimate{after}: the noise scale grows as the loss falls"


def study_result(noise: dict[str, Any]) -> tuple[str, list[str]]:
    """The study's outcome as one sentence with its caveat beside the number, and the reasoning lines left to
    list below (the one the sentence already says is left out)."""
    critical = noise.get("critical_batch_size")
    reasoning = list(noise["reasoning"])
    if critical is None:  # the study's first line says why (`explore.study.advise`)
        if not reasoning:
            return "No critical batch could be measured.", []
        return f"{reasoning[0][:1].upper()}{reasoning[0][1:]}.", reasoning[1:]
    target = noise.get("recommended_global_batch_size")
    advice = (
        f"; advised target global batch {format_int(target)}, LR scaling {noise['lr_scaling']}"
        if target
        else ""
    )
    return f"Critical batch ~{format_number(critical)} samples ({study_caveat(noise)}){advice}.", reasoning


def study_section(noise: dict[str, Any] | None, study_error: str | None, *, heading: str = "h2") -> Html:
    """The effective-batch study: its critical batch with its caveat in the same paragraph (flagged there when
    the advice is not trustworthy), then per multiplier what was measured."""
    if noise is None:
        return Html(
            f"<{heading}>Effective-batch study</{heading}><p>{html.escape(study_error or 'not run (--no-study)')}</p>"
        )
    rows = [
        [
            f"{r['multiplier']}x",
            format_int(r["global_batch_size"]),
            format_number(r["noise_scale"]) if r["noise_scale"] else "not measurable",
            format_number(r["grad_norm"]),
            format_number(r["coherence"]),
        ]
        for r in noise["per_multiplier"]
    ]
    sentence, reasoning = study_result(noise)
    warnings = study_warnings(noise)
    result = f"<p><b>{html.escape(sentence)}</b></p>"
    if warnings:
        result = f"<div class='warn'>{result}<b>Not trustworthy as it stands:</b>{bullets(warnings)}</div>"
    header = ["accumulation", "global batch", "noise scale (samples)", "gradient norm", "coherence"]
    # An explore.json written before the study recorded its weights measured a randomly initialised model.
    weights = f"Measured on the model's weights from: {noise.get('weights', 'random init')}."
    return Html(
        f"<{heading}>Effective-batch study</{heading}>{result}<p>{html.escape(weights)}</p>"
        f"{table(header, rows, align='rrrrr')}{bullets(reasoning)}"
    )


def explore_html(document: dict[str, Any], figures: list[tuple[str, str]]) -> str:
    """A self-contained page: recommendation, plots, every probe, the study."""
    rec = document["recommendation"]
    name = html.escape(document["name"])
    images = "".join(figure(title, png) for title, png in figures)
    return page(
        f"batchpilot explore: {document['name']}",
        f"<h1>batchpilot explore: {name}</h1>"
        f"<p><b>Recommendation:</b> {html.escape(recommendation_sentence(rec))}</p>"
        f"{bullets(rec['reasoning'] + rec['plan_notes'])}"
        f"<p class='muted'>{len(document['probes'])} probes on {html.escape(str(document['device']))}, each "
        f"{document['processes_per_probe']} process(es) under {html.escape(document['probe_parallelism'])}, stopped: "
        f"{html.escape(document['stopped_because'])}, {format_duration(document['elapsed_s'])}</p>"
        f"<h2>Throughput and memory</h2><div class='figures'>{images}</div>"
        f"<p>{html.escape(THROUGHPUT_EXPLAINED)}</p>"
        f"<h2>Probes</h2>{probe_table(document)}"
        f"{study_section(document['noise_scale'], document['study_error'])}",
    )


THROUGHPUT_EXPLAINED = (
    "Throughput is one figure per probe, the one its console line printed: its tokens/s over the base micro "
    "batch's, each pass timed next to a pass of the base in the same process (a shared machine's changing speed "
    "cancels out of the ratio), the median over its passes. A probe without a pass of the base beside it (a "
    "compiled setting, a repeat of the base size) is its own tokens/s over the base's (timed alone). The plot "
    "shows each probe as a marker and, as a line, each size's figure over all its probes: the one the "
    "recommendation rates it by."
)
"""How to read explore's throughput figures (explore.html and the run report's exploration)."""


def write_outputs(
    *, result: ExploreResult, state: SearchState, config: Config, study_error: str | None
) -> None:
    """explore.json, explore_metrics.json and explore.html in `result.output_dir`."""
    document = explore_document(result=result, state=state, config=config, study_error=study_error)
    folder = result.output_dir
    figures = plots(state, budget_bytes=config.explore.memory_budget_bytes, device=document["device"])
    write_atomically(folder / "explore.json", json.dumps(document, indent=2) + "\n")
    write_atomically(folder / "explore_metrics.json", json.dumps(metrics_document(result), indent=2) + "\n")
    write_atomically(folder / "explore.html", explore_html(document, figures))
