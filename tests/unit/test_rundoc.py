"""plan.json's hashes: the config's, and the whole document's, so that a hand edit anywhere is refused."""

from __future__ import annotations

import json

import pytest

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.rundoc import FORMAT_VERSION, parse_run_document
from helpers import tiny_config


@pytest.fixture(scope="module")
def text() -> str:
    config = tiny_config(data_uri="gs://bucket/data", checkpoint_uri="gs://bucket/ckpt")
    return make_run_document(parse_config(config), samples_per_s_per_device=100.0).to_json()


def edited(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data, indent=2)


def test_an_untouched_document_reads_back_to_the_same_bytes(text):
    assert parse_run_document(text).to_json() == text


def test_a_run_record_with_its_goodput_ledger_reads_back_and_the_ledger_is_hashed_too(text):
    from dataclasses import replace

    from batchpilot.planning.goodput import build_ledger

    ledger = build_ledger(
        [{"kind": "pool", "before": 0, "after": 1, "requested_s": 0.0, "ready_s": 2.0}], now_s=10
    )
    assert ledger is not None
    record = replace(parse_run_document(text), goodput=ledger.to_dict()).to_json()
    assert "goodput" not in json.loads(text)  # a plan has none
    assert parse_run_document(record).goodput == ledger.to_dict()
    assert parse_run_document(record).to_json() == record
    with pytest.raises(BatchpilotError, match="document_hash mismatch"):
        parse_run_document(edited(record, lambda d: d["goodput"].update(goodput=1.0)))


EDITS = {
    "a stage's node count": lambda d: d["stages"][0].update(num_nodes=d["stages"][0]["num_nodes"] + 1),
    "a stage removed": lambda d: d["stages"].pop(1),
    "the peak learning rate": lambda d: d["lr_schedule"].update(lr=1.0),
    "the micro batch": lambda d: d.update(micro_batch_size=8),
    "a note": lambda d: d["run_notes"].append("edited by hand"),
    "the cost": lambda d: d["cost"].update(samples_per_s_per_device=1e6),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_an_edit_outside_the_config_is_refused_in_one_line(text, edit):
    with pytest.raises(BatchpilotError) as info:
        parse_run_document(edited(text, edit), source="runs/x/plan.json")
    line = str(info.value)
    assert line.startswith(
        "runs/x/plan.json: its stages or other parts were edited after batchpilot wrote it"
    )
    assert "document_hash mismatch" in line and "\n" not in line


def test_an_edited_config_is_named_as_such(text):
    changed = edited(text, lambda d: d["config"]["train"].update(lr=1.0))
    with pytest.raises(BatchpilotError, match="config was edited after the plan was made"):
        parse_run_document(changed)


def test_a_document_whose_hash_was_removed_is_refused(text):
    with pytest.raises(BatchpilotError, match="document_hash mismatch"):
        parse_run_document(edited(text, lambda d: d.pop("document_hash")))


def test_a_plan_of_the_previous_format_says_to_plan_again(text):
    old = edited(text, lambda d: d.update(format_version=FORMAT_VERSION - 1))
    with pytest.raises(
        BatchpilotError, match=f"format_version: is {FORMAT_VERSION - 1}, .* reads {FORMAT_VERSION}"
    ):
        parse_run_document(old)
