"""The outputs of an exploration: explore.json (the contract), explore_metrics.json (flat numbers for
KFP) and explore.html (self-contained: plots as base64 PNGs). Each is written atomically."""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config, explore_fingerprint
from batchpilot.explore.records import Setting
from batchpilot.explore.search import SearchState
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
    """The explore.json contract (docs/architecture.md): probes, recommendation, noise_scale."""
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


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def plots(state: SearchState, *, budget_bytes: int, device: str | None) -> list[tuple[str, str]]:
    """(title, base64 PNG) of tokens/s and peak memory versus micro batch, one line per setting."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figures = []
    for title, key in (("tokens/s", "tokens_per_s"), ("peak memory (MiB)", "peak_memory_bytes")):
        figure, axes = plt.subplots(figsize=(7, 4))
        for setting in state.settings:
            _plot_setting(axes, state, setting, key=key)
        if key == "peak_memory_bytes" and device == "cpu":
            axes.axhline(budget_bytes / 2**20, color="red", linestyle=":", label="memory budget")
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: format_int(x)))
        axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: format_int(y)))
        axes.set_xlabel("micro batch size")
        axes.set_ylabel(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figures.append((f"{title} versus micro batch size", _png(figure)))
        plt.close(figure)
    return figures


def _plot_setting(axes: Any, state: SearchState, setting: Setting, *, key: str) -> None:
    points = state.points(setting)
    scale = 2**20 if key == "peak_memory_bytes" else 1
    line = axes.plot(
        [p.micro_batch_size for p in points],
        [getattr(p, key) / scale for p in points],
        marker="o",
        label=setting.label(),
    )[0]
    failed = [r for r in state.results if r.setting == setting and not r.fits]
    if key == "peak_memory_bytes" and failed:
        axes.scatter(
            [r.micro_batch_size for r in failed],
            [(r.peak_memory_bytes or 0) / scale for r in failed],
            marker="x",
            color=line.get_color(),
            label=f"does not fit ({setting.label()})",
        )
    limit = state.smallest_not_fitting(setting)
    if points and limit is not None:
        axes.axvline(
            points[-1].micro_batch_size,
            color=line.get_color(),
            linestyle="--",
            alpha=0.6,
            label=f"memory frontier ({setting.label()}): {points[-1].micro_batch_size}",
        )


MIN_TRUSTED_STUDY_STEPS = 100
"""Fewer training steps before the study than this and its advice is flagged: the noise scale grows as the loss
falls, and a barely trained model's is a lower estimate (explore.study_train_steps)."""


def recommendation_sentence(rec: dict[str, Any]) -> str:
    """`micro_batch_size=48 (activation checkpointing off): 1.88x the base (micro_batch_size=1), confidence
    57/100, 67,239 tokens/s`."""
    return (
        f"micro_batch_size={rec['micro_batch_size']} (activation checkpointing "
        f"{'on' if rec['activation_checkpointing'] else 'off'}): {format_ratio(rec['estimated_speedup'])} the base "
        f"(micro_batch_size={rec['base_micro_batch_size']}), confidence {rec['confidence']}/100, "
        f"{format_int(rec['tokens_per_s'])} tokens/s"
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


def paired_tokens_per_s(
    probes: list[dict[str, Any]], base_micro_batch_size: int | None
) -> list[float | None]:
    """Each probe's throughput as the plots show it: the base's typical tokens/s (the median of the base
    probe's and the base speed each paired probe implies, as `SearchState.base_tokens_per_s`) times the
    probe's ratio to the base, timed pass by pass; None for a probe without a ratio or a base."""
    base = _base_index(probes, base_micro_batch_size)
    if base is None or not probes[base]["tokens_per_s"]:
        return [None] * len(probes)
    implied = [
        p["tokens_per_s"] / p["relative_throughput"]
        for p in probes
        if p["fits"] and p.get("relative_throughput") and p["tokens_per_s"]
    ]
    scale = statistics.median([probes[base]["tokens_per_s"], *implied])
    return [
        scale if i == base else scale * p["relative_throughput"] if p.get("relative_throughput") else None
        for i, p in enumerate(probes)
    ]


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
    """Every probe in order: memory, pass time, its own tokens/s and the paired figures the plots use
    ("x base"), with the recommended size, the trained one (`trained`: micro batch, activation
    checkpointing) and repeated measurements marked."""
    probes = document["probes"]
    rec = document["recommendation"]
    base = _base_index(probes, rec.get("base_micro_batch_size"))
    paired = paired_tokens_per_s(probes, rec.get("base_micro_batch_size"))
    recommended = (rec["micro_batch_size"], bool(rec["activation_checkpointing"]))
    rows = []
    for index, probe in enumerate(probes):
        ratio = 1.0 if index == base else probe.get("relative_throughput")
        paired_here = paired[index]
        rows.append(
            [
                str(index + 1),
                format_int(probe["micro_batch_size"]),
                "on" if probe["activation_checkpointing"] else "off",
                "yes" if probe["fits"] else "no",
                format_bytes(probe["peak_memory_bytes"]) if probe["peak_memory_bytes"] else "",
                f"{format_number(probe['step_time_s'] * 1000)} ms" if probe["step_time_s"] else "",
                format_int(probe["tokens_per_s"]) if probe["tokens_per_s"] else "",
                format_ratio(ratio) if ratio else "",
                format_int(paired_here) if paired_here else "",
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
        "own tokens/s",
        "x base, pass by pass",
        "paired tokens/s",
        "timed passes",
        "",
    ]
    return table(header, rows, align="rrllrrrrrrl")


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


def study_section(noise: dict[str, Any] | None, study_error: str | None, *, heading: str = "h2") -> Html:
    """The effective-batch study: per multiplier, its advice, and a flag when that advice is not trustworthy."""
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
    critical = noise.get("critical_batch_size")
    advice = (
        f"Critical batch ~{format_number(critical)} samples; advised target global batch "
        f"{format_int(noise['recommended_global_batch_size'])}, LR scaling {noise['lr_scaling']}."
        if critical is not None and noise.get("recommended_global_batch_size")
        else "No critical batch could be measured."
    )
    warnings = study_warnings(noise)
    flag = (
        "<div class='warn'><b>Not trustworthy as it stands:</b>" + bullets(warnings) + "</div>"
        if warnings
        else ""
    )
    header = ["accumulation", "global batch", "noise scale (samples)", "gradient norm", "coherence"]
    # An explore.json written before the study recorded its weights measured a randomly initialised model.
    weights = f"Measured on the model's weights from: {noise.get('weights', 'random init')}."
    return Html(
        f"<{heading}>Effective-batch study</{heading}><p>{html.escape(advice)}</p>"
        f"<p>{html.escape(weights)}</p>{flag}"
        f"{table(header, rows, align='rrrrr')}{bullets(noise['reasoning'])}"
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
        "<p>The plotted throughput of a size is the base probe's tokens/s times the size's median ratio "
        "to the base, timed pass by pass in the same process (a shared machine's changing speed cancels "
        "out of the ratio): the table's paired column; a probe's own tokens/s is beside it.</p>"
        f"<h2>Probes</h2>{probe_table(document)}"
        f"{study_section(document['noise_scale'], document['study_error'])}",
    )


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
