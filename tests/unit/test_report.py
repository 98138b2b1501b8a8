"""The run report: the headline a practitioner reads first, each stage's actuals beside the plan, the plots over
consumed samples, the exploration as explore.html shows it, and numbers written for people throughout."""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from typing import Any

import pytest

from batchpilot.explore.report import explore_html
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.capacity import LaunchCapacity, apply_capacity
from batchpilot.report import loss_figure, write_report
from batchpilot.report.figures import trials_figure
from report_page import card, row, text_of
from report_samples import sample_document, sample_explore, sample_records, sample_trials_document


@pytest.fixture(scope="module")
def document() -> RunDocument:
    return sample_document()


@pytest.fixture(scope="module")
def rendered(document, tmp_path_factory) -> tuple[str, dict[str, float]]:
    path = tmp_path_factory.mktemp("report") / "report.html"
    summary = write_report(
        document=document, records=sample_records(document), explore=sample_explore(), html_path=path
    )
    return path.read_text(), summary


def test_the_headline_gives_losses_steps_samples_tokens_time_and_node_hours(rendered):
    page, _ = rendered
    # 349 steps of 0.5 s; the loss falls 0.01 a step from 5.0; validation every 40th step.
    assert card(page, "final training loss") == ("1.520", "from 5.000 at the first step")
    assert card(page, "validation loss") == ("2.310", "last evaluated at sample 14,528")
    assert card(page, "optimizer steps") == ("349", "planned 349")
    assert card(page, "samples") == ("16,384", "planned 16,384")
    assert card(page, "tokens") == ("2,097,152", "128 per sample")
    # Estimate at 64 samples/s per device: 21.5 + 21.5 + 21 s on 1 node, then 96 s on 2 = 160 s, 0.071 node-hours;
    # trained: 157 steps on 1 node and 192 on 2, 0.5 s each = 174.5 s, (78.5 + 192) / 3600 node-hours.
    assert card(page, "training time") == (
        "2.9 min",
        "estimated 2.7 min; the sum of step times, without starts and resizes",
    )
    # The wall clock: 174.5 s of steps and 30 s between each of the 4 stages.
    assert card(page, "wall time") == (
        "4.4 min",
        "first step to last; 1.5 min of it launches, resizes, checkpoints and evaluation",
    )
    assert card(page, "node-hours") == ("0.075", "estimated 0.071; a pool held at 2 nodes: 0.089")
    assert card(page, "nodes") == ("2", "every stage on its planned nodes")
    assert card(page, "MFU") == ("not measured", "the trainer reports it on GPUs and TPUs")


def test_the_headline_says_why_the_trained_micro_batch_is_not_explores_pick(rendered):
    page, summary = rendered
    # explore's fastest, 48, at 2.0x the base; 16 at 1.5x: 0.75x its throughput.
    assert card(page, "micro batch trained") == (
        "16",
        "the fastest measured size that splits every stage's global batch over its data-parallel size; "
        "explore's fastest was 48 at 2.00x the base micro batch's tokens/s (micro_batch_size=1), this size at "
        "1.50x: 0.75x the fastest's throughput",
    )
    assert summary["micro_batch_size"] == 16


def test_each_stage_shows_its_actuals_beside_the_plan(rendered):
    page, _ = rendered
    header = [
        "launch",
        "stage",
        "global batch",
        "samples",
        "nodes planned",
        "nodes used",
        "est. time",
        "time",
    ]
    assert header[0] in text_of(page) and "validation loss" in text_of(page)
    # 12,288 samples in 192 steps of 0.5 s (est. 12,288 / 128 samples/s = 96 s): 16,384 tokens/s.
    assert row(page, ["final", "final"]) == [
        "final", "final", "64", "12,288", "2", "2", "1.6 min", "1.6 min", "16,384", "1.520", "2.310",
    ]  # fmt: skip
    # stage-0: 86 steps of 16 samples on 1 node; validation first at the 40th step, last at the 80th.
    assert row(page, ["stages-0-2", "stage-0"]) == [
        "stages-0-2", "stage-0", "16", "1,376", "1", "1", "22 s", "43 s", "4,096", "4.150", "4.710",
    ]  # fmt: skip


def test_the_plots_cover_loss_noise_scale_throughput_and_learning_rate(rendered):
    page, _ = rendered
    captions = re.findall(r"<figure><figcaption>(.*?)</figcaption><img ", page)
    assert captions[:4] == [
        "Training and validation loss",
        "Batch-size ramp, measured noise scale and nodes",
        "Throughput",
        "Learning rate",
    ]


def test_the_page_has_no_python_reprs_or_long_floats(rendered):
    visible = text_of(rendered[0])
    for word in ("True", "False", "None", "{'", "':"):
        assert word not in visible, word
    assert not re.findall(r"\d\.\d{5,}", visible)  # e.g. 2.173165154900067
    assert "est. hours" not in visible and " 0.00 " not in visible


def test_the_exploration_marks_the_recommended_trained_and_repeated_probes(rendered):
    page, _ = rendered
    assert "<b>Recommendation:</b> micro_batch_size=48 (activation checkpointing off): 2.00x the base" in page
    # One throughput figure per probe: its ratio to the base, timed pass by pass.
    assert row(page, ["5", "16"])[6:] == ["1.50x", "4", "trained"]
    assert row(page, ["9", "48"])[6:] == ["2.00x", "3", "recommended"]
    assert row(page, ["10", "48"])[-1] == "recommendedrepeat of #9"
    assert row(page, ["1", "1"])[-1] == "base"


def test_the_studys_advice_is_flagged_when_it_is_not_trustworthy(tmp_path, document):
    untrusted = write_report(
        document=document, records=[], explore=sample_explore(), html_path=tmp_path / "a.html"
    )
    page = (tmp_path / "a.html").read_text()
    assert untrusted["num_stages"] == 4
    assert "Not trustworthy as it stands" in page
    assert "measured after only 50 training step(s) (fewer than 100)" in page
    assert "a critical batch of 0.32 samples, below one sample" in page
    trusted = sample_explore(study_train_steps=200, critical_batch_size=40.0)
    write_report(document=document, records=[], explore=trusted, html_path=tmp_path / "b.html")
    assert "Not trustworthy" not in (tmp_path / "b.html").read_text()


def test_explore_html_presents_the_probes_with_the_same_table(tmp_path):
    page = explore_html(sample_explore(), [])
    assert row(page, ["9", "48"])[6:] == ["2.00x", "3", "recommended"]
    assert "trained" not in text_of(page)  # explore alone trains nothing
    assert "Not trustworthy as it stands" in page


def test_the_loss_figure_marks_validation_loss_over_consumed_samples(document):
    rows = sample_records(document, validation_every=40)
    axis = loss_figure(document.plan, rows).axes[0]
    lines = {line.get_label(): line for line in axis.get_lines()}
    validation = lines["validation"]
    assert validation.get_linestyle() == "None" and validation.get_marker() == "o"  # markers, no line
    expected = [(r["consumed_samples"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
    assert list(zip(validation.get_xdata(), validation.get_ydata(), strict=True)) == expected
    training = [f"{s.name} (batch {s.global_batch_size})" for s in document.plan.stages]
    assert sorted(lines) == sorted([*training, "validation"])
    assert axis.get_ylabel() == "loss"


def test_the_summary_holds_the_last_validation_loss(rendered, document):
    rows = sample_records(document)
    assert rendered[1]["final_val_loss"] == [r["val_loss"] for r in rows if r["val_loss"] is not None][-1]
    assert rendered[1]["final_loss"] == rows[-1]["loss"]
    assert rendered[1]["wall_hours"] == pytest.approx(264.5 / 3600)


def test_records_without_a_wall_clock_show_no_wall_time(tmp_path, document):
    records = [{k: v for k, v in r.items() if k != "time"} for r in sample_records(document)]
    summary = write_report(document=document, records=records, explore=None, html_path=tmp_path / "r.html")
    assert "wall_hours" not in summary
    assert "wall time" not in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("validation_every", [None, 10_000])  # no key (older runs), or never evaluated
def test_records_without_validation_loss_still_make_a_report(tmp_path, document, validation_every):
    rows: list[dict[str, Any]] = sample_records(document, validation_every=validation_every)
    summary = write_report(document=document, records=rows, explore=None, html_path=tmp_path / "r.html")
    assert "final_val_loss" not in summary
    assert math.isclose(summary["final_loss"], rows[-1]["loss"])
    labels = [line.get_label() for line in loss_figure(document.plan, rows).axes[0].get_lines()]
    assert "validation" not in labels
    assert "validation loss</div>" not in (tmp_path / "r.html").read_text()


def test_a_launch_on_fewer_nodes_shows_in_the_headline_the_stage_table_and_the_capacity_section(tmp_path):
    planned = sample_document()
    # The final launch (planned on 2 nodes) got 1 after waiting 10 minutes for the second.
    record = LaunchCapacity(
        launch="final", first_stage=3, last_stage=3, planned_nodes=2, ready_nodes=1, nodes=1, waited_s=600.0,
        reason="stockout",
    )  # fmt: skip
    plan = apply_capacity(planned.plan, [record], expansion_factor=Fraction(1))
    document = dataclasses.replace(planned, plan=plan, capacity=(record,))
    path = tmp_path / "report.html"
    summary = write_report(document=document, records=sample_records(document), explore=None, html_path=path)
    page = path.read_text()
    assert card(page, "nodes") == ("1 of 2 planned", "1 stage(s) on fewer nodes than planned")
    assert row(page, ["final", "final"])[4:6] == ["2", "1"]
    # 192 steps of 0.5 s on 1 node: 96 s, 0.027 node-hours, 48 s later than on 2; the wait: 1 node for 600 s.
    assert row(page, ["final", "2", "1", "1"]) == [
        "final", "2", "1", "1", "10.0 min", "0.17", "1.6 min", "0.027", "48 s", "stockout",
    ]  # fmt: skip
    assert summary["launches_on_fewer_nodes"] == 1


@pytest.fixture(scope="module")
def trials_rendered(tmp_path_factory) -> tuple[str, dict[str, float]]:
    document = sample_trials_document()
    path = tmp_path_factory.mktemp("trials") / "report.html"
    summary = write_report(
        document=document, records=sample_records(document), explore=sample_explore(), html_path=path
    )
    return path.read_text(), summary


def test_the_batch_trials_follow_the_headline_with_the_decision_and_the_choice(trials_rendered):
    page, summary = trials_rendered
    text = " ".join(text_of(page).split())
    assert text.index("micro batch trained") < text.index("Batch trials") < text.index("Launches and stages")
    assert (
        "Decision: critical batch 32: the largest whose validation loss at the budget (3.52, LR x 2) is within "
        "1.0% of every smaller batch's best; batch 64 reached 3.75, more than 1.0% above the best smaller "
        "batch's 3.5." in text
    )
    # LR x 2 on the sqrt rule's 3e-4 x sqrt(32 / 64); the sample explore's study measured 0.32.
    assert (
        "Chosen: global batch 32 with LR x 2 (0.000424); explore's noise-scale study measured a critical batch "
        "of 0.32 (a lower estimate, measured after only 50 training step(s): the noise scale grows as the loss "
        "falls). The run's target global batch: 64." in text
    )
    assert (
        "Calibration: B_simple at the branch point (the warm-up's last measurement) was 8 samples; the critical "
        "batch over it is 4, the adaptive ramp-up's scale for this model and data" in text
    )
    assert "excluded: batch 64 x LR 2: CUDA out of memory" in text
    assert "9 branches after a warm-up of 1,024 samples at batch 16, each 256 samples (32,768 tokens)" in text
    assert (summary["trials_critical_batch"], summary["trials_lr_multiplier"]) == (32, 2.0)
    assert (summary["trials_branches"], summary["trials_failed_branches"]) == (9, 1)


def test_the_trials_table_marks_the_best_lr_per_batch_the_chosen_branch_and_why_one_failed(trials_rendered):
    page, _ = trials_rendered
    assert row(page, ["trial-0-b16-lr0p5"]) == [
        "trial-0-b16-lr0p5", "16", "0.5", "0.000075", "1", "ok", "3.600", "", "",
    ]  # fmt: skip
    assert row(page, ["trial-1-b16-lr1"])[6:8] == ["3.500", "best"]
    assert row(page, ["trial-5-b32-lr2"]) == [
        "trial-5-b32-lr2", "32", "2", "0.000424", "1", "ok", "3.520", "best, chosen", "",
    ]  # fmt: skip
    assert row(page, ["trial-7-b64-lr1"])[6:8] == ["3.750", "best"]
    assert row(page, ["trial-8-b64-lr2"]) == [
        "trial-8-b64-lr2", "64", "2", "0.0006", "1", "failed", "", "", "CUDA out of memory",
    ]  # fmt: skip
    assert "<figcaption>Validation loss of each branch over its tokens</figcaption>" in page


def test_the_trials_plot_has_a_loss_over_tokens_line_per_branch_that_trained():
    outcome = sample_trials_document().trials_outcome
    lines = trials_figure(outcome.results, seq_len=128).axes[0].get_lines()
    assert len(lines) == 8  # the failed branch has no curve
    assert lines[0].get_label() == "batch 16, LR x 0.5"
    assert list(lines[0].get_xdata()) == [8192, 16384, 24576, 32768]  # 64..256 samples x 128 tokens
    assert list(lines[5].get_ydata()) == [4.15, 3.85, 3.6, 3.52]


def test_a_run_without_trials_has_no_trials_section(rendered):
    page, summary = rendered
    assert "Batch trials" not in page
    assert "trials_critical_batch" not in summary
