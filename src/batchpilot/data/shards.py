"""The shard format, the manifest, and `ShardSet`: a split's shards opened at pinned generations.

A shard is a 32-byte little-endian header followed by the tokens:

| bytes | field |
| --- | --- |
| 0-7 | magic `BPTOKENS` |
| 8-11 | format version (1) |
| 12-15 | bytes per token: 2 (uint16) or 4 (uint32) |
| 16-23 | token count |
| 24-31 | reserved, zero |

`manifest.json` lists each split's shards in order with token count, size and CRC32C, plus the
tokenizer and vocabulary size. It is written after the shards, so a manifest only ever names complete
shards; the samples of a split are windows over the concatenation of its shards.
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from batchpilot.errors import BatchpilotError
from batchpilot.storage import ObjectInfo, ObjectNotFound, Storage, join_uri, open_storage

MAGIC = b"BPTOKENS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")
HEADER_BYTES = HEADER.size
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "validation")
DTYPES = {2: "uint16", 4: "uint32"}
# Reads of nearby byte ranges are merged when the gap is at most this, trading a few wasted bytes for
# fewer requests (each GCS request costs tens of milliseconds of latency).
COALESCE_GAP_BYTES = 64 * 1024
MAX_REQUEST_BYTES = 8 * 2**20


def token_dtype(vocab_size: int) -> str:
    """uint16 when every token id fits, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def encode_shard(tokens: np.ndarray) -> bytes:
    """Header + tokens of one shard; `tokens` must be uint16 or uint32."""
    assert tokens.dtype in (np.uint16, np.uint32), tokens.dtype
    header = HEADER.pack(MAGIC, FORMAT_VERSION, tokens.dtype.itemsize, tokens.size)
    return header + tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()


def decode_header(data: bytes, *, uri: str) -> tuple[str, int]:
    """(dtype name, token count) from a shard header; raises BatchpilotError naming `uri` if invalid."""
    if len(data) < HEADER_BYTES:
        raise BatchpilotError(uri, f"is not a batchpilot shard: {len(data)} bytes, shorter than the header")
    magic, version, itemsize, num_tokens = HEADER.unpack(data[:HEADER_BYTES])
    if magic != MAGIC:
        raise BatchpilotError(
            uri, f"is not a batchpilot shard (magic {magic!r})", "re-run batchpilot data prepare"
        )
    if version != FORMAT_VERSION:
        raise BatchpilotError(
            uri, f"has shard format version {version}; this batchpilot reads {FORMAT_VERSION}"
        )
    if itemsize not in DTYPES:
        raise BatchpilotError(uri, f"has an unknown token size of {itemsize} bytes")
    return DTYPES[itemsize], int(num_tokens)


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of `data`, the checksum GCS keeps for every object."""
    return int(google_crc32c.value(data))


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it."""

    name: str
    num_tokens: int
    num_bytes: int
    crc32c: int


@dataclass(frozen=True)
class Manifest:
    """What `manifest.json` holds.

    Attributes:
        dtype: token dtype of every shard, `uint16` or `uint32`.
        vocab_size: number of token ids (the model's embedding size must be at least this).
        eos_token_id: the token appended after every document.
        tokenizer: how the text was tokenized, e.g. `{"kind": "bytes"}`.
        splits: shards of each split, in order.
    """

    dtype: str
    vocab_size: int
    eos_token_id: int
    tokenizer: dict[str, Any]
    splits: dict[str, tuple[ShardEntry, ...]]
    version: int = FORMAT_VERSION

    def num_tokens(self, split: str) -> int:
        return sum(shard.num_tokens for shard in self.splits.get(split, ()))

    def to_json(self) -> str:
        document = {
            "format": "batchpilot-token-shards",
            "version": self.version,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "tokenizer": self.tokenizer,
            "splits": {
                split: {
                    "num_tokens": self.num_tokens(split),
                    "shards": [
                        {
                            "name": s.name,
                            "num_tokens": s.num_tokens,
                            "num_bytes": s.num_bytes,
                            "crc32c": f"{s.crc32c:08x}",
                        }
                        for s in shards
                    ],
                }
                for split, shards in self.splits.items()
            },
        }
        return json.dumps(document, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: bytes | str, *, uri: str) -> Manifest:
        """Parses a manifest; raises BatchpilotError naming `uri` when it is not a valid one."""
        folder = uri.removesuffix(f"/{MANIFEST_NAME}")
        again = f"prepare the shard set again: batchpilot data prepare ... --out {folder}"
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or type(document.get("version")) is not int:
                raise BatchpilotError(
                    uri,
                    "is JSON but not a batchpilot manifest (it has no manifest version number)",
                    f"point at the folder `batchpilot data prepare --out` wrote, or {again}",
                )
            if document["version"] != FORMAT_VERSION:
                raise BatchpilotError(
                    uri,
                    f"has manifest version {document['version']!r}; this batchpilot reads version {FORMAT_VERSION}",
                    again,
                )
            splits = {
                split: tuple(
                    ShardEntry(
                        name=str(s["name"]),
                        num_tokens=int(s["num_tokens"]),
                        num_bytes=int(s["num_bytes"]),
                        crc32c=int(s["crc32c"], 16),
                    )
                    for s in body["shards"]
                )
                for split, body in document["splits"].items()
            }
            manifest = cls(
                dtype=str(document["dtype"]),
                vocab_size=int(document["vocab_size"]),
                eos_token_id=int(document["eos_token_id"]),
                tokenizer=dict(document["tokenizer"]),
                splits=splits,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            if isinstance(error, BatchpilotError):
                raise
            if isinstance(error, KeyError):
                raise BatchpilotError(
                    uri, f"is not a valid manifest (it has no {error} field)", again
                ) from None
            raise BatchpilotError(
                uri, f"is not a valid manifest ({type(error).__name__}: {error})", again
            ) from None
        if manifest.dtype not in DTYPES.values():
            raise BatchpilotError(uri, f"names an unknown token dtype {manifest.dtype!r}")
        return manifest


def read_manifest(storage: Storage) -> Manifest:
    """The manifest of the shard set at `storage`; a missing one is an error that says how to make it."""
    uri = join_uri(storage.uri, MANIFEST_NAME)
    try:
        text = storage.read(MANIFEST_NAME)
    except ObjectNotFound as error:
        if error.field != uri:  # the bucket itself is missing
            raise
        raise BatchpilotError(
            uri,
            "does not exist, so there is no shard set here",
            f"run: batchpilot data prepare ... --out {storage.uri}",
        ) from None
    return Manifest.from_json(text, uri=uri)


@dataclass(frozen=True)
class _Segment:
    """Bytes [start, end) of shard `shard` go to output `out` at token offset `out_offset`."""

    shard: int
    start: int
    end: int
    out: int
    out_offset: int


class ShardSet:
    """One split of a shard set, every shard checked against the manifest and pinned to a generation.

    Reads go to exactly the generations checked at `open`, so a shard rewritten later makes reads fail
    with `GenerationChanged` instead of mixing two versions.
    """

    def __init__(
        self,
        *,
        storage: Storage,
        manifest: Manifest,
        split: str,
        generations: Sequence[int],
        num_threads: int,
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.split = split
        self.shards = manifest.splits[split]
        self._generations = list(generations)
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self.num_tokens = manifest.num_tokens(split)
        # starts[i] is the split-wide index of shard i's first token.
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + shard.num_tokens)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="shard-read")
        self.num_requests = self.num_bytes_fetched = 0
        self._counter_lock = threading.Lock()

    @classmethod
    def open(
        cls, *, uri: str, split: str = "train", verify_checksums: bool = True, num_threads: int = 16
    ) -> ShardSet:
        """Reads the manifest, checks every shard of `split` and pins its generation.

        Args:
            uri: root of the shard set (`file://...` or `gs://...`).
            split: `train` or `validation`.
            verify_checksums: compare each shard's CRC32C with the manifest. GCS keeps the checksum, so
                this costs one metadata request per shard; local files are read once in full.
            num_threads: concurrent requests for opening and for reads.

        Raises:
            BatchpilotError: naming the object when the manifest is missing or invalid, the split is
                empty, or a shard is missing, truncated, of the wrong dtype or corrupted.
        """
        storage = open_storage(uri)
        manifest = read_manifest(storage)
        if not manifest.splits.get(split):
            known = ", ".join(name for name, shards in manifest.splits.items() if shards) or "none"
            raise BatchpilotError(
                join_uri(storage.uri, MANIFEST_NAME),
                f"has no shards in split {split!r} (splits with data: {known})",
                "use another split, or prepare with --validation-fraction > 0 for a validation split",
            )
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            generations = list(
                pool.map(
                    lambda shard: _check_shard(
                        storage, shard, manifest.dtype, verify_checksums=verify_checksums
                    ),
                    manifest.splits[split],
                )
            )
        return cls(
            storage=storage, manifest=manifest, split=split, generations=generations, num_threads=num_threads
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def read_tokens(
        self, ranges: Sequence[tuple[int, int]], *, coalesce_gap_bytes: int = COALESCE_GAP_BYTES
    ) -> list[np.ndarray]:
        """The tokens of each split-wide range `[start, end)`, in the manifest's dtype.

        Ranges of one shard at most `coalesce_gap_bytes` apart are fetched by one request (0: only
        touching or overlapping ones); requests run concurrently. `num_requests` and
        `num_bytes_fetched` count what storage returned.
        """
        segments = [
            seg for index, (start, end) in enumerate(ranges) for seg in self._segments(index, start, end)
        ]
        outputs = [np.empty(end - start, dtype=self.dtype) for start, end in ranges]
        requests = _coalesce(segments, gap_bytes=coalesce_gap_bytes)
        results = self._pool.map(self._fetch, requests)
        for (shard, start, _end, members), data in zip(requests, results, strict=True):
            del shard
            for seg in members:
                chunk = np.frombuffer(
                    data,
                    dtype=self.dtype,
                    count=(seg.end - seg.start) // self.dtype.itemsize,
                    offset=seg.start - start,
                )
                outputs[seg.out][seg.out_offset : seg.out_offset + chunk.size] = chunk
        return outputs

    def _fetch(self, request: tuple[int, int, int, list[_Segment]]) -> bytes:
        shard, start, end, _ = request
        data = self.storage.read(
            self.shards[shard].name, start=start, end=end, generation=self._generations[shard]
        )
        if len(data) != end - start:
            raise BatchpilotError(
                join_uri(self.storage.uri, self.shards[shard].name),
                f"returned {len(data)} bytes for range [{start}, {end})",
                "the shard is truncated; re-run batchpilot data prepare",
            )
        with self._counter_lock:
            self.num_requests += 1
            self.num_bytes_fetched += len(data)
        return data

    def _segments(self, out: int, start: int, end: int) -> list[_Segment]:
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"token range [{start}, {end}) outside split of {self.num_tokens} tokens")
        segments = []
        shard = bisect.bisect_right(self._starts, start) - 1
        position = start
        while position < end:
            shard_end = min(end, self._starts[shard + 1])
            offset = position - self._starts[shard]
            size = self.dtype.itemsize
            segments.append(
                _Segment(
                    shard=shard,
                    start=HEADER_BYTES + offset * size,
                    end=HEADER_BYTES + (offset + shard_end - position) * size,
                    out=out,
                    out_offset=position - start,
                )
            )
            position = shard_end
            shard += 1
        return segments


def _coalesce(segments: list[_Segment], *, gap_bytes: int) -> list[tuple[int, int, int, list[_Segment]]]:
    """Groups segments into requests `(shard, start, end, members)` over nearby bytes of one shard."""
    requests: list[tuple[int, int, int, list[_Segment]]] = []
    for seg in sorted(segments, key=lambda s: (s.shard, s.start)):
        if requests:
            shard, start, end, members = requests[-1]
            near = seg.shard == shard and seg.start - end <= gap_bytes
            if near and max(end, seg.end) - start <= MAX_REQUEST_BYTES:
                requests[-1] = (shard, start, max(end, seg.end), [*members, seg])
                continue
        requests.append((seg.shard, seg.start, seg.end, [seg]))
    return requests


def _check_shard(storage: Storage, shard: ShardEntry, dtype: str, *, verify_checksums: bool) -> int:
    """Checks one shard against the manifest and returns the generation to pin."""
    uri = join_uri(storage.uri, shard.name)
    try:
        info: ObjectInfo = storage.stat(shard.name)
    except ObjectNotFound:
        raise BatchpilotError(
            uri, "is listed in the manifest but does not exist", "re-run batchpilot data prepare"
        ) from None
    if info.size_bytes != shard.num_bytes:
        raise BatchpilotError(
            uri,
            f"is {info.size_bytes} bytes, the manifest says {shard.num_bytes}",
            "re-run batchpilot data prepare",
        )
    checksum = info.crc32c
    if verify_checksums and checksum is None:
        data = storage.read(shard.name, generation=info.generation)
        checksum, header = crc32c(data), data[:HEADER_BYTES]
    else:
        header = storage.read(shard.name, end=HEADER_BYTES, generation=info.generation)
    if verify_checksums and checksum != shard.crc32c:
        raise BatchpilotError(
            uri,
            f"is corrupted: CRC32C {checksum:08x} does not match the manifest's {shard.crc32c:08x}",
            "re-run batchpilot data prepare --force",
        )
    header_dtype, num_tokens = decode_header(header, uri=uri)
    if header_dtype != dtype:
        raise BatchpilotError(
            uri, f"holds {header_dtype} tokens but the manifest says {dtype}", "re-run prepare"
        )
    if num_tokens != shard.num_tokens:
        raise BatchpilotError(uri, f"holds {num_tokens} tokens but the manifest says {shard.num_tokens}")
    return info.generation
