"""Atomic checkpoints behind the storage protocol (local folder or GCS), keyed by optimizer step.

Layout under `checkpoint_uri`: `<step:09d>/model.pt`, `optimizer.pt`, `rng.pt`, then `<step>/meta.json`
(consumed_samples and a SHA-256 of every file), then the `latest` pointer, written last with a
generation precondition. A reader follows `latest`, so a checkpoint interrupted mid-write (any object
missing, or `latest` not yet moved) is never seen; the interrupted step folder is removed by the next
successful save.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from batchpilot import __version__
from batchpilot.data.storage import ObjectNotFound, PreconditionFailed, Storage, open_storage
from batchpilot.errors import BatchpilotError

LATEST = "latest"
_FILES = ("model.pt", "optimizer.pt", "rng.pt")
_STEP_DIR = re.compile(r"^(\d{9})/")


@dataclass
class Checkpoint:
    """What a resumed run needs: position, model/optimizer state and RNG state."""

    step: int
    consumed_samples: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    meta: dict[str, Any]


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
        """Writes every object of the step, then moves `latest`; returns the step folder's URI."""
        folder = f"{step:09d}"
        blobs = {"model.pt": _to_bytes(model), "optimizer.pt": _to_bytes(optimizer), "rng.pt": _to_bytes(rng)}
        for name, data in blobs.items():
            self.storage.write(f"{folder}/{name}", data)
        meta = {
            "step": step,
            "consumed_samples": consumed_samples,
            "batchpilot_version": __version__,
            "saved_at_unix_s": round(time.time(), 3),
            "files": {
                name: {"size_bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                for name, d in blobs.items()
            },
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
        states = {}
        for name in _FILES:
            data = self.storage.read(f"{folder}/{name}")
            if hashlib.sha256(data).hexdigest() != meta["files"][name]["sha256"]:
                raise BatchpilotError(f"{self.uri}/{folder}/{name}", "is corrupted (checksum mismatch)")
            states[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return Checkpoint(
            step=step,
            consumed_samples=int(meta["consumed_samples"]),
            model=states["model.pt"],
            optimizer=states["optimizer.pt"],
            rng=states["rng.pt"],
            meta=meta,
        )
