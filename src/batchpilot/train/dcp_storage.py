"""`torch.distributed.checkpoint` (DCP) through the project's storage layer (local folders and GCS).

DCP's file-system writer and reader do their I/O through a `FileSystemBase`; this one maps DCP's paths
(`<step folder>/<file>`) to objects of a `Storage`. A written stream becomes one atomic object write when
it closes, and its SHA-256 is recorded (`written`); a read stream holds the whole object and is checked
against the SHA-256 the checkpoint's meta.json recorded, when given. Every rank writes its own files
(`__<rank>_0.distcp`) in parallel; rank 0 writes `.metadata` last.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Generator
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from batchpilot.data.storage import Storage, join_uri
from batchpilot.errors import BatchpilotError


class _KeptBuffer(io.BytesIO):
    """A write buffer whose bytes survive `close()` (DCP closes the streams it writes)."""

    _kept: bytes | None = None

    def close(self) -> None:
        if not self.closed:
            self._kept = self.getvalue()
        super().close()

    def contents(self) -> bytes:
        return self._kept if self.closed and self._kept is not None else self.getvalue()


class StorageFileSystem(FileSystemBase):
    """DCP's file-system interface over a `Storage`; paths are object names relative to its root."""

    def __init__(self, storage: Storage, *, expected_sha256: dict[str, str] | None = None) -> None:
        self.storage = storage
        self.expected_sha256 = expected_sha256 or {}
        self.written: dict[str, dict[str, int | str]] = {}
        self.failures: list[BaseException] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        name = os.fspath(path)
        if "r" in mode:
            data = self.storage.read(name)
            expected = self.expected_sha256.get(name)
            if expected is not None and hashlib.sha256(data).hexdigest() != expected:
                raise BatchpilotError(join_uri(self.storage.uri, name), "is corrupted (checksum mismatch)")
            yield io.BytesIO(data)
            return
        buffer = _KeptBuffer()
        try:
            yield buffer
            data = buffer.contents()
            self.storage.write(name, data)
        except BaseException as error:
            # DCP's extra writer threads drop their exceptions; StorageWriter.write_data raises this.
            self.failures.append(error)
            raise
        self.written[name] = {"size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        old, new = os.fspath(path), os.fspath(new_path)
        self.storage.write(new, self.storage.read(old))
        self.storage.delete(old)
        if old in self.written:
            self.written[new] = self.written.pop(old)

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Object stores have no folders; a local storage creates them on write."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.delete(os.fspath(path))


class StorageWriter(FileSystemWriter):
    """DCP writer of one step folder; `storage_fs.written` lists this rank's files with their checksums."""

    def __init__(self, storage: Storage, folder: str, *, thread_count: int = 1) -> None:
        # sync_files: the storage's writes are atomic and durable already (and a BytesIO has no fileno).
        # thread_count: this rank's state goes to that many objects (`__<rank>_<i>.distcp`), written and
        # uploaded by as many threads at once.
        super().__init__(
            folder, single_file_per_rank=True, sync_files=False, overwrite=True, thread_count=thread_count
        )
        self.storage_fs = StorageFileSystem(storage)
        self.fs = self.storage_fs  # type: ignore[assignment]  # DCP types it as its local FileSystem
        self.path = folder

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, refusing to report success when one of its writer threads failed: those threads'
        exceptions are lost, and their items would be missing from the checkpoint's metadata."""
        results = super().write_data(plan, planner)
        written = results.value()
        if self.storage_fs.failures or len(written) != len(plan.items):
            if self.storage_fs.failures:
                raise self.storage_fs.failures[0]
            raise BatchpilotError(
                join_uri(self.storage_fs.storage.uri, os.fspath(self.path)),
                f"a writer thread stopped: {len(written)} of {len(plan.items)} items written",
            )
        return results


class StorageReader(FileSystemReader):
    """DCP reader of one step folder, checking each file against the checksums of the checkpoint's meta.json."""

    def __init__(self, storage: Storage, folder: str, *, expected_sha256: dict[str, str]) -> None:
        super().__init__(folder)
        self.fs = StorageFileSystem(storage, expected_sha256=expected_sha256)  # type: ignore[assignment]
        self.path = folder
