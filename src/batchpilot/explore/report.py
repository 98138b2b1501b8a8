"""The outputs of an exploration: explore.json (the contract), explore_metrics.json (flat numbers for
KFP) and explore.html (self-contained: plots as base64 PNGs). Each is written atomically."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config
from batchpilot.explore.records import Setting
from batchpilot.explore.search import SearchState
from batchpilot.files import write_atomically

if TYPE_CHECKING:
    from batchpilot.explore.runner import ExploreResult

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
    """The explore.json contract (DESIGN.md): probes, recommendation, noise_scale."""
    return {
        "format_version": EXPLORE_FORMAT_VERSION,
        "name": config.name,
        "device": result.probes[0].device if result.probes else None,
        "probe_parallelism": result.layout.parallelism,
        "processes_per_probe": result.layout.processes,
        "seq_len": config.data.seq_len,
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
        axes.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
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


def _list(lines: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _probe_rows(document: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for index, probe in enumerate(document["probes"], start=1):
        peak = probe["peak_memory_bytes"]
        rows.append(
            [
                index,
                probe["micro_batch_size"],
                "on" if probe["activation_checkpointing"] else "off",
                "yes" if probe["fits"] else "no",
                f"{peak / 2**20:,.0f}" if peak else "",
                f"{probe['step_time_s'] * 1000:,.1f}" if probe["step_time_s"] else "",
                f"{probe['tokens_per_s']:,.0f}" if probe["tokens_per_s"] else "",
                f"{probe['relative_throughput']:.3f}" if probe.get("relative_throughput") else "",
                probe["repeats"],
                probe["error"] or "",
            ]
        )
    return rows


def _study_section(noise: dict[str, Any] | None, study_error: str | None) -> str:
    if noise is None:
        return f"<h2>Effective-batch study</h2><p>{html.escape(study_error or 'not run (--no-study)')}</p>"
    rows = [
        [
            f"{r['multiplier']}x",
            r["global_batch_size"],
            f"{r['noise_scale']:,.1f}" if r["noise_scale"] else "not measurable",
            f"{r['grad_norm']:.4f}",
            f"{r['coherence']:.3f}",
        ]
        for r in noise["per_multiplier"]
    ]
    table = _table(["accumulation", "global batch", "noise scale", "gradient norm", "coherence"], rows)
    return f"<h2>Effective-batch study</h2>{table}{_list(noise['reasoning'])}"


def explore_html(document: dict[str, Any], figures: list[tuple[str, str]]) -> str:
    """A self-contained page: recommendation, plots, every probe, the study."""
    rec = document["recommendation"]
    images = "".join(
        f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
        for title, png in figures
    )
    probes = _table(
        [
            "#",
            "micro batch",
            "act. ckpt",
            "fits",
            "peak MiB",
            "ms/pass",
            "tokens/s",
            "x base, pass by pass",
            "timed passes",
            "error",
        ],
        _probe_rows(document),
    )
    summary = (
        f"micro_batch_size={rec['micro_batch_size']} (activation checkpointing "
        f"{'on' if rec['activation_checkpointing'] else 'off'}), {rec['estimated_speedup']:.2f}x the base "
        f"(micro_batch_size={rec['base_micro_batch_size']}), confidence {rec['confidence']}/100, "
        f"{rec['tokens_per_s']:,.0f} tokens/s"
    )
    style = "body{font-family:sans-serif;max-width:960px;margin:2em auto}td,th{border:1px solid #ccc;padding:3px 6px}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>batchpilot explore: "
        f"{html.escape(document['name'])}</title><style>{style}</style></head><body>"
        f"<h1>batchpilot explore: {html.escape(document['name'])}</h1>"
        f"<p><b>Recommendation:</b> {html.escape(summary)}</p>{_list(rec['reasoning'] + rec['plan_notes'])}"
        f"<p>{len(document['probes'])} probes on {html.escape(str(document['device']))}, each "
        f"{document['processes_per_probe']} process(es) under {html.escape(document['probe_parallelism'])}, stopped: "
        f"{html.escape(document['stopped_because'])}, {document['elapsed_s']:.0f} s</p>"
        f"<h2>Throughput and memory</h2>{images}"
        "<p>The plotted throughput of a size is the base probe's tokens/s times the size's median ratio "
        "to the base, timed pass by pass in the same process (a shared machine's changing speed cancels "
        "out of the ratio); a probe's own tokens/s is in the table.</p>"
        f"<h2>Probes</h2>{probes}"
        f"{_study_section(document['noise_scale'], document['study_error'])}</body></html>\n"
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
