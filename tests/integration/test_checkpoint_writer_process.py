"""An asynchronous save's files are written by the rank's writer process (train/checkpoint_writer.py): another
process than the trainer, the same one for every save, gone with the trainer, its failures raised by the
trainer's next wait."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from batchpilot.errors import BatchpilotError
from batchpilot.train.checkpoint import Checkpointer
from batchpilot.train.checkpoint_writer import WriterProcess
from helpers import start_async_save


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its parent) counts as gone
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


@pytest.fixture
def handed_to_process(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of each `WriterProcess.write`: a save handed to the writer process."""
    calls: list[dict] = []
    write = WriterProcess.write

    def counted(self, **kwargs):
        calls.append(kwargs)
        return write(self, **kwargs)

    monkeypatch.setattr(WriterProcess, "write", counted)
    return calls


def test_an_asynchronous_save_is_written_by_another_process_the_same_for_every_save(tmp_path):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    weights = torch.arange(12.0).reshape(3, 4)
    start_async_save(checkpointer, 1, weights, side=False)
    checkpointer.wait()
    writer = checkpointer._writer
    assert writer is not None and writer.pid is not None and writer.pid != os.getpid() and alive(writer.pid)
    first_pid = writer.pid
    start_async_save(checkpointer, 2, weights * 2, side=False)
    checkpointer.wait()
    assert writer.pid == first_pid
    loaded = Checkpointer(uri=f"file://{tmp_path}").load()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.full_state()["model"]["w"], weights * 2)
    checkpointer.close()
    deadline = time.monotonic() + 10
    while alive(first_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(first_pid), "close() left the writer process running"


def test_a_launchs_last_save_starts_no_writer_process_and_a_running_one_still_writes_it(
    tmp_path, handed_to_process
):
    """The launch's last save, with no writer process yet, is written by the background thread (no process is
    started for a write no step competes with); once a process runs, it writes every save, the last too."""
    by_process = handed_to_process
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=3)
    weights = torch.arange(6.0)
    start_async_save(checkpointer, 1, weights, last=True)
    checkpointer.wait()
    assert (
        checkpointer._writer is not None
        and checkpointer._writer.pid is None
        and [call["folder"] for call in by_process] == []
    )
    start_async_save(checkpointer, 2, weights * 2)
    checkpointer.wait()
    first_pid = checkpointer._writer.pid
    assert (
        first_pid is not None
        and alive(first_pid)
        and [call["folder"] for call in by_process] == ["000000002"]
    )
    start_async_save(checkpointer, 3, weights * 3, last=True)
    checkpointer.wait()
    assert checkpointer._writer.pid == first_pid and [call["folder"] for call in by_process] == [
        "000000002",
        "000000003",
    ]
    for step in (1, 2, 3):  # each committed, whoever wrote it
        loaded = Checkpointer(uri=f"file://{tmp_path}").load(step=step)
        assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], weights * step)
    checkpointer.close()


def test_a_write_that_fails_in_the_writer_process_fails_the_next_wait_and_latest_stays(tmp_path):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    start_async_save(checkpointer, 1, torch.ones(4))
    checkpointer.wait()
    (tmp_path / "000000002").write_text("a file where the step's folder goes")
    start_async_save(checkpointer, 2, torch.zeros(4))
    with pytest.raises(BatchpilotError, match=r"checkpoint of step 2 failed in the background"):
        checkpointer.wait()
    assert Checkpointer(uri=f"file://{tmp_path}").latest_step() == 1
    checkpointer.close()


def test_the_writer_process_ends_when_its_trainer_is_killed_mid_write(tmp_path):
    """kill -9 of the trainer while its writer process writes a 400 MB checkpoint: the writer is gone within
    seconds (it must not write on into a step folder the resumed run writes again), `latest` on the step before."""
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
        checkpointer = Checkpointer(uri="file://{tmp_path}")
        def save(step, weights):
            checkpointer.start_save_sharded(step=step, consumed_samples=step, rng=capture_rng_state(),
                state={{"model": {{"w": weights}}, "optimizer": {{"state": {{}}, "param_groups": []}}}})
        save(1, torch.ones(4))
        checkpointer.wait()
        save(2, torch.randn(100_000_000))
        while not (checkpointer.writing and checkpointer._writer.pid):
            time.sleep(0.01)
        print(checkpointer._writer.pid, flush=True)
        time.sleep(120)
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), f"the script printed {line!r}"
        writer_pid = int(line)
        time.sleep(0.3)  # into the write
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while alive(writer_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(writer_pid), "the writer process outlived its trainer"
    finally:
        trainer.kill()
    assert Checkpointer(uri=f"file://{tmp_path}").latest_step() == 1


def test_a_long_temporary_folder_does_not_stop_the_handover(tmp_path):
    """The staged tensors' shared memory reaches the writer through a Unix socket in multiprocessing's temporary
    folder, whose path must stay under 108 bytes: under a pod's long private TMPDIR the save still commits."""
    long_tmp = tmp_path / ("t" * 60) / ("m" * 60)
    long_tmp.mkdir(parents=True)
    script = textwrap.dedent(
        f"""
        import torch
        from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
        checkpointer = Checkpointer(uri="file://{tmp_path}/ckpt", save_timeout_s=60)
        checkpointer.start_save_sharded(step=1, consumed_samples=1, rng=capture_rng_state(),
            state={{"model": {{"w": torch.arange(8.0)}}, "optimizer": {{"state": {{}}, "param_groups": []}}}})
        checkpointer.close()
        """
    )
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], torch.arange(8.0))


def test_a_sigterm_to_the_trainers_process_group_while_its_writer_starts_does_not_lose_the_save(tmp_path):
    """A preemption's SIGTERM goes to the trainer's whole process group, and the trainer then saves. A writer
    process still starting (importing torch, not yet in its own session) dies of it: it is started again and
    the save commits."""
    script = textwrap.dedent(
        f"""
        import logging, os, signal, sys, time, torch
        from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        os.setpgrp()  # a group of its own, as a pod's or torchrun's
        signal.signal(signal.SIGTERM, lambda *_: print("trainer: SIGTERM", flush=True))
        checkpointer = Checkpointer(uri="file://{tmp_path}/ckpt", save_timeout_s=60)
        checkpointer.start_save_sharded(step=1, consumed_samples=1, rng=capture_rng_state(),
            state={{"model": {{"w": torch.arange(8.0)}}, "optimizer": {{"state": {{}}, "param_groups": []}}}})
        while checkpointer._writer.pid is None:
            time.sleep(0.001)
        first = checkpointer._writer.pid
        os.killpg(0, signal.SIGTERM)
        checkpointer.wait()
        print("writers", first, checkpointer._writer.pid, flush=True)
        checkpointer.close()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "trainer: SIGTERM" in result.stdout
    assert "ended by signal 15 as it started; starting it again" in result.stdout
    first, second = result.stdout.split("writers ")[1].split()[:2]
    assert first != second
    loaded = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], torch.arange(8.0))


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (/proc/PID/stat's 10th field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_the_writer_serializes_a_shard_straight_into_its_file_without_a_copy_in_memory(tmp_path):
    """The writer process streams DCP's serialized tensors into the local file (checksummed on the way); a copy
    of the 40 MB shard in the writer's memory would fault in a page for every 4 KiB of it at every save (the
    staged tensors' shared memory is mapped 16 pages per fault)."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    weights = torch.randn(10_000_000)
    pages = weights.numel() * 4 // 4096
    start_async_save(checkpointer, 1, weights, side=False)
    checkpointer.wait()
    before = minor_faults(checkpointer._writer.pid)
    start_async_save(checkpointer, 2, weights * 2, side=False)
    checkpointer.wait()
    faults = minor_faults(checkpointer._writer.pid) - before
    checkpointer.close()
    assert faults < pages // 10, f"{faults} page faults writing {pages} staged pages"
    loaded = Checkpointer(uri=f"file://{tmp_path}").load()
    assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], weights * 2)


@pytest.mark.skipif(
    not Path("/proc/sys/kernel/sched_autogroup_enabled").exists()
    or Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1"
    or Path("/proc/self/autogroup").read_text().split()[-1:] != ["0"],
    reason="the kernel groups no sessions for scheduling here (no autogroup), or this test runs reniced",
)
def test_the_writer_runs_at_lower_priority_than_the_trainer_also_across_session_groups(tmp_path):
    """The writer's own session is a scheduling group of its own under Linux's autogroup, where a process's nice
    value ranks it only within its group: the group's nice is lowered too, or the writer takes as much CPU as
    the whole trainer."""
    from batchpilot.train.checkpoint_writer import NICE

    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    start_async_save(checkpointer, 1, torch.ones(4), side=False)
    checkpointer.wait()
    pid = checkpointer._writer.pid
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + NICE
        assert Path(f"/proc/{pid}/autogroup").read_text().split()[-1] == str(NICE)
    finally:
        checkpointer.close()


def tensor_record_crcs(folder: Path) -> list[int]:
    """The CRC-32s that each tensor's torch.save record in a step folder's DCP files keeps in its zip."""
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    crcs = []
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            data = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
            crcs += [entry.CRC for entry in zipfile.ZipFile(io.BytesIO(data)).infolist()]
    return crcs


def test_checkpoint_files_leave_out_torch_saves_own_crc32_which_the_block_checksums_cover(tmp_path):
    """A tensor's torch.save record skips the zip's CRC-32 (meta.json's 4 MiB-block CRC-32s cover every byte and
    are checked on read), written by the trainer's thread (the launch's last save, here) or by the writer
    process, and both read back."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    weights = torch.randn(1000)
    start_async_save(checkpointer, 1, weights, last=True)  # no writer process yet: the thread writes it
    checkpointer.wait()
    start_async_save(checkpointer, 2, weights * 2, side=False)  # the writer process
    checkpointer.wait()
    assert checkpointer._writer.pid is not None
    checkpointer.close()
    by_thread, by_process = (
        tensor_record_crcs(tmp_path / "000000001"),
        tensor_record_crcs(tmp_path / "000000002"),
    )
    assert by_thread and not any(by_thread), by_thread
    assert by_process and not any(by_process), by_process
    for step in (1, 2):
        loaded = Checkpointer(uri=f"file://{tmp_path}").load(step=step)
        assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], weights * step)


def test_a_writer_started_ahead_serves_the_first_save_and_ends_at_close(tmp_path, handed_to_process):
    """`start_writer` (a launch that saves before its end) starts the process in the background at once; the
    first save, even the launch's last, is written by that process, and close() ends it. A Checkpointer
    given a storage object writes in-process and starts none."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=2)
    checkpointer.start_writer()
    writer = checkpointer._writer
    assert writer is not None and writer._starting is not None  # under way before any save
    pid = writer.pid  # waits for the start
    assert pid is not None and pid != os.getpid() and alive(pid)
    checkpointer.start_writer()  # once only
    assert writer.pid == pid
    weights = torch.arange(8.0)
    start_async_save(checkpointer, 1, weights, last=True)
    checkpointer.wait()
    assert [call["folder"] for call in handed_to_process] == ["000000001"] and writer.pid == pid
    checkpointer.close()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "close() left the writer process running"
    loaded = Checkpointer(uri=f"file://{tmp_path}").load()
    assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], weights)

    from batchpilot.storage import open_storage

    in_process = Checkpointer(
        uri=f"file://{tmp_path}/other", storage=open_storage(f"file://{tmp_path}/other")
    )
    in_process.start_writer()
    assert in_process._writer is None
    in_process.close()


def test_a_save_is_spread_over_half_the_time_since_the_previous_and_a_wait_hurries_it(
    tmp_path, handed_to_process
):
    """The second save's writing is spread over half the time since the first started (`Pace`: its bytes at
    an even rate), so the steps beside it share its cost; a wait (the next save, a preemption, the launch's
    end) ends the spreading; the launch's last save and the first are written at full speed."""
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", keep_last=4)
    checkpointer.start_writer()
    weights = torch.randn(10_000_000)  # 40 MB
    before_first = time.monotonic()
    start_async_save(checkpointer, 1, weights, side=False)
    checkpointer.wait()
    time.sleep(4.0)  # "steps" until the next save
    start_async_save(checkpointer, 2, weights * 2, side=False)
    started = time.monotonic()
    interval_s = started - before_first  # at least the time between the two saves' starts
    while checkpointer.writing:  # nobody waits: spread over about 2 s
        time.sleep(0.02)
    spread_took_s = time.monotonic() - started
    checkpointer.wait()
    time.sleep(4.0)
    start_async_save(checkpointer, 3, weights * 3, side=False)
    started = time.monotonic()
    checkpointer.wait()  # waited for at once: at full speed
    hurried_took_s = time.monotonic() - started
    start_async_save(checkpointer, 4, weights * 4, side=False, last=True)
    checkpointer.wait()
    checkpointer.close()
    spreads = [call["spread_s"] for call in handed_to_process]
    assert spreads[0] == 0.0 and spreads[3] == 0.0  # the first (no interval yet) and the launch's last
    assert 2.0 <= spreads[1] <= 0.5 * interval_s and spreads[2] >= 2.0  # half the time between the starts
    assert spread_took_s >= 0.8 * spreads[1], (spread_took_s, spreads)
    assert hurried_took_s < 0.5 * spreads[2], (hurried_took_s, spreads)
    for step in (2, 3, 4):
        loaded = Checkpointer(uri=f"file://{tmp_path}").load(step=step)
        assert loaded is not None and torch.equal(loaded.full_state()["model"]["w"], weights * step)
