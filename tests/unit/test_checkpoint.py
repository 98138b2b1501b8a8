"""Checkpoints: round trip, pruning, checksums, and a write interrupted by SIGKILL never becomes latest."""

import subprocess
import sys
import textwrap

import pytest
import torch

from batchpilot.errors import BatchpilotError
from batchpilot.runstate import METRIC_KEYS, METRICS_OBJECT, MetricsLog, load_metrics, read_metrics
from batchpilot.storage import PreconditionFailed, open_storage
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state


def state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "optimizer": {"state": {}, "param_groups": []}}


def step_folders(root) -> list[str]:
    return sorted({name.split("/")[0] for name in open_storage(f"file://{root}").list() if "/" in name})


def save(checkpointer: Checkpointer, step: int) -> str:
    return checkpointer.save(
        step=step,
        consumed_samples=step * 16,
        model=state(step)["model"],
        optimizer=state(step)["optimizer"],
        rng=capture_rng_state(),
    )


def test_round_trip_and_keep_last(tmp_path):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    assert checkpointer.load() is None
    for step in (1, 2, 3):
        save(checkpointer, step)
    loaded = checkpointer.load()
    assert loaded.step == 3 and loaded.consumed_samples == 48
    assert torch.equal(loaded.model["w"], torch.full((3,), 3.0))
    assert step_folders(tmp_path) == ["000000002", "000000003"]
    torch.set_rng_state(loaded.rng["torch"])  # the saved RNG state is usable


def test_corrupted_file_is_detected(tmp_path):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    save(checkpointer, 1)
    model_file = tmp_path / "000000001" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-3] + b"xyz")
    with pytest.raises(BatchpilotError, match=r"000000001/model\.pt: is corrupted"):
        checkpointer.load()


def test_a_second_writer_cannot_silently_move_latest(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    first = Checkpointer(uri=f"file://{tmp_path}", storage=storage)
    save(first, 1)
    generation = storage.stat("latest").generation
    save(first, 2)  # moves latest: the generation `generation` is gone
    with pytest.raises(PreconditionFailed):
        storage.write("latest", b"000000001\n", if_generation_match=generation)
    assert first.latest_step() == 2


def test_interrupted_write_never_becomes_latest(tmp_path):
    """A process killed with SIGKILL between the objects of step 2 leaves latest at step 1."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from batchpilot.storage import LocalStorage
        from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
        from pathlib import Path

        storage = LocalStorage(Path({str(tmp_path)!r}))
        checkpointer = Checkpointer(uri="file://{tmp_path}", storage=storage)
        weights = {{"w": torch.ones(1000)}}
        checkpointer.save(step=1, consumed_samples=16, model=weights, optimizer={{}}, rng=capture_rng_state())
        write = storage.write
        def dying_write(name, data, **kwargs):
            generation = write(name, data, **kwargs)
            if name == "000000002/optimizer.pt":
                os.kill(os.getpid(), signal.SIGKILL)
            return generation
        storage.write = dying_write
        checkpointer.save(step=2, consumed_samples=32, model=weights, optimizer={{}}, rng=capture_rng_state())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert (tmp_path / "000000002" / "model.pt").exists()  # the interrupted checkpoint's objects are there
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=1)
    assert checkpointer.latest_step() == 1
    assert checkpointer.load().consumed_samples == 16
    save(checkpointer, 3)  # the next successful save removes the interrupted folder
    assert step_folders(tmp_path) == ["000000003"]


def metrics_record(step: int) -> dict:
    return {**dict.fromkeys(METRIC_KEYS, 0.0), "step": step, "consumed_samples": step * 16}


def test_metrics_beside_the_checkpoints_are_read_back_and_truncated_on_resume(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    assert load_metrics(uri) == []  # before the first checkpoint
    log = MetricsLog(tmp_path / "out" / "metrics.jsonl")
    for step in (1, 2, 3):
        log.append(metrics_record(step))
    open_storage(uri).write(METRICS_OBJECT, log.text().encode() + b"\n")  # a blank line is no record
    assert [r["step"] for r in load_metrics(uri)] == [1, 2, 3]
    log.truncate_to(32)  # a resume from the checkpoint at step 2
    assert read_metrics(log.path) == [metrics_record(1), metrics_record(2)]
    assert sorted(p.name for p in log.path.parent.iterdir()) == ["metrics.jsonl"]  # no temporary left
