"""Numbers for people in the plan table (plan.md, the CLI, the report) and the formatting they come from."""

from __future__ import annotations

import pytest

from batchpilot.planning.units import (
    format_duration,
    format_int,
    format_loss,
    format_node_hours,
    format_number,
    format_ratio,
)
from batchpilot.report import plan_html, plan_markdown
from report_samples import sample_document


@pytest.mark.parametrize(
    ("value", "text"),
    [(2.173165154900067, "2.17"), (0.3206, "0.321"), (0.000733, "0.000733"), (0.03, "0.03"), (95_560.66, "95,561"),
     (16_384.0, "16,384"), (12.0, "12"), (0.0, "0")],
)  # fmt: skip
def test_a_measured_number_has_three_significant_digits_and_no_trailing_zeros(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0.4 s"), (19.63, "20 s"), (59.7, "1.0 min"), (72, "1.2 min"), (3599, "1.0 h"), (7200, "2.0 h"),
     (500_000, "5.8 days")],
)  # fmt: skip
def test_a_duration_is_written_in_the_unit_a_person_reads_it_in(seconds, text):
    assert format_duration(seconds) == text


def test_counts_ratios_and_node_hours():
    assert format_int(16384) == "16,384"
    assert format_ratio(2.173165154900067) == "2.17x"
    assert format_node_hours(0.0087251) == "0.0087"  # a short run is not "0.00"
    assert format_node_hours(12.345) == "12"
    assert format_loss(2.807967782020569) == "2.808" and format_loss(3.4) == "3.400"  # as the training log


def test_a_tiny_runs_plan_md_shows_its_time_and_node_hours():
    document = sample_document()  # the demo at 64 samples/s per device: seconds and hundredths of node-hours
    lines = plan_markdown(document.plan, document.cost, document.memory).splitlines()
    assert lines[0].endswith("| est. time | node-hours |")
    assert lines[2].endswith("| 22 s | 0.006 |")  # 1,376 samples at 64/s on one node: 21.5 s
    assert lines[5].endswith("| 1.6 min | 0.053 |")  # 12,288 at 128/s on two: 96 s, 192 node-seconds
    footer = [line for line in lines if line.startswith("estimate at ")]
    assert footer == [
        "estimate at 64 samples/s per device: 2.7 min, 0.071 node-hours; a pool held at max_nodes=2 would cost "
        "0.089 node-hours (20% saved by resizing per stage)"
    ]


def test_the_report_shows_the_same_stage_cells():
    document = sample_document()
    page = plan_html(document.plan, document.cost, document.memory)
    assert "<td class='r'>0.006</td>" in page and "<td class='r'>1.6 min</td>" in page
