"""A checkpoint's files written by another process, so that writing them does not slow the training steps.

An asynchronous save (train/checkpoint.py) stages the state into shared memory (one host copy per rank, its
buffers reused from save to save), then its background thread runs DCP's save as before: the plan, the
collectives, the commit. Only the bytes move here: `ProcessStorageWriter.write_data` resolves each item of the
rank's plan to its staged tensor (a view of shared memory: nothing is copied to send it) and hands the lot to
this rank's writer process, which serializes, checksums and writes the files through the storage layer and
returns DCP's write results and the files' checksums. The thread only waits meanwhile, without the GIL.

A Python thread that wrote the files itself held the GIL for much of the serialization and hashing, and the
steps ran about 2x slower while a save was written (bench/checkpoint_blocking.py); a process runs beside them.
The process runs at a lower priority (`NICE`), so the trainer's own threads (the data prefetch, the launch of
device work) come first where cores are short; it is started with the first asynchronous save that steps
train beside (spawned: no copy of the trainer's threads or devices; a launch's last save, which no step
competes with, is written by the trainer's background thread unless the process already runs), serves every
later one, and ends with the trainer: at `close()`,
or by itself within a second when the trainer dies (kill -9 included), so it never writes into a step folder
that a resumed run writes again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from batchpilot.errors import BatchpilotError
from batchpilot.storage import join_uri, open_storage
from batchpilot.storage.local import reserve_direct_buffers
from batchpilot.train.dcp_storage import StorageWriter

logger = logging.getLogger(__name__)

NICE = 10
"""How much lower the writer's CPU priority is than the trainer's (Linux `nice` increment)."""
PACE_POLL_S = 0.05
"""How often a spread write looks whether the trainer now waits for it."""
START_TIMEOUT_S = 120.0
"""How long the writer process may take to start (a spawned Python imports torch first)."""


class _Resolved(SavePlanner):
    """A planner in the writer process that only answers `resolve_data`, from the items the trainer resolved."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self._data = data

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self._data[write_item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else value

    # The writer process takes part in no planning: DCP's plan was made in the trainer.
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise NotImplementedError


class Pace:
    """Spreads one save's writing over `spread_s` (its bytes at an even rate, across its writer threads), until
    `hurry` is set: then at full speed. Where every core trains, writing a checkpoint costs the steps beside
    it about the same step time per byte even at the writer's low priority (905 MB about 0.6 s of 2-thread
    steps on a 2-vCPU VM, bench/README.md: the memory and I/O the machine shares); spread over more steps,
    each of them is slowed less."""

    def __init__(self, *, total_bytes: int, spread_s: float, hurry: Any) -> None:
        self._rate = total_bytes / spread_s if spread_s > 0 and total_bytes > 0 else None
        self._hurry = hurry
        self._start = time.monotonic()
        self._done = 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        if self._rate is None:
            return
        with self._lock:
            self._done += nbytes
            due = self._start + self._done / self._rate
        while (left := due - time.monotonic()) > 0 and not self._hurry.is_set():
            self._hurry.wait(min(left, PACE_POLL_S))


def _serve(connection: Any, hurry: Any) -> None:
    """The writer process: one request per save, `(uri, folder, thread_count, plan, data, spread_s)`; answers
    `("ok", results, written)` or `("error", what went wrong)`; `None` ends it. `hurry` (an Event the trainer
    sets when it waits for the save) ends the spreading of a save's writing over `spread_s` (`Pace`)."""
    # Its own session: the signals a pod or torchrun sends to the trainer's process group (SIGTERM at a
    # preemption, after which the trainer still saves) or a terminal's Ctrl-C do not end a write; the trainer
    # ends it (close(), or terminate() when the interpreter exits), or its death does (below).
    os.setsid()
    _lower_priority()
    connection.send(READY)  # out of the trainer's group now: a signal to the group no longer ends it
    parent = mp.parent_process()

    def end_with_the_trainer() -> None:
        if parent is not None:
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(1)  # the trainer is gone: write nothing more into a folder a resumed run may write again

    threading.Thread(target=end_with_the_trainer, daemon=True).start()
    storages: dict[str, Any] = {}
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the trainer ended without close(): nothing more to write
            return
        if request is None:
            return
        uri, folder, thread_count, plan, data, spread_s = request
        try:
            storage = storages.get(uri) or storages.setdefault(uri, open_storage(uri))
            reserve_direct_buffers(thread_count)  # its threads' local files: none made at a later save
            total = sum(
                value.nbytes if isinstance(value, torch.Tensor) else len(value) for value in data.values()
            )
            pace = Pace(total_bytes=total, spread_s=spread_s, hurry=hurry)
            writer = StorageWriter(storage, folder, thread_count=thread_count, stream_writes=True, pace=pace)
            results = writer.write_data(plan, _Resolved(data)).value()
            answer: tuple[Any, ...] = ("ok", results, dict(writer.storage_fs.written))
        except (
            BaseException
        ) as error:  # the trainer raises it from its save, in words (not every error pickles)
            answer = ("error", str(error) if isinstance(error, BatchpilotError) else repr(error))
        del data, request
        connection.send(answer)


def _lower_priority() -> None:
    """This process's CPU priority NICE below the trainer's. Where the kernel groups a session's processes
    for scheduling (autogroup: Linux's default for processes in the root CPU cgroup, a VM or a laptop, not a
    container's), a nice value ranks processes only within their group, and this process's new session is
    a group of its own with nice 0: the writer then took as much CPU as the whole trainer (steps 2-5x
    slower while a save was written, bench/checkpoint_blocking.py with every core training). So the group's
    nice value is set too (/proc/self/autogroup; see the Linux manual's sched(7), "The autogroup feature")."""
    os.nice(NICE)
    # no /proc/self/autogroup: a kernel without the feature (a container's cgroup ranks by nice anyway)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
        autogroup.write(str(NICE))


def _short_socket_folder() -> None:
    """Where multiprocessing puts the Unix socket through which the staged tensors' shared memory is passed
    (its temporary folder, under TMPDIR): a socket's path must stay under 108 bytes (AF_UNIX), which a long
    TMPDIR (a pod's private one, say) exceeds, so such a process uses a short folder under /tmp instead."""
    from multiprocessing import process, util

    if len(util.get_temp_dir()) <= SOCKET_FOLDER_MAX:
        return
    short = tempfile.mkdtemp(prefix="batchpilot-mp-", dir="/tmp")
    process.current_process()._config["tempdir"] = short  # type: ignore[attr-defined]  # get_temp_dir()'s
    util.Finalize(None, shutil.rmtree, args=[short], kwargs={"ignore_errors": True}, exitpriority=-100)


READY = "ready"
"""The writer's first message: it has left the trainer's process group."""
START_ATTEMPTS = 3
"""How many times a writer that died before it was ready is started (see `WriterProcess._start`)."""

SOCKET_FOLDER_MAX = 64
"""The longest temporary folder multiprocessing may use for its sockets here (their names add ~30 bytes)."""


class WriterProcess:
    """This rank's writer process (started on first use)."""

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._process: Any = None
        self._connection: Any = None
        self._starting: threading.Thread | None = None
        # set: the trainer waits for the save being written (see `Pace`); cleared as the next save starts
        self._hurry = mp.get_context("spawn").Event()

    def start_soon(self, where: str) -> None:
        """Starts the writer in a thread of this process, so that its start (a spawned Python importing torch:
        about 4 CPU-s) runs beside the launch's start-up rather than beside the steps of its first save. The
        first write waits for it; a start that failed here is tried again there, and raised."""
        if self._process is not None or self._starting is not None:
            return

        def start() -> None:
            try:
                self._start(where)
            except BatchpilotError as error:  # the first write starts it again, and raises what it meets
                logger.warning("%s", error)

        self._starting = threading.Thread(target=start, name="checkpoint-writer-start", daemon=True)
        self._starting.start()

    def _started(self) -> None:
        """Waits for a start under way (`start_soon`), bounded: its own attempts are bounded."""
        if self._starting is not None:
            self._starting.join(START_TIMEOUT_S * START_ATTEMPTS + 30)
            self._starting = None

    @property
    def pid(self) -> int | None:
        """The writer process's id while it runs (or starts: `start_soon`)."""
        return None if self._process is None and self._starting is None else self._started_pid()

    def _started_pid(self) -> int | None:
        self._started()
        return None if self._process is None else self._process.pid

    def _start(self, where: str) -> None:
        """Starts the writer and waits until it is ready (in its own session), bounded by START_TIMEOUT_S.

        Until then it is in the trainer's process group, importing torch for a second or more, and a signal to
        that group ends it: the SIGTERM of a preemption (a pod's, or `kill -TERM -PGID`), after which the
        trainer still saves. A signal mask would not help (multiprocessing's spawn starts a fresh interpreter
        with default dispositions), so a writer that a signal ended before it was ready is started again, up to
        START_ATTEMPTS times; any other early end is raised."""
        _short_socket_folder()
        context = mp.get_context("spawn")
        for attempt in range(1, START_ATTEMPTS + 1):
            self._connection, theirs = context.Pipe()
            self._process = context.Process(
                target=_serve, args=(theirs, self._hurry), name="checkpoint-writer", daemon=True
            )
            self._process.start()
            theirs.close()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._connection.poll(0.2) and self._process.is_alive():
                if time.monotonic() > deadline:
                    self._process.kill()
                    self._process = None
                    raise BatchpilotError(
                        where, f"the checkpoint writer process did not start within {START_TIMEOUT_S:g} s"
                    )
            with contextlib.suppress(EOFError):  # EOF: it ended before it said anything
                if self._connection.poll(0) and self._connection.recv() == READY:
                    return
            self._process.join(5)
            code = self._process.exitcode
            self._connection.close()
            self._process = None
            if code is None or code >= 0 or attempt == START_ATTEMPTS:
                raise BatchpilotError(
                    where, f"the checkpoint writer process ended with exit code {code} as it started"
                )
            logger.info(
                "the checkpoint writer process was ended by signal %d as it started; starting it again", -code
            )

    def hurry(self) -> None:
        """The save being written is waited for: the rest of it is written at full speed (`Pace`)."""
        self._hurry.set()

    def unhurry(self) -> None:
        """A new save starts (the trainer calls it before handing the save to its background thread, so that
        a wait right after it is never undone): it may be spread again."""
        self._hurry.clear()

    def write(
        self,
        *,
        uri: str,
        folder: str,
        thread_count: int,
        plan: SavePlan,
        data: dict[MetadataIndex, Any],
        spread_s: float = 0.0,
    ) -> tuple[list[WriteResult], dict[str, Any]]:
        """Writes the plan's items (`data`: each item's tensor or bytes) into `folder` of `uri`, spread over
        `spread_s` unless `hurry` is called (0: at full speed); returns DCP's write results and the written
        files' checksums. Bounded by the save's timeout. Sending the request (the tensors' shared memory by
        reference) happens here: a failure to send is raised, never lost."""
        where = join_uri(uri, folder)
        self._started()
        if self._process is None:
            self._start(where)
        try:
            self._connection.send((uri, folder, thread_count, plan, data, spread_s))
        except (OSError, EOFError) as error:
            raise BatchpilotError(
                where, f"could not hand the checkpoint to its writer process: {error}"
            ) from None
        deadline = time.monotonic() + self.timeout_s
        while not self._connection.poll(1.0):
            if not self._process.is_alive():
                code = self._process.exitcode
                self._process = None
                raise BatchpilotError(
                    where, f"the checkpoint writer process ended with exit code {code} while writing"
                )
            if time.monotonic() > deadline:
                raise BatchpilotError(
                    where,
                    f"the checkpoint writer process wrote for over {self.timeout_s:g} s without finishing",
                    "check that the checkpoint storage is reachable",
                )
        answer = self._connection.recv()
        if answer[0] == "error":
            raise BatchpilotError(where, f"the checkpoint writer process failed: {answer[1]}")
        return answer[1], answer[2]

    def close(self) -> None:
        """Ends the writer process (after the save it is writing, if any; bounded)."""
        self._started()
        if self._process is None:
            return
        with contextlib.suppress(OSError):
            self._connection.send(None)
        self._process.join(self.timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._connection.close()
        self._process = None


class ProcessStorageWriter(StorageWriter):
    """The DCP writer of one step folder whose files `writer` (this rank's writer process) writes."""

    def __init__(
        self, *args: Any, writer: WriterProcess, uri: str, spread_s: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._writer, self._uri, self._spread_s = writer, uri, spread_s

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data: dict[MetadataIndex, Any] = {}
        for item in plan.items:
            value = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(value, io.BytesIO)
                data[item.index] = value.getvalue()
            else:
                data[item.index] = value.detach()
        results, written = self._writer.write(
            uri=self._uri,
            folder=os.fspath(self.path),
            thread_count=self.thread_count,
            plan=plan,
            data=data,
            spread_s=self._spread_s,
        )
        self.storage_fs.written.update(written)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future
