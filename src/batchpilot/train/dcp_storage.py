"""`torch.distributed.checkpoint` (DCP) through the project's storage layer (local folders and GCS).

DCP's file-system writer and reader do their I/O through a `FileSystemBase`; this one maps DCP's paths
(`<step folder>/<file>`) to objects of a `Storage`. A written stream becomes one atomic object write when
it closes, and one CRC-32 per block of `BLOCK_BYTES` is recorded (`written`). Every rank writes its own
files (`__<rank>_<i>.distcp`) in parallel; rank 0 writes `.metadata` last. With `stream_writes` (the
checkpoint writer process) a storage that can write from a stream (local folders) takes DCP's serialized
tensors straight into the file, checksummed on the way: no copy of the shard in memory.

A read stream fetches only the blocks that DCP's reads touch (ranged reads: a rank that reshards reads the
byte ranges of the chunks it needs, not whole files) and checks each block against the checksum that the
checkpoint's meta.json recorded. Checkpoints written before 2026-11-29 recorded a SHA-256 per block
(`block_sha256`), and earlier ones only the file's (`sha256`: read whole); both still read.

Why CRC-32 (zlib's): the checksums catch damage in storage or in transit, not tampering, and a rank's
writer must not take the training's CPU: zlib.crc32 runs at about 4 GB/s on a 2-vCPU VM, SHA-256 at 1.8
(with the CPU's SHA extensions), and a SHA-256 of the whole file beside the blocks' doubled that
(bench/checkpoint_blocking.py; google_crc32c is faster still but takes only `bytes`, not the memory views
DCP writes, so it would need a copy).
"""

from __future__ import annotations

import hashlib
import io
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from batchpilot.errors import BatchpilotError
from batchpilot.storage import Storage, join_uri


class _KeptBuffer(io.BytesIO):
    """A write buffer whose bytes survive `close()` (DCP closes the streams it writes)."""

    _kept: bytes | None = None

    def close(self) -> None:
        if not self.closed:
            self._kept = self.getvalue()
        super().close()

    def contents(self) -> bytes:
        return self._kept if self.closed and self._kept is not None else self.getvalue()


BLOCK_BYTES = 4 * 1024 * 1024
"""Checksum block of a checkpoint file: the unit of a ranged read (a 5B-parameter model's checkpoint, about
80 GB, has some 20,000 blocks: about 1.4 MB of checksums in meta.json)."""
_CACHED_BLOCKS = 16


def block_checksums(data: bytes, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """CRC-32 of each `block_bytes` block of `data` (the last one shorter)."""
    view = memoryview(data)
    return [zlib.crc32(view[i : i + block_bytes]) for i in range(0, len(data), block_bytes)]


def _sha256(block: bytes) -> str:
    return hashlib.sha256(block).hexdigest()


_PIECE_BYTES = 256 * 1024


class _ChecksummingWriter(io.RawIOBase):
    """A write-only stream into `file` that counts the bytes and takes each block's CRC-32 as they pass."""

    def __init__(
        self, file: Any, block_bytes: int = BLOCK_BYTES, pace: Callable[[int], None] | None = None
    ) -> None:
        super().__init__()
        self._file, self._block_bytes, self._pace = file, block_bytes, pace
        self._blocks: list[int] = []
        self._crc = self._filled = self._size = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            # a piece the CPU's cache holds: checksummed, then copied into the file from the cache
            take = min(self._block_bytes - self._filled, len(view) - at, _PIECE_BYTES)
            piece = view[at : at + take]
            self._crc = zlib.crc32(piece, self._crc)
            self._file.write(piece)
            if self._pace is not None:
                self._pace(take)
            self._filled += take
            at += take
            if self._filled == self._block_bytes:
                self._blocks.append(self._crc)
                self._crc = self._filled = 0
        self._size += len(view)
        return len(view)

    def close(self) -> None:
        """DCP closes the streams it writes; the file is closed by the storage when the object is whole."""

    def entry(self) -> dict[str, Any]:
        """meta.json's entry of the file written."""
        blocks = self._blocks + ([self._crc] if self._filled else [])
        return {"size_bytes": self._size, "block_bytes": self._block_bytes, "block_crc32": blocks}


def written_entry(data: bytes) -> dict[str, Any]:
    """meta.json's entry of a file written whole."""
    return {"size_bytes": len(data), "block_bytes": BLOCK_BYTES, "block_crc32": block_checksums(data)}


class _CheckedRangeReader(io.RawIOBase):
    """A seekable read-only view of one object that fetches the blocks a read touches (one ranged read per
    run of missing blocks), checks each against its checksum (`digest` of the block), and keeps the last
    few."""

    def __init__(
        self, storage: Storage, name: str, *, size_bytes: int, block_bytes: int, expected: list[Any],
        digest: Any,
    ):  # fmt: skip
        super().__init__()
        self._storage, self._name, self._size = storage, name, size_bytes
        self._block_bytes, self._expected, self._digest = block_bytes, expected, digest
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._position = 0
        self.bytes_fetched = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._position + size)
        if end <= self._position:
            return b""
        first, last = self._position // self._block_bytes, (end - 1) // self._block_bytes
        self._fetch(first, last)
        joined = b"".join(self._blocks[index] for index in range(first, last + 1))
        origin, start = first * self._block_bytes, self._position
        self._position = end
        return joined[start - origin : end - origin]

    def _fetch(self, first: int, last: int) -> None:
        missing = [index for index in range(first, last + 1) if index not in self._blocks]
        if missing:
            start = missing[0] * self._block_bytes
            data = self._read(start, min(self._size, (missing[-1] + 1) * self._block_bytes))
            for index in range(missing[0], missing[-1] + 1):
                offset = (index - missing[0]) * self._block_bytes
                self._blocks[index] = self._checked(index, data[offset : offset + self._block_bytes])
        for index in range(first, last + 1):
            self._blocks.move_to_end(index)
        while len(self._blocks) > max(_CACHED_BLOCKS, last - first + 1):
            self._blocks.popitem(last=False)

    def _read(self, start: int, end: int) -> bytes:
        data = self._storage.read(self._name, start=start, end=end)
        self.bytes_fetched += len(data)
        if len(data) != end - start:  # a checksum could only say "mismatch": say what is missing
            raise BatchpilotError(
                join_uri(self._storage.uri, self._name),
                f"returned {len(data)} bytes for bytes [{start}, {end}), not {end - start}: the object is not "
                f"the {self._size} bytes its checkpoint recorded (truncated or replaced)",
            )
        return data

    def _checked(self, index: int, block: bytes) -> bytes:
        """The block, checked; a ranged read has no server-side checksum, so a block damaged in transit is
        read once more, and a block damaged twice is taken for a damaged object."""
        if self._digest(block) == self._expected[index]:
            return block
        start = index * self._block_bytes
        block = self._read(start, min(self._size, start + self._block_bytes))
        if self._digest(block) != self._expected[index]:
            raise BatchpilotError(
                join_uri(self._storage.uri, self._name),
                f"is corrupted (checksum mismatch in bytes [{start}, {start + len(block)}), read twice)",
            )
        return block


@contextmanager
def _no_record_crc32() -> Generator[None, None, None]:
    """torch.save keeps a CRC-32 of each record in its zip; every file written here gets a CRC-32 of each 4 MiB
    block in meta.json instead (taken on the way, checked on every read), so the zip's own pass over each
    tensor's bytes is CPU taken from the steps for nothing (0.03-0.05 s per 268 MB, measured; torch.load does
    not check it). The setting is the calling thread's (torch's config overrides are per thread), which is
    the thread DCP serializes this file's items in."""
    with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]  # installed at import
        yield


class StorageFileSystem(FileSystemBase):
    """DCP's file-system interface over a `Storage`; paths are object names relative to its root.

    Args:
        expected: for reading, meta.json's entry of each file (`block_bytes` and `block_crc32`, or from
            earlier versions `block_sha256` or only `sha256`) by object name.
        stream_writes: write each file from a stream where the storage can (`open_write`): DCP serializes
            the tensors straight into the object, checksummed on the way.
        pace: called with each piece's byte count as a stream write takes it (the writer process's `Pace`).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        expected: dict[str, dict[str, Any]] | None = None,
        stream_writes: bool = False,
        pace: Callable[[int], None] | None = None,
    ) -> None:
        self.storage = storage
        self.pace = pace
        self.stream_writes = stream_writes and hasattr(storage, "open_write")
        self.expected = expected or {}
        self.written: dict[str, dict[str, Any]] = {}
        self.failures: list[BaseException] = []
        self.bytes_fetched = 0

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        name = os.fspath(path)
        if "r" in mode:
            info = self.expected.get(name, {})
            blocks = next((key for key in ("block_crc32", "block_sha256") if key in info), None)
            if blocks is not None:
                reader = _CheckedRangeReader(
                    self.storage, name, size_bytes=int(info["size_bytes"]), block_bytes=int(info["block_bytes"]),
                    expected=list(info[blocks]), digest=zlib.crc32 if blocks == "block_crc32" else _sha256,
                )  # fmt: skip
                try:
                    yield reader
                finally:
                    self.bytes_fetched += reader.bytes_fetched
                return
            data = self.storage.read(name)
            self.bytes_fetched += len(data)
            if "sha256" in info and hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise BatchpilotError(join_uri(self.storage.uri, name), "is corrupted (checksum mismatch)")
            yield io.BytesIO(data)
            return
        try:
            with _no_record_crc32():
                if self.stream_writes:
                    # a shard is not read again by this process: its pages leave the cache once on disk (the
                    # writer's system time per GB saved, measured on a 2-vCPU VM: 0.3-0.6 s, not 0.3-2 s)
                    with self.storage.open_write(name, keep_cached=False) as writing:  # type: ignore[attr-defined]
                        stream = _ChecksummingWriter(writing.file, pace=self.pace)
                        yield stream
                    self.written[name] = stream.entry()
                    return
                buffer = _KeptBuffer()
                yield buffer
                data = buffer.contents()
                self.storage.write(name, data)
        except BaseException as error:
            # DCP's extra writer threads drop their exceptions; StorageWriter.write_data raises this.
            self.failures.append(error)
            raise
        self.written[name] = written_entry(data)

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

    def __init__(
        self,
        storage: Storage,
        folder: str,
        *,
        thread_count: int = 1,
        stream_writes: bool = False,
        pace: Callable[[int], None] | None = None,
    ) -> None:
        # sync_files: the storage's writes are atomic and durable already (and a BytesIO has no fileno).
        # thread_count: this rank's state goes to that many objects (`__<rank>_<i>.distcp`), written and
        # uploaded by as many threads at once.
        super().__init__(
            folder, single_file_per_rank=True, sync_files=False, overwrite=True, thread_count=thread_count
        )
        self.storage_fs = StorageFileSystem(storage, stream_writes=stream_writes, pace=pace)
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
    """DCP reader of one step folder: reads the blocks of each file it needs, checked against the checksums
    of the checkpoint's meta.json (`expected`: its `files` entries by object name)."""

    def __init__(self, storage: Storage, folder: str, *, expected: dict[str, dict[str, Any]]) -> None:
        super().__init__(folder)
        self.storage_fs = StorageFileSystem(storage, expected=expected)
        self.fs = self.storage_fs  # type: ignore[assignment]
        self.path = folder
