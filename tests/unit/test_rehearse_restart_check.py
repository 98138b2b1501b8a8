"""The rehearsal's restart check (`saved_before`): after a trainer pod is deleted, the restart must resume
from the last save of the attempt it replaced. Saves after the resume point are the restarted trainers' own
unless their meta says a trainer that started earlier wrote them."""

from __future__ import annotations

from batchpilot.rehearse.cluster import saved_before
from batchpilot.runstate import move_latest, write_meta
from batchpilot.storage import open_storage


def commit(uri: str, step: int, **meta: object) -> None:
    storage = open_storage(uri)
    write_meta(storage, step, {"step": step, **meta})
    move_latest(storage, step)


def test_saves_of_the_restarted_trainer_after_its_resume_point_are_its_own(tmp_path):
    uri = f"file://{tmp_path}"
    commit(uri, 19, resumed_from_step=None)
    commit(uri, 40, resumed_from_step=None)  # the deleted attempt's SIGTERM save
    commit(uri, 60, resumed_from_step=40)  # the restart's own, saved before the rehearsal looked
    assert saved_before(uri, after_step=40) == []


def test_a_restart_that_skipped_its_predecessors_last_save_is_found(tmp_path):
    uri = f"file://{tmp_path}"
    commit(uri, 19, resumed_from_step=None)
    commit(uri, 40, resumed_from_step=None)
    commit(uri, 60, resumed_from_step=19)  # a restart that resumed from 19 while 40 was committed
    assert saved_before(uri, after_step=19) == [40]
    commit(uri, 80, resumed_from_step=5)  # a trainer that started earlier still
    assert saved_before(uri, after_step=19) == [40, 80]


def test_a_save_whose_meta_predates_the_field_says_nothing(tmp_path):
    """An image older than the command writes no `resumed_from_step`: the check cannot attribute it."""
    uri = f"file://{tmp_path}"
    commit(uri, 19)
    commit(uri, 40)
    assert saved_before(uri, after_step=19) == []


def test_the_resume_point_is_read_from_the_restarted_trainers_saves(tmp_path):
    """When the restarted pods are gone before the rehearsal reads their logs (the stage's rest ended between
    two polls), their saves still say where they started."""
    from batchpilot.rehearse.cluster import resumed_from

    uri = f"file://{tmp_path}"
    commit(uri, 19, resumed_from_step=None)
    commit(uri, 40, resumed_from_step=None)
    assert resumed_from(uri) is None  # only the first attempt's saves so far
    commit(uri, 60, resumed_from_step=40)
    commit(uri, 80, resumed_from_step=60)  # a second restart's
    assert resumed_from(uri) == 40
