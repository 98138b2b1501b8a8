"""One small storage protocol over object names relative to a root URI: local files and GCS.

The checkpoint code and the data layer share it, so its guarantees are the contract:

- `write` is atomic: a reader sees the old object or the new one, never a partial one.
- Every object has a generation (GCS: the object generation; local: a strictly increasing
  modification time in nanoseconds). `write(..., if_generation_match=g)` succeeds only when the current
  generation is `g` (`0`: only when the object is absent) and raises `PreconditionFailed` otherwise.
- `read(..., generation=g)` returns the bytes of generation `g` or raises `GenerationChanged`, so a
  reader that pinned a version never silently mixes two.
- Ranges are half-open byte offsets `[start, end)`.
- `delete` of a local object also removes the folders it leaves empty (GCS has no folders), so pruned
  checkpoints leave no empty step folders behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from batchpilot.errors import BatchpilotError


class StorageError(BatchpilotError):
    """A storage problem with one object; `field` is the object's URI."""


class ObjectNotFound(StorageError):
    """The object (or the bucket / folder holding it) does not exist."""

    def __init__(self, uri: str, fix: str | None = None) -> None:
        super().__init__(uri, "does not exist", fix)


class PreconditionFailed(StorageError):
    """A write's `if_generation_match` did not hold (someone else wrote first)."""

    def __init__(self, uri: str, expected_generation: int) -> None:
        state = "is absent" if expected_generation == 0 else f"is at generation {expected_generation}"
        super().__init__(uri, f"was not written: the write required that the object {state}, and it is not")


class GenerationChanged(StorageError):
    """The object was overwritten or deleted after a reader pinned its generation."""

    def __init__(self, uri: str, pinned_generation: int, current_generation: int | None) -> None:
        now = "deleted" if current_generation is None else f"now at generation {current_generation}"
        super().__init__(
            uri,
            f"changed after it was opened (pinned generation {pinned_generation}, {now})",
            "do not rewrite a shard set while it is being read; restart the run to read the new version",
        )


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one object.

    Attributes:
        size_bytes: object size.
        generation: version number; changes on every write.
        crc32c: CRC32C of the whole object as an unsigned int, when the store keeps one (GCS does,
            local files do not).
    """

    size_bytes: int
    generation: int
    crc32c: int | None


@runtime_checkable
class Storage(Protocol):
    """Objects under one root URI; names are `/`-separated and relative to that root."""

    @property
    def uri(self) -> str:
        """The root URI, e.g. `gs://bucket/prefix` or `file:///abs/path`."""
        ...

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        """Bytes `[start, end)` of the object (`end=None`: to the end), optionally of one generation."""
        ...

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        """Atomically writes the object and returns its new generation."""
        ...

    def stat(self, name: str) -> ObjectInfo:
        """Metadata of the object; raises ObjectNotFound."""
        ...

    def exists(self, name: str) -> bool:
        """Whether the object exists."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names of all objects whose name starts with `prefix`."""
        ...

    def delete(self, name: str) -> None:
        """Deletes the object; raises ObjectNotFound when it is absent."""
        ...


def join_uri(root: str, name: str) -> str:
    """`root/name` without doubled slashes (for messages and nested roots)."""
    return f"{root.rstrip('/')}/{name.lstrip('/')}" if name else root
