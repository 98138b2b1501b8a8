"""Explore's throughput in the run report and explore.html: one figure per probe with its meaning in the column
header (the figure the probe's console line printed, the plot's markers), one figure per size (the median over
all its probes' paired passes: the recommendation's, the plot's line, the plan's notes and the trained micro
batch's card), and the noise-scale study's caveat beside its number."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict
from typing import Any

import pytest

from batchpilot.explore.recommend import Topology, plan_notes, recommend
from batchpilot.explore.records import ProbeResult, Setting
from batchpilot.explore.report import THROUGHPUT_MEANING, explore_html, rebuilt_state, throughput_figure
from batchpilot.explore.runner import describe
from batchpilot.explore.search import SearchState
from batchpilot.report import write_report
from report_page import card, row, text_of
from report_samples import sample_document, sample_explore

BASE_TOKENS_PER_S = 30_000.0


def probe(micro: int, pair_ratios: list[float], *, speed: float = 1.0) -> ProbeResult:
    """A fitting probe timed pass by pass next to the base (micro batch 1) at `pair_ratios` (none: the base),
    on a machine running at `speed` times its speed during the base probe (its own tokens/s moves with it,
    its ratios to the base do not)."""
    ratio = sorted(pair_ratios)[len(pair_ratios) // 2] if pair_ratios else None
    tokens_per_s = BASE_TOKENS_PER_S * (ratio or 1.0) * speed
    return ProbeResult(
        micro_batch_size=micro, activation_checkpointing=False, compile=False, fits=True,
        peak_memory_bytes=(330 + micro) * 2**20, step_time_s=micro * 128 / tokens_per_s, tokens_per_s=tokens_per_s,
        samples_per_s=tokens_per_s / 128, repeats=max(1, len(pair_ratios)), pair_ratios=pair_ratios,
        relative_throughput=ratio,
    )  # fmt: skip


def explored() -> dict[str, Any]:
    """An explore.json as explore writes it: the base, 16 measured twice (its first probe's three pairs at
    1.2x, its second's one at 1.8x), and 48 at 2.0x, the fastest, while the machine ran slower (its own
    tokens/s: 1.6x the base probe's); the plan (global batch 64 over 2 devices) cannot take 48 and notes 16
    instead. The recommendation and notes are explore's own."""
    probes = [
        probe(1, []), probe(16, [1.2, 1.2, 1.2], speed=1.1), probe(16, [1.8]), probe(48, [2.0, 2.0, 2.0], speed=0.8)
    ]  # fmt: skip
    state = SearchState(settings=[Setting(False)], max_micro_batch_size=64, seq_len=128)
    for result in probes:
        state.add(result)
    recommendation = recommend(state)
    assert recommendation is not None
    plan_notes(
        recommendation=recommendation, state=state,
        topology=Topology(global_batch_size=64, devices_per_node=1, min_nodes=1, max_nodes=2),
    )  # fmt: skip
    return sample_explore() | {
        "probes": [p.public() for p in probes],
        "recommendation": asdict(recommendation),
        "stopped_because": "converged",
    }


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("report") / "report.html"
    write_report(document=sample_document(), records=[], explore=explored(), html_path=path)
    return path.read_text()


def test_the_trained_micro_batch_is_compared_with_explores_pick_in_the_recommendations_own_figure(page):
    # 16's paired passes: 1.2, 1.2, 1.2 and 1.8, median 1.2 (not the median of its two probes, 1.5); 48: 2.0.
    assert card(page, "micro batch trained")[1] == (
        "the fastest measured size that splits every stage's global batch over its data-parallel size; "
        "explore's fastest was 48 at 2.00x the base micro batch's tokens/s (micro_batch_size=1), this size at "
        "1.20x: 0.60x the fastest's throughput"
    )
    # explore's own note about the size the plan can take says the same 0.60x.
    note = explored()["recommendation"]["plan_notes"][1]
    assert note.startswith("or keep global_batch_size 64 with micro_batch_size=16") and note.endswith(
        ": 0.60x the recommendation's throughput"
    )
    assert (
        "micro_batch_size=48 (activation checkpointing off): 2.00x the base micro batch's tokens/s "
        "(micro_batch_size=1, timed pass by pass: the median over every probe of this size)" in text_of(page)
    )


def test_each_probe_has_one_throughput_figure_the_one_its_console_line_printed(page):
    header = re.search(r"<h3>Probes</h3><table><thead><tr>(.*?)</tr>", page)
    assert header
    assert [text_of(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", header.group(1))] == [
        "#", "micro batch", "act. ckpt", "fits", "peak memory", "time/pass", THROUGHPUT_MEANING, "timed passes", "",
    ]  # fmt: skip
    figures = [row(page, [str(i + 1)])[6] for i in range(4)]
    assert figures == ["1.00x", "1.20x", "1.80x", "2.00x"]
    for number, figure in enumerate(figures[1:], start=2):
        line = describe(ProbeResult.from_dict(explored()["probes"][number - 1]))
        assert line.endswith(f"tokens/s, {figure} the base pass by pass"), line
    # the size measured twice, with the figure the recommendation and the plot's line use
    assert "micro_batch_size=16 (activation checkpointing off): 1.20x over #2, #3" in text_of(page)


def test_the_plot_marks_each_probes_figure_and_draws_each_sizes(page):
    state = rebuilt_state(explored())
    assert state is not None
    lines = {line.get_label(): line for line in throughput_figure(state).axes[0].get_lines()}
    probes = lines["activation checkpointing off: each probe"]
    assert list(zip(probes.get_xdata(), probes.get_ydata(), strict=True)) == [
        (1, 1.0), (16, 1.2), (16, 1.8), (48, 2.0),
    ]  # fmt: skip
    sizes = lines["activation checkpointing off: per size"]
    assert list(sizes.get_xdata()) == [1, 16, 48]
    assert list(sizes.get_ydata()) == pytest.approx([1.0, 1.2, 2.0])
    assert sizes.get_ydata()[-1] == pytest.approx(explored()["recommendation"]["estimated_speedup"])


def study_paragraph(page: str, words: str) -> str:
    """The text of the one paragraph of the page that holds `words`."""
    found = [text_of(p) for p in re.findall(r"<p>(.*?)</p>", page) if words in text_of(p)]
    assert len(found) == 1, found
    return " ".join(found[0].split())


def test_the_studys_caveat_stands_beside_its_critical_batch(tmp_path):
    explore = sample_explore(study_train_steps=200, critical_batch_size=40.0)
    page = explore_html(explore, [])
    assert study_paragraph(page, "Critical batch") == (
        "Critical batch ~40 samples (a lower estimate: the noise scale grows as the loss falls); advised target "
        "global batch 48, LR scaling none."
    )
    early = explore_html(sample_explore(), [])  # 50 training steps: the warning goes beside the number too
    assert study_paragraph(early, "Critical batch") == (
        "Critical batch ~0.32 samples (a lower estimate, measured after only 50 training step(s): the noise "
        "scale grows as the loss falls); advised target global batch 48, LR scaling none."
    )
    flagged = re.search(r"<div class='warn'>(.*?)</div>", early)
    assert flagged and "Critical batch ~0.32" in flagged.group(1) and "Not trustworthy" in flagged.group(1)


def test_a_critical_batch_that_could_not_be_measured_says_why_beside_it(tmp_path):
    noise = sample_explore(study_train_steps=200)["noise_scale"] | {
        "critical_batch_size": None,
        "recommended_global_batch_size": None,
        "reasoning": [
            "the critical batch could not be measured (measured at micro_batch_size=48 after 200 training step(s), "
            "pooled over accumulation 2x, 4x): B_simple came out 0.32 samples, below the smallest batch measured "
            "(48), where two batch sizes cannot resolve it",
            "keep the configured global batch and train.lr_scaling; watch noise_scale in metrics.jsonl",
        ],
    }
    page = explore_html(sample_explore() | {"noise_scale": noise}, [])
    assert study_paragraph(page, "critical batch") == (
        "The critical batch could not be measured (measured at micro_batch_size=48 after 200 training step(s), "
        "pooled over accumulation 2x, 4x): B_simple came out 0.32 samples, below the smallest batch measured "
        "(48), where two batch sizes cannot resolve it."
    )


def test_the_trained_size_explore_did_not_measure_says_so(tmp_path):
    document = dataclasses.replace(sample_document())
    explore = explored()
    explore["probes"] = [p for p in explore["probes"] if p["micro_batch_size"] != 16]
    path = tmp_path / "report.html"
    write_report(document=document, records=[], explore=explore, html_path=path)
    assert card(path.read_text(), "micro batch trained")[1].endswith(
        "explore's fastest was 48 at 2.00x the base micro batch's tokens/s (micro_batch_size=1), this size was not "
        "measured"
    )
