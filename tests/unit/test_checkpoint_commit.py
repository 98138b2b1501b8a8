"""The commit path of a checkpoint, one rule per test: meta.json before `latest`, `latest` guarded by its
generation against a second checkpointer, a lost response of the `latest` write, pruning that counts only
complete checkpoints, and rng.pt checked against its checksum.

Each test breaks when its rule is removed from train/checkpoint.py by one line (see the test's docstring)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage, PreconditionFailed, open_storage
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state


class HookedStorage(LocalStorage):
    """A local storage that calls `hooks[(operation, name)]` around one operation (tests only)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.before: dict[tuple[str, str], Callable[[], None]] = {}
        self.after: dict[tuple[str, str], Callable[[], None]] = {}

    def _around(self, operation: str, name: str, call: Callable[[], object]) -> object:
        if hook := self.before.pop((operation, name), None):
            hook()
        result = call()
        if hook := self.after.pop((operation, name), None):
            hook()
        return result

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        write = super().write
        return self._around(  # type: ignore[return-value]
            "write", name, lambda: write(name, data, if_generation_match=if_generation_match)
        )

    def stat(self, name: str):  # type: ignore[no-untyped-def]
        stat = super().stat
        return self._around("stat", name, lambda: stat(name))


class Crash(Exception):
    """Stands in for the process dying at this point."""


def raise_crash() -> None:
    raise Crash


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "optimizer": {"state": {}, "param_groups": []}}


def save(checkpointer: Checkpointer, step: int) -> str:
    return checkpointer.save_sharded(
        step=step, consumed_samples=step * 16, state=state(float(step)), rng=capture_rng_state()
    )  # type: ignore[return-value]


def weights(checkpointer: Checkpointer, step: int | None = None) -> torch.Tensor:
    checkpoint = checkpointer.load(step)
    assert checkpoint is not None
    return checkpoint.full_state()["model"]["w"]


def step_folders(root: Path) -> list[str]:
    return sorted({name.split("/")[0] for name in open_storage(f"file://{root}").list() if "/" in name})


def test_a_crash_while_writing_meta_json_leaves_latest_on_the_previous_checkpoint(tmp_path):
    """Breaks when `latest` is written before meta.json: it would name a step without its meta.json."""
    storage = HookedStorage(tmp_path)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    save(checkpointer, 1)
    storage.before[("write", "000000002/meta.json")] = raise_crash
    with pytest.raises(Crash):
        save(checkpointer, 2)
    reader = Checkpointer(uri=f"file://{tmp_path}")
    assert reader.latest_step() == 1
    assert torch.equal(weights(reader), torch.full((4,), 1.0))


def test_two_checkpointers_racing_on_one_uri_cannot_both_move_latest(tmp_path):
    """Breaks when `latest` is written without its generation precondition (or when the lost-response
    branch swallows every PreconditionFailed): the slower writer would silently move `latest` back."""
    slow_storage = HookedStorage(tmp_path)
    slow = Checkpointer(uri=f"file://{tmp_path}", storage=slow_storage)
    fast = Checkpointer(uri=f"file://{tmp_path}")
    save(slow, 1)
    # The other run commits step 5 after the slow one has read `latest`'s generation, before it writes it.
    slow_storage.after[("stat", "latest")] = lambda: save(fast, 5) and None
    with pytest.raises(PreconditionFailed, match=r"latest: was not written"):
        save(slow, 3)
    assert fast.latest_step() == 5
    assert torch.equal(weights(fast), torch.full((4,), 5.0))


def test_a_lost_response_of_the_latest_write_is_recognised_as_ours(tmp_path):
    """A retried `latest` write whose first attempt landed (the response was lost) fails its precondition;
    the checkpointer reads `latest` back, finds its own step and succeeds. Breaks when that branch re-raises."""
    storage = HookedStorage(tmp_path)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    save(checkpointer, 1)

    def landed_but_answer_lost() -> None:
        raise PreconditionFailed(f"file://{tmp_path}/latest", 1)

    storage.after[("write", "latest")] = landed_but_answer_lost
    assert save(checkpointer, 2) == f"file://{tmp_path}/000000002"
    assert checkpointer.latest_step() == 2


def test_pruning_keeps_the_newest_complete_checkpoints_not_interrupted_folders(tmp_path):
    """An interrupted save leaves a step folder without meta.json; it must not count as one of the kept
    checkpoints. Breaks when pruning counts every step folder: step 2 would be deleted and step 3's
    unusable folder kept."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    save(checkpointer, 1)
    save(checkpointer, 2)
    storage = open_storage(f"file://{tmp_path}")
    storage.write("000000003/__0_0.distcp", b"half of a checkpoint")  # a save killed before its meta.json
    save(checkpointer, 4)
    assert step_folders(tmp_path) == ["000000002", "000000004"]
    assert torch.equal(weights(checkpointer, 2), torch.full((4,), 2.0))


def test_a_replaced_rng_state_is_refused_by_its_checksum(tmp_path):
    """rng.pt that still unpickles but is not the one meta.json recorded. Breaks when rng.pt is loaded
    without checking its SHA-256 (the run would resume with another random stream)."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    save(checkpointer, 1)
    torch.manual_seed(12345)
    other = io.BytesIO()
    torch.save(capture_rng_state(), other)
    (tmp_path / "000000001" / "rng.pt").write_bytes(other.getvalue())
    with pytest.raises(BatchpilotError, match=r"000000001/rng\.pt: is corrupted \(checksum mismatch\)"):
        checkpointer.load()
