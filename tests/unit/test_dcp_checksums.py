"""A checkpoint file's checksums (train/dcp_storage.py): one CRC-32 per 4 MiB block, taken as the writer process
streams DCP's bytes into the file, or from the bytes of a file written whole; ranged reads check each block.
Checkpoints of earlier versions (a SHA-256 per block, or only the file's) still read."""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage
from batchpilot.train.dcp_storage import BLOCK_BYTES, StorageFileSystem, block_checksums, written_entry

NAME = "000000001/__0_0.distcp"


def some_bytes(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def stream_in(files: StorageFileSystem, data: bytes, chunk: int) -> None:
    with files.create_stream(NAME, "wb") as stream:
        for at in range(0, len(data), chunk):
            stream.write(memoryview(data)[at : at + chunk])
        stream.close()  # DCP closes its streams; the object is written when the block ends


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_streamed_file_is_written_whole_with_the_checksums_of_its_blocks(tmp_path):
    data = some_bytes(2 * BLOCK_BYTES + 12_345)  # three blocks, the last one short
    files = StorageFileSystem(LocalStorage(tmp_path), stream_writes=True)
    assert files.stream_writes
    stream_in(files, data, chunk=1_000_003)  # writes that straddle the blocks' edges
    assert (tmp_path / NAME).read_bytes() == data
    entry = files.written[NAME]
    assert entry == written_entry(data)
    assert entry["block_crc32"] == [
        zlib.crc32(data[:BLOCK_BYTES]), zlib.crc32(data[BLOCK_BYTES : 2 * BLOCK_BYTES]),
        zlib.crc32(data[2 * BLOCK_BYTES :]),
    ]  # fmt: skip
    assert entry["size_bytes"] == len(data) and entry["block_bytes"] == BLOCK_BYTES


def test_a_stream_that_fails_leaves_no_object_and_no_temporary_file(tmp_path):
    files = StorageFileSystem(LocalStorage(tmp_path), stream_writes=True)
    with pytest.raises(RuntimeError, match="serialization failed"), files.create_stream(NAME, "wb") as stream:
        stream.write(some_bytes(1000))
        raise RuntimeError("serialization failed")
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []
    assert NAME not in files.written and len(files.failures) == 1


def test_without_stream_writes_the_bytes_are_written_whole_with_the_same_checksums(tmp_path):
    data = some_bytes(BLOCK_BYTES + 7)
    files = StorageFileSystem(LocalStorage(tmp_path))
    assert not files.stream_writes
    stream_in(files, data, chunk=65_536)
    assert (tmp_path / NAME).read_bytes() == data and files.written[NAME] == written_entry(data)


@pytest.mark.parametrize("blocks", ["block_crc32", "block_sha256"])
def test_each_block_read_is_checked_against_the_checksum_recorded(tmp_path, blocks):
    """block_crc32 as written now; block_sha256 as checkpoints before 2026-11-29 recorded it."""
    data = some_bytes(3 * 4096 + 100)
    storage = LocalStorage(tmp_path)
    storage.write(NAME, data)
    digests = (
        block_checksums(data, 4096) if blocks == "block_crc32"
        else [hashlib.sha256(data[at : at + 4096]).hexdigest() for at in range(0, len(data), 4096)]
    )  # fmt: skip
    expected = {NAME: {"size_bytes": len(data), "block_bytes": 4096, blocks: digests}}
    with StorageFileSystem(storage, expected=expected).create_stream(NAME, "rb") as stream:
        stream.seek(5000)
        assert stream.read(4000) == data[5000:9000]
    flip_byte(tmp_path / NAME, 2 * 4096 + 10)
    files = StorageFileSystem(storage, expected=expected)
    with files.create_stream(NAME, "rb") as stream:
        assert stream.read(4096) == data[:4096]  # the damaged block is not read
    with (
        pytest.raises(
            BatchpilotError, match=r"is corrupted \(checksum mismatch in bytes \[8192, 12288\), read twice\)"
        ),
        files.create_stream(NAME, "rb") as stream,
    ):
        stream.seek(8200)
        stream.read(10)


def test_a_local_object_written_from_a_stream_replaces_the_old_one_only_when_whole(tmp_path):
    storage = LocalStorage(tmp_path)
    first = storage.write("a/b", b"old")
    with pytest.raises(RuntimeError), storage.open_write("a/b") as writing:
        writing.file.write(b"half of the new")
        raise RuntimeError
    assert storage.read("a/b") == b"old" and storage.stat("a/b").generation == first
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]
    with storage.open_write("a/b") as writing:
        writing.file.write(b"new")
    assert storage.read("a/b") == b"new" and writing.generation == storage.stat("a/b").generation > first
