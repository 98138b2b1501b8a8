"""What a plan takes from explore.json, and what it says when explore.json cannot be checked."""

from __future__ import annotations

import pytest

from batchpilot.config import explore_fingerprint, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.planner import make_run_document
from helpers import gke_a3_config

NOT_COMPARED = "explore.json records no fingerprint"


@pytest.fixture
def config():
    raw = gke_a3_config()
    raw["batch"]["micro_batch_size"] = "explore"
    return parse_config(raw)


def explore(**extra) -> dict:
    return {"recommendation": {"micro_batch_size": 2, "samples_per_s": 50.0}, **extra}


def test_an_explore_json_of_this_config_is_taken_without_a_note(config):
    document = make_run_document(config, explore=explore(fingerprint=explore_fingerprint(config)))
    assert (document.micro_batch_source, document.plan.micro_batch_size) == ("explore", 2)
    assert not [note for note in document.notes if NOT_COMPARED in note]


def test_an_explore_json_without_a_fingerprint_is_taken_with_a_note_saying_it_was_not_compared(config):
    document = make_run_document(config, explore=explore())
    assert document.plan.micro_batch_size == 2
    assert [note for note in document.notes if NOT_COMPARED in note] == [
        "explore.json records no fingerprint (written before explore recorded one), so it was not compared with "
        "this config's model, data.seq_len, devices and parallelism"
    ]


def test_every_difference_is_named_on_one_line(config):
    fingerprint = explore_fingerprint(config) | {"train.parallelism": "ddp", "cluster.accelerator_type": None}
    fingerprint["model.args"] = fingerprint["model.args"] | {"n_embd": 64}
    with pytest.raises(BatchpilotError) as info:
        make_run_document(config, explore=explore(fingerprint=fingerprint))
    assert str(info.value) == (
        "--explore: was measured for another model or setting than this config's: model.args.n_embd 64 there, "
        "32 here; cluster.accelerator_type None there, 'nvidia-h100-80gb' here; train.parallelism 'ddp' there, "
        "'auto' here (fix: run `batchpilot explore` with this config, or plan with the config explore measured)"
    )
