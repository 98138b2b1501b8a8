"""Issue #37: explore does not go through the Kueue queue yet; a plan says so instead of bypassing it silently."""

from __future__ import annotations

import json

from helpers import gke_a3_config, write_plan

NOTE = (
    "cluster.kueue_queue: the explore task's pod takes one GPU of cluster.node_pool outside LocalQueue team-a"
)


def run_notes(tmp_path, **changes) -> list[str]:
    config = gke_a3_config(kueue_queue="team-a")
    for section, values in changes.items():
        config.setdefault(section, {}).update(values)
    return json.loads(open(write_plan(tmp_path, config)).read())["run_notes"]


def test_a_queued_run_that_explores_says_the_explore_task_runs_outside_the_queue(tmp_path):
    # An integer micro batch, but the noise-scale study (on by default) is an explore task too.
    assert any(note.startswith(NOTE) for note in run_notes(tmp_path, explore={"study": True}))


def test_a_queued_run_without_explore_says_nothing_of_it(tmp_path):
    notes = run_notes(tmp_path, explore={"study": False})
    assert not any("explore task" in note for note in notes), notes
