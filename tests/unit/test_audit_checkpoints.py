"""Checkpoints kept and waited for (`train.checkpoint`, `train.loop`), the rules a one-line slip would break
unseen:

- pruning after a commit never deletes a step above the one just committed (`latest`): a later step's
  folder, complete or not, stays; below it, the newest `keep_last` complete checkpoints stay;
- the training loop waits for the last background save before it returns: a last save that fails is the
  loop's failure, not an exit 0 with `latest` on an older step;
- `run_loop` closes the checkpointer also when training failed: the save in flight is committed before the
  error propagates, and the loaders are closed.

The checkpointer is the real one on local storage (tiny states); the loop is a `TrainingLoop` at the end of
its last stage whose model, data and runtime are stand-ins (the end-of-run path touches none of them).
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from batchpilot import runstate
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.stages import build_plan
from batchpilot.storage import LocalStorage, StorageError
from batchpilot.train.checkpoint import DELAY_ENV, Checkpointer, capture_rng_state
from batchpilot.train.loop import TrainingLoop, run_loop
from helpers import tiny_config


def save_full(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(
        step=step, consumed_samples=16 * step, model={"w": torch.full((4,), float(step))}, optimizer={},
        rng=capture_rng_state(),
    )  # fmt: skip


def test_pruning_never_deletes_a_step_above_latest(tmp_path: Path):
    storage = LocalStorage(tmp_path)
    earlier = Checkpointer(uri=f"file://{tmp_path}", keep_last=5)
    for step in (1, 2, 9):
        save_full(earlier, step)
    storage.write(f"{runstate.step_folder(12)}/__0_0.distcp", b"a save that never committed")
    runstate.move_latest(storage, 2)  # the run went back to step 2 (steps 9 and 12 are above it)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    save_full(checkpointer, 3)
    assert checkpointer.latest_step() == 3
    # At or below 3: the newest two complete ones (2, 3) stay and 1 goes; above 3 nothing is touched.
    assert runstate.step_numbers(storage) == [2, 3, 9, 12]
    assert runstate.committed_steps(storage) == [2, 3, 9]


class FailingStorage(LocalStorage):
    """Local storage whose writes of names ending in `fail_suffix` fail (a storage outage)."""

    fail_suffix: str | None = None

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.fail_suffix is not None and name.endswith(self.fail_suffix):
            raise StorageError(f"{self.uri}/{name}", "request failed: 503 injected")
        return super().write(name, data, if_generation_match=if_generation_match)


def start_save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.start_save_sharded(
        step=step, consumed_samples=16 * step, rng=capture_rng_state(),
        state={"model": {"w": torch.full((10,), float(step))}, "optimizer": {"state": {}, "param_groups": []}},
    )  # fmt: skip


def loop_at_its_end(checkpointer: Checkpointer) -> TrainingLoop:
    """A TrainingLoop whose samples are all consumed: `run()` only ends the run."""
    config = parse_config(tiny_config(data_uri="file:///data", checkpoint_uri=checkpointer.uri))
    plan = build_plan(config, micro_batch_size=16)
    stages = list(plan.stages)
    stand_in: Any = None  # the model, data, LR schedule and metrics: not touched at the end of the run
    return TrainingLoop(
        runtime=SimpleNamespace(place=SimpleNamespace(is_main=True, world_size=1)),  # type: ignore[arg-type]
        config=config, plan=plan, stages=stages, model=stand_in, optimizer=stand_in, loader=stand_in,
        checkpointer=checkpointer, metrics=None, lr=stand_in, consumed=stages[-1].end_sample, step=7,
        audit_dir=None,
    )  # fmt: skip


def checkpoint_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")]


def test_the_loop_waits_for_its_last_save_and_returns_when_it_committed(tmp_path: Path, batchpilot_log):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    start_save(checkpointer, 7)
    assert loop_at_its_end(checkpointer).run() == 0
    assert checkpointer.latest_step() == 7 and checkpointer.save_in_flight is None
    assert any(r.getMessage().startswith("checkpoint step 7 committed") for r in batchpilot_log.records)


def test_a_last_save_that_fails_fails_the_loop(tmp_path: Path):
    storage = FailingStorage(tmp_path)
    storage.fail_suffix = "/meta.json"
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    start_save(checkpointer, 7)
    loop = loop_at_its_end(checkpointer)
    with pytest.raises(BatchpilotError, match="the checkpoint of step 7 failed in the background"):
        run_loop(loop, closing=[])
    assert checkpointer.latest_step() is None


def test_a_failed_loop_commits_the_save_in_flight_and_closes_the_loaders(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.3")  # the save is still being written when training fails
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    closed: list[str] = []

    def fail_after_starting_a_save() -> int:
        start_save(checkpointer, 5)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    failing = SimpleNamespace(run=fail_after_starting_a_save, checkpointer=checkpointer)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_loop(
            failing, closing=[lambda: closed.append("train loader"), lambda: closed.append("eval loader")]
        )  # type: ignore[arg-type]
    assert checkpointer.latest_step() == 5  # committed before the error left run_loop
    assert checkpoint_threads() == []
    assert closed == ["train loader", "eval loader"]
