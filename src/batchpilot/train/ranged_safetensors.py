"""A safetensors object in a bucket, read by byte ranges: each rank reads only its shards' rows.

A `gs://` `train.init_from` folder is not copied to the node: every rank reads the 8-byte header length and
the JSON header of each weight file, then for each tensor the byte range of its own rows (the tensors of a
safetensors file are stored row-major, one after another, so rows `[a, b)` of a tensor are one contiguous
range). All ranges come from the object generation listed when the load began.

Integrity, as the node copy had it (each file's size and CRC32C against the object's metadata): every read
must return the bytes asked for, and each rank records the CRC32C of every range it read. After the load the
ranks gather those records; the ranges of all ranks together tile each file (every tensor is split into its
shards, the header is read by all), so the file's CRC32C follows from theirs (`storage.crc32c.of_tiling`)
and is compared with the object's, on every rank alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from batchpilot.errors import BatchpilotError
from batchpilot.storage import Storage
from batchpilot.storage.crc32c import of_tiling

FIELD = "train.init_from"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names (its format's header) -> torch's."""
MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header."""


class RangedSafetensors:
    """One safetensors object of `storage`, read in ranges of the generation `info` names; `reads` records
    `(start, end, crc32c)` of every range read."""

    def __init__(self, storage: Storage, name: str, info: dict[str, Any]) -> None:
        self.storage, self.name, self.info = storage, name, info
        self.reads: list[tuple[int, int, int]] = []
        size = info["size_bytes"]
        header_bytes = int.from_bytes(self._read(0, 8), "little") if size >= 8 else -1
        if not 0 < header_bytes <= min(MAX_HEADER_BYTES, size - 8):
            raise BatchpilotError(FIELD, f"{self.uri} is not a safetensors file (its header length is wrong)")
        try:
            self.header: dict[str, Any] = json.loads(self._read(8, 8 + header_bytes))
        except ValueError:
            raise BatchpilotError(
                FIELD, f"{self.uri} is not a safetensors file (its header is not JSON)"
            ) from None
        self.data_start = 8 + header_bytes
        ends = [entry["data_offsets"][1] for key, entry in self.header.items() if key != "__metadata__"]
        if self.data_start + max(ends, default=0) != size:
            raise BatchpilotError(
                FIELD,
                f"{self.uri} has {size} bytes, its header describes {self.data_start + max(ends, default=0)}",
            )

    @property
    def uri(self) -> str:
        return f"{self.storage.uri.rstrip('/')}/{self.name}"

    def tensor_names(self) -> list[str]:
        return [key for key in self.header if key != "__metadata__"]

    def get_slice(self, key: str) -> RangedSlice:
        return RangedSlice(self, key)

    def _read(self, start: int, end: int) -> bytes:
        import google_crc32c

        data = self.storage.read(self.name, start=start, end=end, generation=self.info["generation"])
        if len(data) != end - start:
            raise BatchpilotError(
                FIELD, f"read {len(data)} bytes of {self.uri} at {start}, asked for {end - start}"
            )
        self.reads.append((start, end, google_crc32c.value(data)))
        return data


class RangedSlice:
    """One tensor of a `RangedSafetensors`, as safetensors' `get_slice` gives it (`get_shape`, indexing)."""

    def __init__(self, file: RangedSafetensors, key: str) -> None:
        self.file, self.key = file, key
        entry = file.header[key]
        self.shape: list[int] = list(entry["shape"])
        if entry["dtype"] not in DTYPES:
            raise BatchpilotError(FIELD, f"{file.uri} holds {key} as {entry['dtype']}, which is not read")
        self.dtype: torch.dtype = DTYPES[entry["dtype"]]
        self.begin = file.data_start + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return self.shape

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        """Rows `index[0]` of the tensor read as one range (the other dimensions whole); any other index reads
        the whole tensor and slices it."""
        if not self.shape:
            return self._rows(0, 1).reshape(())
        rows = range(*index[0].indices(self.shape[0]))
        whole_rest = all(
            part.indices(size) == (0, size, 1) for part, size in zip(index[1:], self.shape[1:], strict=True)
        )
        if rows.step == 1 and whole_rest:
            return self._rows(rows.start, max(rows.stop, rows.start))
        return self._rows(0, self.shape[0])[index]

    def _rows(self, first: int, stop: int) -> torch.Tensor:
        row_bytes = math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()
        data = (
            self.file._read(self.begin + first * row_bytes, self.begin + stop * row_bytes)
            if stop > first
            else b""
        )
        rows = (
            torch.frombuffer(bytearray(data), dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        )
        return rows.reshape(stop - first, *self.shape[1:]) if self.shape else rows


def gaps(ranges: Sequence[tuple[int, int, int]], *, size: int) -> list[tuple[int, int]]:
    """The byte ranges of an object of `size` bytes that none of `ranges` covers."""
    found, at = [], 0
    for start, end, _ in sorted(ranges):
        if start > at:
            found.append((at, start))
        at = max(at, end)
    return [*found, (at, size)] if at < size else found


def check_objects(
    files: Sequence[RangedSafetensors], gathered: Sequence[dict[str, list[tuple[int, int, int]]]]
) -> None:
    """Every file's CRC32C, from the ranges every rank read of it (`gathered`: one name -> ranges per rank),
    against the object's.

    Raises:
        BatchpilotError: a file whose ranges do not tile it, or whose CRC32C differs from the object's.
    """
    for file in files:
        ranges = [item for reads in gathered for item in reads.get(file.name, [])]
        for start, end in gaps(ranges, size=file.info["size_bytes"]):  # tensors no rank loaded
            file._read(start, end)
            ranges.append(file.reads[-1])
        crc = of_tiling(ranges, size=file.info["size_bytes"])
        if crc is None:
            raise BatchpilotError(
                FIELD, f"the ranks' reads of {file.uri} do not cover it, so its CRC32C cannot be checked"
            )
        expected = file.info["crc32c"]
        if expected is None or crc != expected:
            want = "none" if expected is None else f"{expected:08x}"
            raise BatchpilotError(
                FIELD,
                f"the bytes read of {file.uri} have CRC32C {crc:08x}, the object {want}",
                "start again; if it repeats, check the object",
            )
