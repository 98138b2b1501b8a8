"""The run report: the loss figure (training lines, validation markers) and the summary KFP shows."""

from __future__ import annotations

import math
from typing import Any

import pytest

from batchpilot import workflow
from batchpilot.report import loss_figure, write_report
from batchpilot.rundoc import RunDocument
from helpers import REPO

DEMO = (REPO / "configs" / "demo.yaml").read_text()


@pytest.fixture(scope="module")
def document() -> RunDocument:
    return workflow.plan(workflow.config_from_text(DEMO), micro_batch_size=8)


def records(document: RunDocument, *, validation_every: int | None) -> list[dict[str, Any]]:
    """One record per optimizer step, the training loss falling; `val_loss` every `validation_every` steps
    (null on the others), or no such key at all (a run from before validation)."""
    steps = [
        (stage.index, consumed)
        for stage in document.plan.stages
        for consumed in range(
            stage.start_sample + stage.global_batch_size, stage.end_sample + 1, stage.global_batch_size
        )
    ]
    rows: list[dict[str, Any]] = []
    for index, (stage, consumed) in enumerate(steps):
        row: dict[str, Any] = {
            "consumed_samples": consumed,
            "stage": stage,
            "loss": 5.0 - index / 100,
            "tokens_per_s": 1000.0,
        }
        if validation_every is not None:
            row["val_loss"] = 5.5 - index / 100 if (index + 1) % validation_every == 0 else None
        rows.append(row)
    return rows


def test_the_loss_figure_marks_validation_loss_over_consumed_samples(document):
    rows = records(document, validation_every=40)
    axis = loss_figure(document.plan, rows).axes[0]
    lines = {line.get_label(): line for line in axis.get_lines()}
    validation = lines["validation"]
    assert validation.get_linestyle() == "None" and validation.get_marker() == "o"  # markers, no line
    expected = [(r["consumed_samples"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
    assert list(zip(validation.get_xdata(), validation.get_ydata(), strict=True)) == expected
    training = [f"{s.name} (batch {s.global_batch_size})" for s in document.plan.stages]
    assert sorted(lines) == sorted([*training, "validation"])
    assert axis.get_ylabel() == "loss"


def test_the_summary_holds_the_last_validation_loss_and_the_report_shows_it(tmp_path, document):
    rows = records(document, validation_every=40)
    rows[-1]["val_loss"] = None  # the last step did not evaluate: the last evaluation counts
    html_path = tmp_path / "report.html"
    summary = write_report(document=document, records=rows, explore=None, html_path=html_path)
    last = [r["val_loss"] for r in rows if r["val_loss"] is not None][-1]
    assert summary["final_val_loss"] == last
    assert summary["final_loss"] == rows[-1]["loss"]
    page = html_path.read_text()
    assert f"final_val_loss: {last:,.4g}" in page
    assert page.count("<img ") == 2  # the ramp and the loss figure


@pytest.mark.parametrize("validation_every", [None, 10_000])  # no key (older runs), or never evaluated
def test_records_without_validation_loss_still_make_a_report(tmp_path, document, validation_every):
    rows = records(document, validation_every=validation_every)
    summary = write_report(document=document, records=rows, explore=None, html_path=tmp_path / "r.html")
    assert "final_val_loss" not in summary
    assert math.isclose(summary["final_loss"], rows[-1]["loss"])
    labels = [line.get_label() for line in loss_figure(document.plan, rows).axes[0].get_lines()]
    assert "validation" not in labels
