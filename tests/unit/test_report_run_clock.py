"""The report's wall time and header: the run from its first task (the canary's or explore's start, as their
files record it) to its last record, said in the card's detail part by part; and the run's status and the
date of its last record in the header."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from batchpilot.config import config_from_text
from batchpilot.explore.recommend import Recommendation
from batchpilot.explore.records import Setting
from batchpilot.explore.report import explore_document
from batchpilot.explore.result import ExploreResult
from batchpilot.explore.search import SearchState
from batchpilot.report import write_report
from helpers import REPO
from report_page import card, text_of
from report_samples import WALL_START, sample_canary, sample_document, sample_explore, sample_records

# sample_records: the first step starts at WALL_START, the last ends 264.5 s later (174.5 s of steps).
CANARY = sample_canary(started_at=WALL_START - 100.0, finished_at=WALL_START - 90.0)
EXPLORE_TIMES = {"started_at": WALL_START - 85.0, "finished_at": WALL_START - 25.0}


def render(tmp_path: Path, **kwargs) -> tuple[str, dict[str, float]]:
    document = sample_document()
    path = tmp_path / "report.html"
    arguments = {"records": sample_records(document), "explore": None, "canary": None} | kwargs
    summary = write_report(document=document, html_path=path, **arguments)
    return path.read_text(), summary


def test_the_wall_time_runs_from_the_canarys_start_and_says_what_it_covers(tmp_path):
    page, summary = render(tmp_path, canary=CANARY, explore=sample_explore() | EXPLORE_TIMES)
    # 100 s before the first step to 264.5 s after it: 10 s of canary, 60 s of explore, 174.5 s of steps and
    # 120 s besides (between the tasks, and the 30 s gaps between the 4 stages).
    assert card(page, "wall time") == (
        "6.1 min",
        "from the canary's start to the last step: the canary 10 s, explore 1.0 min, training steps 2.9 min "
        "and 2.0 min of planning, launches, resizes, checkpoints and evaluation",
    )
    assert summary["wall_hours"] == pytest.approx(364.5 / 3600)


def test_without_a_canary_the_wall_time_runs_from_explores_start(tmp_path):
    page, summary = render(tmp_path, explore=sample_explore() | EXPLORE_TIMES)
    assert card(page, "wall time") == (
        "5.8 min",
        "from explore's start to the last step: explore 1.0 min, training steps 2.9 min and 1.9 min of planning, "
        "launches, resizes, checkpoints and evaluation",
    )
    assert summary["wall_hours"] == pytest.approx(349.5 / 3600)


def test_explore_json_records_when_the_exploration_ran():
    config = config_from_text((REPO / "configs" / "demo.yaml").read_text())
    recommendation = Recommendation(
        micro_batch_size=16, activation_checkpointing=False, compile=False, estimated_speedup=1.9, confidence=70,
        samples_per_s=500.0, tokens_per_s=64_000.0, peak_memory_bytes=2**28, base_micro_batch_size=1,
    )  # fmt: skip
    result = ExploreResult(
        probes=[], recommendation=recommendation, noise_scale=None, output_dir=Path("."), elapsed_s=58.5,
        stopped_because="converged",
    )  # fmt: skip
    state = SearchState(settings=[Setting(False)], max_micro_batch_size=16, seq_len=128)
    before = time.time()
    document = explore_document(result=result, state=state, config=config, study_error=None)
    after = time.time()
    assert before - 0.001 <= document["finished_at"] <= after + 0.001  # rounded to the millisecond
    assert document["finished_at"] - document["started_at"] == pytest.approx(58.5, abs=0.002)


@pytest.fixture
def kolkata():
    """This machine's time zone at UTC+05:30 (a POSIX TZ rule: no time zone database needed), not the test
    machine's own."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "IST-5:30"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def status_line(page: str) -> str:
    match = re.search(r"<p class='status'>(.*?)</p>", page)
    assert match, "no status line"
    return " ".join(text_of(match.group(1)).split())


def test_the_header_says_the_run_completed_and_when_its_last_record_was_in_local_time(tmp_path, kolkata):
    page, _ = render(tmp_path)
    # The last step ended at WALL_START + 264.5 s: 2026-09-21 14:17:44 UTC.
    assert status_line(page) == "completed last record 2026-09-21T19:47:44+05:30"
    assert text_of(page).index("completed") < text_of(page).index("final training loss")


def test_the_header_of_a_failed_run_says_failed(tmp_path, kolkata):
    document = sample_document()
    records = sample_records(document)[
        :100
    ]  # stage-0 and the first 14 steps of stage-1: 86 x 0.5 + 30 + 14 x 0.5
    path = tmp_path / "report.html"
    write_report(
        document=document, records=records, explore=None, html_path=path, failure="the node was lost"
    )
    assert status_line(path.read_text()) == "failed last record 2026-09-21T19:44:40+05:30"
