"""Atomic checkpoints behind the storage protocol (local folder or GCS), keyed by optimizer step.

Two formats share one layout rule: a step folder `<step:09d>/` with its objects, then `<step>/meta.json`
(consumed_samples, the format, and a SHA-256 of every file), then the `latest` pointer, written last with
a generation precondition. A reader follows `latest`, so a checkpoint interrupted mid-write (any object
missing, or `latest` not yet moved) is never seen; the interrupted step folder is removed by the next
successful save.

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
import hashlib
import io
import json
import random
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from batchpilot import __version__
from batchpilot.data.storage import ObjectNotFound, PreconditionFailed, Storage, open_storage
from batchpilot.errors import BatchpilotError
from batchpilot.train.dcp_storage import StorageReader, StorageWriter

LATEST = "latest"
SHARDED = "sharded"
_FILES = ("model.pt", "optimizer.pt", "rng.pt")
_STEP_DIR = re.compile(r"^(\d{9})/")


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
        """A DCP reader of this (sharded) checkpoint that checks every file's checksum."""
        expected = {f"{self.folder}/{name}": info["sha256"] for name, info in self.meta["files"].items()}
        return StorageReader(self.storage, self.folder, expected_sha256=expected)

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


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class Checkpointer:
    """Saves and loads checkpoints under one URI; keeps the newest `keep_last`."""

    def __init__(self, *, uri: str, keep_last: int = 2, storage: Storage | None = None) -> None:
        if keep_last < 1:
            raise BatchpilotError("train.keep_checkpoints", f"must be at least 1, got {keep_last}")
        self.uri = uri
        self.keep_last = keep_last
        self.storage = storage or open_storage(uri)

    def latest_step(self) -> int | None:
        """The step `latest` points to, or None before the first checkpoint."""
        try:
            text = self.storage.read(LATEST).decode().strip()
        except ObjectNotFound:
            return None
        if not text.isdigit():
            raise BatchpilotError(f"{self.uri}/{LATEST}", f"does not name a step ({text[:40]!r})")
        return int(text)

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
        folder = f"{step:09d}"
        blobs = {"model.pt": _to_bytes(model), "optimizer.pt": _to_bytes(optimizer), "rng.pt": _to_bytes(rng)}
        for name, data in blobs.items():
            self.storage.write(f"{folder}/{name}", data)
        files = {
            name: {"size_bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for name, d in blobs.items()
        }
        return self._commit(step=step, consumed_samples=consumed_samples, files=files, extra=extra)

    def save_sharded(
        self,
        *,
        step: int,
        consumed_samples: int,
        state: dict[str, Any],
        rng: dict[str, Any],
        extra: dict[str, Any] | None = None,
        planner: SavePlanner | None = None,
    ) -> str | None:
        """Every rank calls this: each writes its own shards of `state` (DCP), then rank 0 writes rng.pt and
        meta.json (with every rank's files and checksums) and moves `latest`. Returns the step folder's URI
        on rank 0, None on the others; returns once the checkpoint is complete on every rank. `planner`:
        DCP's save planner (None: its default; the XLA runtime passes torch_xla's SPMD planner)."""
        folder = f"{step:09d}"
        writer = StorageWriter(self.storage, folder)
        with dcp_quietly():
            dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized(), planner=planner)
        files = dict(writer.storage_fs.written)
        if dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, files)
            files = {name: info for rank_files in gathered for name, info in rank_files.items()}
        where = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            rng_bytes = _to_bytes(rng)
            self.storage.write(f"{folder}/rng.pt", rng_bytes)
            files[f"{folder}/rng.pt"] = {
                "size_bytes": len(rng_bytes),
                "sha256": hashlib.sha256(rng_bytes).hexdigest(),
            }
            relative = {name.removeprefix(f"{folder}/"): info for name, info in sorted(files.items())}
            where = self._commit(
                step=step,
                consumed_samples=consumed_samples,
                files=relative,
                extra={"format": SHARDED, **(extra or {})},
            )
        if dist.is_initialized():
            dist.barrier()
        return where

    def _commit(
        self, *, step: int, consumed_samples: int, files: dict[str, Any], extra: dict[str, Any] | None
    ) -> str:
        """meta.json of a step whose files are all written, then `latest`, then pruning."""
        folder = f"{step:09d}"
        meta = {
            "step": step,
            "consumed_samples": consumed_samples,
            "batchpilot_version": __version__,
            "saved_at_unix_s": round(time.time(), 3),
            "files": files,
            **(extra or {}),
        }
        self.storage.write(f"{folder}/meta.json", json.dumps(meta, indent=2).encode())
        try:
            generation = self.storage.stat(LATEST).generation
        except ObjectNotFound:
            generation = 0
        # The precondition makes a concurrent writer fail loudly instead of two runs silently interleaving.
        try:
            self.storage.write(LATEST, f"{folder}\n".encode(), if_generation_match=generation)
        except PreconditionFailed:
            # A retried write whose first attempt succeeded (response lost) also lands here: that is ours.
            if self.latest_step() != step:
                raise
        self._prune(current=step)
        return f"{self.uri.rstrip('/')}/{folder}"

    def _prune(self, *, current: int) -> None:
        steps = sorted({int(m.group(1)) for name in self.storage.list() if (m := _STEP_DIR.match(name))})
        complete = [s for s in steps if s <= current and self.storage.exists(f"{s:09d}/meta.json")]
        keep = set(complete[-self.keep_last :])
        for step in steps:
            if step <= current and step not in keep:
                for name in self.storage.list(f"{step:09d}/"):
                    self.storage.delete(name)

    def load(self, step: int | None = None) -> Checkpoint | None:
        """Loads `step` (default: the one `latest` points to), verifying every file's checksum."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        folder = f"{step:09d}"
        try:
            meta = json.loads(self.storage.read(f"{folder}/meta.json"))
        except ObjectNotFound:
            raise BatchpilotError(
                f"{self.uri}/{folder}/meta.json", "is missing: the checkpoint is incomplete"
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
