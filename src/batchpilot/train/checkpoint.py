"""Atomic checkpoints behind the storage protocol (local folder or GCS), keyed by optimizer step.

Two formats share one layout rule: a step folder `<step:09d>/` with its objects, then `<step>/meta.json`
(consumed_samples, the format, and a SHA-256 of every file), then the `latest` pointer, written last with
a generation precondition. A reader follows `latest`, so a checkpoint interrupted mid-write (any object
missing, or `latest` not yet moved) is never seen; the interrupted step folder is removed by the next
successful save.

The trainer saves asynchronously (`start_save_sharded`): it blocks only while the state is copied to CPU
memory (DCP's stager; pinned on CUDA); a background thread then writes every rank's files (several
objects per rank, uploaded in parallel), gathers their checksums, commits on rank 0 and prunes. Its
collectives run on a process group of their own, so they never interleave with training's. At most one
save is in flight: the next save, `wait` and the end of a stage wait for it (bounded) and raise its failure.
A process that dies mid-save leaves `latest` on the previous checkpoint.

- `sharded` (what the trainer writes): `torch.distributed.checkpoint` files, one per rank
  (`__<rank>_0.distcp`, written by every rank in parallel) and `.metadata`, plus rank 0's `rng.pt`. The
  state is keyed by parameter name, so it loads on any world size and any strategy (DDP, FSDP, HSDP):
  loading reshards.
- `full` (checkpoints of batchpilot before sharding): `model.pt`, `optimizer.pt`, `rng.pt` written by rank
  0. They keep loading: the trainer maps the optimizer's positional state to parameter names and every
  rank takes its part.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from batchpilot import __version__, runstate
from batchpilot.errors import BatchpilotError
from batchpilot.storage import (
    LocalStorage,
    ObjectNotFound,
    Storage,
    join_uri,
    open_storage,
)
from batchpilot.train.checkpoint_writer import ProcessStorageWriter, WriterProcess
from batchpilot.train.dcp_storage import StorageReader, StorageWriter

logger = logging.getLogger(__name__)

SHARDED = "sharded"
_FILES = ("model.pt", "optimizer.pt", "rng.pt")
UPLOAD_THREADS = 4
"""Objects each rank writes per checkpoint, uploaded in parallel (one object per thread)."""
DELAY_ENV = "BATCHPILOT_TEST_CHECKPOINT_DELAY_S"
"""Tests: seconds the background thread waits before it writes (an upload slower than training)."""
SPREAD_FRACTION = 0.5
"""An asynchronous save's writing is spread over this share of the time since the previous one started (the
writer process's `Pace`; a wait for the save ends the spreading)."""
MAX_SPREAD_S = 300.0
"""The longest a save's writing is spread over."""
SAVE_TIMEOUT_S = 1800.0
"""How long a wait for a save in flight (and the checkpoint group's collectives) may take."""


@dataclass
class Checkpoint:
    """What a resumed run needs: position and RNG state, and where the model/optimizer state is.

    Attributes:
        folder: the step folder's object name prefix (`000000010`).
        storage: where it is.
        model, optimizer: the state dicts of a `full` checkpoint (None for `sharded`: those load into a
            model with `load_sharded`).
    """

    step: int
    consumed_samples: int
    rng: dict[str, Any]
    meta: dict[str, Any]
    folder: str
    storage: Storage
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None

    @property
    def sharded(self) -> bool:
        return self.meta.get("format") == SHARDED

    def reader(self) -> StorageReader:
        """A DCP reader of this (sharded) checkpoint that checks every byte it reads against meta.json."""
        expected = {f"{self.folder}/{name}": info for name, info in self.meta["files"].items()}
        return StorageReader(self.storage, self.folder, expected=expected)

    def saved_model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The (global) shape of every model tensor the checkpoint holds, by parameter name: from DCP's
        `.metadata` for a sharded checkpoint (no tensor is read), from `model.pt` for a full one."""
        if not self.sharded:
            assert self.model is not None
            return tensor_shapes(self.model)
        saved = self.reader().read_metadata().state_dict_metadata
        return {
            key.removeprefix("model."): tuple(item.size)
            for key, item in saved.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
        }

    def check_same_model(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuses a checkpoint of another model before anything is loaded: DCP would stop on the first
        shape mismatch with a traceback, and load a model with fewer blocks from a larger one silently.

        Args:
            shapes: the model's tensor shapes by parameter name (`tensor_shapes` of its state dict).

        Raises:
            BatchpilotError: naming the first tensor, in the model's order, whose shape differs or that the
                checkpoint lacks, or else the first tensor of the checkpoint the model lacks.
        """
        saved = self.saved_model_shapes()
        mismatch = next((name for name in shapes if saved.get(name) != tuple(shapes[name])), None)
        if mismatch is not None:
            there = list(saved[mismatch]) if mismatch in saved else "absent"
            difference = f"{mismatch} is {there} there and {list(shapes[mismatch])} in this model"
        else:
            extra = [name for name in saved if name not in shapes]
            if not extra:
                return
            difference = f"it holds {extra[0]} {list(saved[extra[0]])}, which this model does not have"
            if len(extra) > 1:
                difference += f" (and {len(extra) - 1} more tensors)"
        raise BatchpilotError(
            join_uri(self.storage.uri, self.folder),
            f"was written by a different model: {difference}",
            "resume with the model section the checkpoint was written with, or point "
            "train.checkpoint_uri at a new folder to start over",
        )

    def full_state(self) -> dict[str, Any]:
        """The whole `{"model": ..., "optimizer": ...}` state on this one process (no process group), for
        inspection and tests; parameter-name keyed for sharded checkpoints."""
        if not self.sharded:
            return {"model": self.model, "optimizer": self.optimizer}
        state: dict[str, Any] = {}
        _load_state_dict(
            state, storage_reader=self.reader(), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
        return state


def tensor_shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of a (flat) state dict by name; a DTensor's is its global shape."""
    return {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU, and CUDA when present) and Python RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def dcp_quietly() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes a single process; it is one here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


@contextlib.contextmanager
def user_errors_of_dcp() -> Iterator[None]:
    """DCP wraps every rank's exception in one CheckpointException; a BatchpilotError among them (a corrupted
    or missing file, a failed upload) is the one line to show."""
    try:
        yield
    except CheckpointException as error:
        for failure, _trace in error.failures.values():
            if isinstance(failure, BatchpilotError):
                raise failure from None
        raise


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@dataclass
class _InFlight:
    """A save running in the background thread."""

    step: int
    where: str
    started_s: float
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    finished_s: float = 0.0
    thread: threading.Thread | None = None


class Checkpointer:
    """Saves and loads checkpoints under one URI; keeps the newest `keep_last`."""

    def __init__(
        self,
        *,
        uri: str,
        keep_last: int = 2,
        storage: Storage | None = None,
        upload_threads: int = UPLOAD_THREADS,
        save_timeout_s: float = SAVE_TIMEOUT_S,
    ) -> None:
        if keep_last < 1:
            raise BatchpilotError("train.keep_checkpoints", f"must be at least 1, got {keep_last}")
        self.uri = uri
        self.keep_last = keep_last
        self.storage = storage or open_storage(uri)
        # A storage object given by the caller is written in this process (its writes may do what its URI
        # cannot say); one opened from the URI is written by the writer process too.
        self._writes_by_uri = storage is None
        self.upload_threads = upload_threads
        self.save_timeout_s = save_timeout_s
        self._in_flight: _InFlight | None = None
        self._group: Any = None  # the checkpoint's own gloo process group (asynchronous saves)
        self._stager: DefaultStager | None = None
        self._writer: WriterProcess | None = (
            None  # writes the asynchronous saves' files (checkpoint_writer.py)
        )
        self._previous_start_s: float | None = None  # when the last asynchronous save started (monotonic)

    def latest_step(self) -> int | None:
        """The step `latest` points to, or None before the first checkpoint."""
        return runstate.latest_step(self.storage)

    def save(
        self,
        *,
        step: int,
        consumed_samples: int,
        model: dict[str, Any],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Writes a `full` checkpoint (the format before sharding) from one process, then moves `latest`."""
        folder = runstate.step_folder(step)
        blobs = {"model.pt": _to_bytes(model), "optimizer.pt": _to_bytes(optimizer), "rng.pt": _to_bytes(rng)}
        for name, data in blobs.items():
            self.storage.write(f"{folder}/{name}", data)
        files = {
            name: {"size_bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for name, d in blobs.items()
        }
        where = self._commit(step=step, consumed_samples=consumed_samples, files=files, extra=extra)
        self._prune(current=step)
        return where

    def save_sharded(
        self,
        *,
        step: int,
        consumed_samples: int,
        state: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None = None,
        planner: SavePlanner | None = None,
        side_objects: dict[str, bytes] | None = None,
    ) -> str | None:
        """Every rank calls this: each writes its own shards of `state` (DCP), then rank 0 writes rng.pt and
        meta.json (with every rank's files and checksums) and moves `latest`. Returns the step folder's URI
        on rank 0, None on the others; returns once the checkpoint is committed (rank 0 prunes before it
        returns, the other ranks do not wait for that). Waits first for a save in flight. `planner`: DCP's
        save planner (None: its default; the XLA runtime passes torch_xla's SPMD planner)."""
        self.wait()
        return self._write_and_commit(
            step=step, consumed_samples=consumed_samples, state=state, rng=rng, extra=extra,
            planner=planner, side_objects=side_objects, group=None,
        )  # fmt: skip

    def start_save_sharded(
        self,
        *,
        step: int,
        consumed_samples: int,
        state: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None = None,
        side_objects: dict[str, bytes] | None = None,
        planner: SavePlanner | None = None,
        last: bool = False,
    ) -> str:
        """`save_sharded` in the background. Every rank calls it at the same step. Blocks while it waits for
        the previous save (raising its failure) and while `state` is copied to shared CPU memory (buffers reused
        from save to save); returns the step folder's URI the save will commit. The files are written by this
        rank's writer process (train/checkpoint_writer.py), the plan and the commit by a background thread.
        `side_objects` (rank 0): objects written before `latest` moves. `planner`: as `save_sharded`'s.
        `last`: no step trains while this save is written (the launch's last): unless the writer process already
        runs, the background thread writes the files itself. The process keeps the writing off the steps' CPU
        time; with no step to keep it off, starting one (a spawned Python importing torch: about 4 CPU-s and
        2-3 s before its first byte) would only delay the save."""
        self.wait()
        group = self._checkpoint_group()
        if self._stager is None:
            on_gpu = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=on_gpu,
                    use_shared_memory=True,  # the writer process reads the staged copy where it is
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
            self._writer_process()
        copy = self._stager.stage(state)
        assert isinstance(copy, dict)  # synchronous staging returns the copy itself
        where = f"{self.uri.rstrip('/')}/{runstate.step_folder(step)}"
        in_flight = _InFlight(step=step, where=where, started_s=time.monotonic())
        writer = None if self._writer is None or (last and self._writer.pid is None) else self._writer
        now = time.monotonic()
        # spread over half the time since the previous save started (the steps until the next save are
        # about as many); not the launch's last (no step beside it) nor the first (no interval yet)
        spread_s = (
            0.0
            if last or self._previous_start_s is None
            else min(MAX_SPREAD_S, SPREAD_FRACTION * (now - self._previous_start_s))
        )
        self._previous_start_s = now
        if writer is not None:
            writer.unhurry()

        def run() -> None:
            try:
                time.sleep(float(os.environ.get(DELAY_ENV, "0")))  # tests: a slow upload
                self._write_and_commit(
                    step=step, consumed_samples=consumed_samples, state=copy, rng=rng, extra=extra,
                    planner=planner, side_objects=side_objects, group=group, writer=writer, spread_s=spread_s,
                )  # fmt: skip
            except BaseException as error:  # surfaced by the next wait(), never dropped
                in_flight.error = error
            finally:
                in_flight.finished_s = time.monotonic()
                in_flight.done.set()

        self._in_flight = in_flight
        # A daemon thread: a process that ends without waiting (a crash) abandons the save; `latest` has not
        # moved, and the next successful save removes the partial folder.
        in_flight.thread = threading.Thread(
            target=run, name=f"checkpoint-{runstate.step_folder(step)}", daemon=True
        )
        in_flight.thread.start()
        return where

    @property
    def writing(self) -> bool:
        """Whether a save started in the background is still being written."""
        return self._in_flight is not None and not self._in_flight.done.is_set()

    @property
    def save_in_flight(self) -> int | None:
        """The step of the save started in the background and not yet waited for (running or done), if any."""
        return None if self._in_flight is None else self._in_flight.step

    def wait(self) -> float | None:
        """Waits (at most `save_timeout_s`) for the save in flight and raises its failure; returns how long the
        save took from its start to its commit, None when none was in flight."""
        in_flight = self._in_flight
        if in_flight is None:
            return None
        if self._writer is not None:
            self._writer.hurry()  # a save spread over the steps is now waited for: the rest at full speed
        where = in_flight.where
        if not in_flight.done.wait(self.save_timeout_s):
            raise BatchpilotError(
                where,
                f"the checkpoint of step {in_flight.step} is still being written after {self.save_timeout_s:g} s",
                "check that the checkpoint storage is reachable and every rank is alive; `latest` still names "
                "the previous checkpoint",
            )
        # The thread still frees the staged copy after `done` is set; it ends before the process may: a daemon
        # thread inside torch's C++ code while the interpreter finalises aborts the process (SIGABRT).
        if in_flight.thread is not None:
            in_flight.thread.join(self.save_timeout_s)
        self._in_flight = None
        if in_flight.error is not None:
            error = in_flight.error
            problem = str(error) if isinstance(error, BatchpilotError) else repr(error)
            raise BatchpilotError(
                where,
                f"the checkpoint of step {in_flight.step} failed in the background ({problem}); it was not "
                "committed and `latest` names the previous checkpoint",
                "fix the cause and run the stage again: it resumes from `latest`",
            ) from error
        return in_flight.finished_s - in_flight.started_s

    def start_writer(self) -> None:
        """Starts this rank's writer process now, in the background (`WriterProcess.start_soon`): for a launch
        that saves before its last step, so that the process's start runs beside the launch's start-up and
        not beside the steps of its first save. Nothing where the files are written in this process (a
        storage object given)."""
        writer = self._writer_process()
        if writer is not None and writer.pid is None:
            logger.info(
                "the checkpoint writer process starts now, beside the start-up (this launch saves before its end)"
            )
            writer.start_soon(self.uri)

    def _writer_process(self) -> WriterProcess | None:
        """This rank's writer process (made once, started on first use), or None where the files are written
        in this process (a storage object given)."""
        if self._writer is None and self._writes_by_uri:
            self._writer = WriterProcess(timeout_s=self.save_timeout_s)
        return self._writer

    def close(self) -> None:
        """Ends the save in flight, if any, before the process ends (also when training failed): it commits
        when it can, and a failure is logged here (the error that ended training is the one raised)."""
        try:
            self.wait()
        except BatchpilotError as error:
            logger.error("%s", error)
        if self._writer is not None:
            self._writer.close()

    def _checkpoint_group(self) -> Any:
        """A gloo group of every rank for the background thread's collectives (created on first use: every
        rank starts its first asynchronous save at the same step)."""
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.save_timeout_s)
            )
        return self._group

    def _write_and_commit(
        self,
        *,
        step: int,
        consumed_samples: int,
        state: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None,
        planner: SavePlanner | None,
        side_objects: dict[str, bytes] | None,
        group: Any,
        writer: WriterProcess | None = None,
        spread_s: float = 0.0,
    ) -> str | None:
        """Every rank's files (by `writer`, the writer process, when given, spread over `spread_s` unless it is
        waited for), then rank 0's commit; every rank learns whether it committed; then rank 0 prunes (nobody
        waits for that)."""
        folder = runstate.step_folder(step)
        distributed = dist.is_initialized()
        storage_writer = (
            StorageWriter(self.storage, folder, thread_count=self.upload_threads)
            if writer is None
            else ProcessStorageWriter(
                self.storage,
                folder,
                thread_count=self.upload_threads,
                writer=writer,
                uri=self.uri,
                spread_s=spread_s,
            )
        )
        with user_errors_of_dcp(), dcp_quietly():
            dcp.save(
                state,
                storage_writer=storage_writer,
                no_dist=not distributed,
                planner=planner,
                process_group=group,
            )
        files = dict(storage_writer.storage_fs.written)
        if distributed:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, files, group=group)
            files = {name: info for rank_files in gathered for name, info in rank_files.items()}
        main = not distributed or dist.get_rank() == 0
        where, failure = None, None
        if main:
            try:
                where = self._commit_sharded(
                    folder=folder, step=step, consumed_samples=consumed_samples, files=files, rng=rng,
                    extra=extra, side_objects=side_objects or {},
                )  # fmt: skip
            except BaseException as error:
                failure = error
        if distributed:
            outcome = [None if failure is None else repr(failure)]
            dist.broadcast_object_list(outcome, src=0, group=group)  # replaces a barrier: the commit's result
            if outcome[0] is not None and failure is None:
                raise BatchpilotError(join_uri(self.uri, folder), f"rank 0 could not commit it: {outcome[0]}")
        if failure is not None:
            raise failure
        if main:
            self._prune(current=step)
        return where

    def _commit_sharded(
        self,
        *,
        folder: str,
        step: int,
        consumed_samples: int,
        files: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None,
        side_objects: dict[str, bytes],
    ) -> str:
        rng_bytes = _to_bytes(rng)
        self.storage.write(f"{folder}/rng.pt", rng_bytes)
        files[f"{folder}/rng.pt"] = {
            "size_bytes": len(rng_bytes),
            "sha256": hashlib.sha256(rng_bytes).hexdigest(),
        }
        for name, data in side_objects.items():
            self.storage.write(name, data)
        relative = {name.removeprefix(f"{folder}/"): info for name, info in sorted(files.items())}
        return self._commit(
            step=step,
            consumed_samples=consumed_samples,
            files=relative,
            extra={"format": SHARDED, **(extra or {})},
        )

    def _commit(
        self, *, step: int, consumed_samples: int, files: dict[str, Any], extra: dict[str, Any] | None
    ) -> str:
        """meta.json of a step whose files are all written, then `latest`."""
        meta = {
            "step": step,
            "consumed_samples": consumed_samples,
            "batchpilot_version": __version__,
            "saved_at_unix_s": round(time.time(), 3),
            "files": files,
            **(extra or {}),
        }
        runstate.write_meta(self.storage, step, meta)
        runstate.move_latest(self.storage, step)
        return f"{self.uri.rstrip('/')}/{runstate.step_folder(step)}"

    def _prune(self, *, current: int) -> None:
        steps = runstate.step_numbers(self.storage)
        complete = [s for s in steps if s <= current and self.storage.exists(runstate.meta_name(s))]
        keep = set(complete[-self.keep_last :])
        for step in steps:
            if step <= current and step not in keep:
                if isinstance(self.storage, LocalStorage):  # a killed save's temporary files, first
                    self.storage.delete_temporaries(runstate.step_folder(step))
                for name in self.storage.list(f"{runstate.step_folder(step)}/"):
                    self.storage.delete(name)

    def load(self, step: int | None = None) -> Checkpoint | None:
        """Loads `step` (default: the one `latest` points to), verifying every file's checksum."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        folder = runstate.step_folder(step)
        try:
            meta = runstate.read_meta(self.storage, step)
        except ObjectNotFound:
            raise BatchpilotError(
                f"{self.uri}/{runstate.meta_name(step)}", "is missing: the checkpoint is incomplete"
            ) from None
        if meta.get("format") == SHARDED:
            rng = self._read_checked(folder, "rng.pt", meta)
            return Checkpoint(
                step=step, consumed_samples=int(meta["consumed_samples"]), rng=rng, meta=meta, folder=folder,
                storage=self.storage,
            )  # fmt: skip
        states = {name: self._read_checked(folder, name, meta) for name in _FILES}
        return Checkpoint(
            step=step,
            consumed_samples=int(meta["consumed_samples"]),
            rng=states["rng.pt"],
            meta=meta,
            folder=folder,
            storage=self.storage,
            model=states["model.pt"],
            optimizer=states["optimizer.pt"],
        )

    def _read_checked(self, folder: str, name: str, meta: dict[str, Any]) -> Any:
        data = self.storage.read(f"{folder}/{name}")
        if hashlib.sha256(data).hexdigest() != meta["files"][name]["sha256"]:
            raise BatchpilotError(f"{self.uri}/{folder}/{name}", "is corrupted (checksum mismatch)")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
