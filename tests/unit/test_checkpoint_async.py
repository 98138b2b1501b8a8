"""Asynchronous checkpoints on one process: the state is copied when the save starts, `latest` moves only
when the background thread has committed, one save at a time, a failure surfaces at the next wait, a wait is
bounded, and a process killed mid-save leaves `latest` on the previous checkpoint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import batchpilot.train.checkpoint as checkpoint_module
from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage, StorageError
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
from helpers import start_async_save


class GatedStorage(LocalStorage):
    """Local storage whose writes of names ending in `gated_suffix` wait for `gate` (at most 30 s) and can
    be made to fail."""

    def __init__(self, root: Path, gated_suffix: str = "/meta.json") -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gated_suffix = gated_suffix
        self.fail_suffix: str | None = None
        self.order: list[str] = []

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if name.endswith(self.gated_suffix):
            assert self.gate.wait(30), "the test never opened the gate"
        if self.fail_suffix is not None and name.endswith(self.fail_suffix):
            raise StorageError(f"{self.uri}/{name}", "request failed: 503 injected")
        self.order.append(name)
        return super().write(name, data, if_generation_match=if_generation_match)


def saved_weights(root: Path, step: int | None = None) -> torch.Tensor:
    loaded = Checkpointer(uri=f"file://{root}").load(step)
    assert loaded is not None
    return loaded.full_state()["model"]["w"]


def test_the_checkpoint_holds_the_state_of_its_step_not_later_updates(tmp_path, monkeypatch):
    """Training goes on (here: the weights change in place) while the files are written. Breaks when the
    state is not staged (copied) before start_save_sharded returns."""
    real_save = checkpoint_module.dcp.save
    may_write = threading.Event()

    def save_after_training_moved_on(*args, **kwargs):  # holds the background write until then
        assert may_write.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_after_training_moved_on)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    weights = torch.zeros(1000)
    assert start_async_save(checkpointer, 1, weights) == f"file://{tmp_path}/000000001"
    weights.add_(7.0)  # the next optimizer step, while the checkpoint is being written
    may_write.set()
    assert checkpointer.wait() is not None
    assert torch.equal(saved_weights(tmp_path), torch.zeros(1000))
    assert (tmp_path / "metrics.jsonl").read_text() == "step 1\n"


def test_latest_moves_only_after_the_background_commit_and_one_save_at_a_time(tmp_path):
    storage = GatedStorage(tmp_path)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    start_async_save(checkpointer, 1, torch.ones(10))
    assert checkpointer.save_in_flight == 1
    assert checkpointer.latest_step() is None  # files may be written, the commit waits for meta.json
    threading.Timer(0.3, storage.gate.set).start()
    start_async_save(checkpointer, 2, torch.full((10,), 2.0))  # waits for step 1 to commit first
    assert checkpointer.latest_step() == 1 and checkpointer.save_in_flight == 2
    checkpointer.wait()
    assert checkpointer.latest_step() == 2 and checkpointer.save_in_flight is None
    commits = [name for name in storage.order if name.endswith("meta.json") or name == "latest"]
    assert commits == ["000000001/meta.json", "latest", "000000002/meta.json", "latest"]
    assert torch.equal(saved_weights(tmp_path, 1), torch.ones(10))


# DCP's extra writer threads let the injected exception escape (and pytest reports it); that is the point.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_background_upload_fails_the_next_wait_and_latest_stays(tmp_path):
    storage = GatedStorage(tmp_path, gated_suffix="never")
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    start_async_save(checkpointer, 1, torch.ones(10))
    checkpointer.wait()
    storage.fail_suffix = ".distcp"
    start_async_save(
        checkpointer, 2, torch.full((10,), 2.0)
    )  # returns: the failure happens in the background
    with pytest.raises(
        BatchpilotError, match=r"000000002: the checkpoint of step 2 failed in the background"
    ):
        checkpointer.wait()
    assert checkpointer.latest_step() == 1
    assert checkpointer.wait() is None  # reported once; the next save starts clean


def test_a_wait_for_a_stuck_upload_is_bounded(tmp_path):
    storage = GatedStorage(tmp_path)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage, save_timeout_s=0.2)
    start_async_save(checkpointer, 1, torch.ones(10))
    with pytest.raises(BatchpilotError, match=r"still being written after 0.2 s"):
        checkpointer.wait()
    storage.gate.set()


def test_a_process_killed_during_a_background_save_leaves_latest_on_the_previous(tmp_path):
    """SIGKILL while the background thread is writing step 2's files: step 1 stays `latest` and loads; the
    next successful save removes step 2's partial folder."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from pathlib import Path
        from batchpilot.storage import LocalStorage
        from batchpilot.train.checkpoint import Checkpointer, capture_rng_state

        class Dying(LocalStorage):
            def write(self, name, data, **kwargs):
                generation = super().write(name, data, **kwargs)
                if name.startswith("000000002/") and name.endswith(".distcp"):
                    os.kill(os.getpid(), signal.SIGKILL)
                return generation

        checkpointer = Checkpointer(uri="file://{tmp_path}", storage=Dying(Path({str(tmp_path)!r})))
        for step in (1, 2):
            state = {{"model": {{"w": torch.full((1000,), float(step))}}, "optimizer": {{}}}}
            checkpointer.start_save_sharded(step=step, consumed_samples=16 * step, state=state, rng=capture_rng_state())
            checkpointer.wait()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert list((tmp_path / "000000002").glob("*.distcp"))  # the killed save's files are there
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=1)
    assert checkpointer.latest_step() == 1
    assert torch.equal(saved_weights(tmp_path), torch.full((1000,), 1.0))
    start_async_save(checkpointer, 3, torch.full((10,), 3.0))
    checkpointer.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["000000003"]


class WorkerThreadsFail(LocalStorage):
    """Shard writes fail in every thread but `caller` (DCP's extra writer threads); the caller's own write
    is slowed down so that the other threads take the remaining shards."""

    def __init__(self, root: Path, caller: threading.Thread) -> None:
        super().__init__(root)
        self.caller = caller

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if name.endswith(".distcp"):
            if threading.current_thread() is not self.caller:
                raise StorageError(f"{self.uri}/{name}", "request failed: 503 injected")
            time.sleep(0.3)
        return super().write(name, data, if_generation_match=if_generation_match)


# DCP's extra writer threads let the injected exception escape (and pytest reports it); that is the point.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_upload_in_one_of_dcps_writer_threads_fails_the_save(tmp_path):
    """DCP drops the exceptions of its extra writer threads; without the check in StorageWriter the save
    would commit a checkpoint whose metadata lacks those threads' tensors."""
    checkpointer = Checkpointer(
        uri=f"file://{tmp_path}", storage=WorkerThreadsFail(tmp_path, threading.current_thread())
    )
    state = {"model": {f"w{i}": torch.full((100,), float(i)) for i in range(8)}, "optimizer": {}}
    with pytest.raises(StorageError, match=r"__0_\d\.distcp: request failed: 503 injected"):
        checkpointer.save_sharded(step=1, consumed_samples=16, state=state, rng=capture_rng_state())
    assert checkpointer.latest_step() is None


class LingeringDone(threading.Event):
    """A save's `done` event after whose set() the background thread goes on a while (as it does freeing
    the staged copy of a large state)."""

    def set(self) -> None:
        super().set()
        time.sleep(0.5)


def test_a_wait_returns_only_when_the_background_thread_has_ended(tmp_path, monkeypatch):
    """A daemon thread still running (inside torch's C++ code) when the interpreter finalises aborts the
    process (SIGABRT after the stage's last commit). Breaks when wait() returns as soon as the commit is
    signalled, before the thread has ended."""

    @dataclasses.dataclass
    class InFlight(checkpoint_module._InFlight):
        done: threading.Event = dataclasses.field(default_factory=LingeringDone)

    monkeypatch.setattr(checkpoint_module, "_InFlight", InFlight)
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    start_async_save(checkpointer, 1, torch.zeros(10))
    assert checkpointer.wait() is not None
    assert [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")] == []


def test_close_ends_a_failed_save_in_flight_without_raising(tmp_path, caplog):
    """The trainer closes the checkpointer also when training failed: the failure that ended training is the
    one raised, the background save's own failure is logged, and no thread outlives the close."""
    storage = GatedStorage(tmp_path)
    storage.fail_suffix = "/meta.json"
    storage.gate.set()
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    start_async_save(checkpointer, 1, torch.zeros(10))
    checkpointer.close()
    assert "the checkpoint of step 1 failed in the background" in caplog.text
    assert checkpointer.save_in_flight is None
    assert [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")] == []


def test_a_launch_starts_its_writer_ahead_only_when_it_saves_before_its_last_step():
    """The trainer starts the writer process at a launch's start-up (`Checkpointer.start_writer`) only where
    a save will come before the last step: a stage end inside the launch, or `checkpoint_every_steps` with
    more steps than that left; a launch that saves only at its end starts none (its last save needs none)."""
    from batchpilot.config import parse_config
    from batchpilot.plan.stages import build_plan
    from batchpilot.train.trainer import saves_before_its_end
    from helpers import tiny_config

    plan = build_plan(
        parse_config(tiny_config(data_uri="file:///d", checkpoint_uri="file:///c")), micro_batch_size=8
    )
    first, second, final = plan.stages
    assert saves_before_its_end([second, final], consumed=second.start_sample, every_steps=0)
    # resumed in the launch's last stage: only the launch's own end is left
    assert not saves_before_its_end([second, final], consumed=final.start_sample, every_steps=0)
    assert not saves_before_its_end([first], consumed=0, every_steps=0)
    steps = first.num_steps
    assert saves_before_its_end([first], consumed=0, every_steps=steps - 1)
    assert not saves_before_its_end([first], consumed=0, every_steps=steps)
    halfway = first.start_sample + (steps // 2) * first.global_batch_size
    assert not saves_before_its_end([first], consumed=halfway, every_steps=steps - steps // 2)
    assert saves_before_its_end([first], consumed=halfway, every_steps=steps - steps // 2 - 1)
