"""The pieces `data prepare` (and `data import-megatron`) write shards with: a split's shard writer (full shards
of `shard_tokens`, each written atomically with its CRC32C), the journaled writer that records where a
resumed run picks up, the reader that numbers documents in their fixed order, and the deterministic
validation split of those numbers.
"""

from __future__ import annotations

import collections
import math
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from batchpilot.data.corpora import ByteCounter, Document, Source, read_documents
from batchpilot.data.prepare_journal import Position
from batchpilot.data.shards import (
    ShardEntry,
    crc32c,
    encode_shard,
)
from batchpilot.data.tokenizers import DocumentBatch
from batchpilot.errors import BatchpilotError
from batchpilot.storage import (
    PreconditionFailed,
    Storage,
    StorageError,
)


def is_validation(document_index: int, validation_fraction: float) -> bool:
    """Evenly spread: the first n documents hold exactly ceil(n x fraction) validation documents.

    So any fraction > 0 holds out at least the first document, and small corpora still get a split.
    """
    fraction = Fraction(str(validation_fraction))
    return math.ceil((document_index + 1) * fraction) > math.ceil(document_index * fraction)


@dataclass
class SplitWriter:
    """Cuts one split's token stream into shards of exactly `shard_size_tokens` (the last may be shorter)."""

    storage: Storage
    split: str
    dtype: str
    shard_size_tokens: int
    precondition: int | None
    pending: list[np.ndarray]
    written: list[str]
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        self.shards: list[ShardEntry] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(np.asarray(tokens, dtype=self.dtype))  # no copy when the dtype is already right
        self.num_pending_tokens += tokens.size
        while self.num_pending_tokens >= self.shard_size_tokens:
            self._flush(self.shard_size_tokens)

    def finish(self) -> tuple[ShardEntry, ...]:
        if self.num_pending_tokens:
            self._flush(self.num_pending_tokens)
        return tuple(self.shards)

    def _flush(self, num_tokens: int) -> None:
        stream = np.concatenate(self.pending)
        self.pending = [stream[num_tokens:]]
        self.num_pending_tokens = stream.size - num_tokens
        data = encode_shard(stream[:num_tokens])
        name = f"{self.split}-{len(self.shards):05d}.bin"
        write_noted(self.storage, name, data, precondition=self.precondition, noted=self.written)
        self.shards.append(
            ShardEntry(name=name, num_tokens=num_tokens, num_bytes=len(data), crc32c=crc32c(data))
        )


@dataclass
class JournaledWriter(SplitWriter):
    """A `SplitWriter` that knows, after each full shard, where a resumed run picks up: the first document
    of its split whose tokens are not all written, and how many of them are (`resume_points`, one per full
    shard; the short last shard written by `finish` has none and is never journaled)."""

    on_shard: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.resume_points: list[Position] = []
        self.num_written_tokens = 0
        # Documents (global indices, start and end in the split's token stream) not yet all written.
        self._documents: collections.deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = collections.deque()
        self._num_stream_tokens = 0
        self._next_index = 0
        self._resume_at: Position = (0, 0)
        self._finishing = False

    @property
    def resume_document(self) -> int:
        """Documents of this split before this index are all in the shards written before this run."""
        return self._resume_at[0]

    def resume(self, entries: list[tuple[ShardEntry, Position]]) -> None:
        """Continues after the journaled shards: the next document's first tokens already written are dropped."""
        self.shards = [shard for shard, _ in entries]
        self.resume_points = [position for _, position in entries]
        self.num_written_tokens = sum(shard.num_tokens for shard in self.shards)
        self._resume_at = self.resume_points[-1] if entries else (0, 0)
        self._next_index = self._resume_at[0]
        self._num_stream_tokens = self.num_written_tokens - self._resume_at[1]

    def add_documents(self, tokens: np.ndarray, indices: np.ndarray, lengths: np.ndarray) -> None:
        """Consecutive documents of this split (`indices` global, `lengths` their token counts)."""
        ends = self._num_stream_tokens + np.cumsum(lengths)
        self._documents.append((indices, ends - lengths, ends))
        self._num_stream_tokens = int(ends[-1])
        self._next_index = int(indices[-1]) + 1
        document, num_written = self._resume_at
        if num_written:  # the first document after a resume: its first tokens are in the last shard
            if int(indices[0]) != document or int(lengths[0]) <= num_written:
                raise BatchpilotError(
                    "INPUT", f"document {document} is not the one the interrupted prepare left part-written",
                    "pass --force to start over",
                )  # fmt: skip
            tokens = tokens[num_written:]
            self._resume_at = (document, 0)
        self.add(tokens)

    def finish(self) -> tuple[ShardEntry, ...]:
        self._finishing = True
        return super().finish()

    def _flush(self, num_tokens: int) -> None:
        super()._flush(num_tokens)
        self.num_written_tokens += num_tokens
        if not self._finishing:
            self.resume_points.append(self._position())
            if self.on_shard is not None:
                self.on_shard()

    def _position(self) -> Position:
        written = self.num_written_tokens
        while self._documents and int(self._documents[0][2][-1]) <= written:
            self._documents.popleft()
        if not self._documents:
            return (self._next_index, 0)
        indices, starts, ends = self._documents[0]
        first = int(np.searchsorted(ends, written, side="right"))
        return (int(indices[first]), written - int(starts[first]))

    def entries(self) -> list[tuple[ShardEntry, Position]]:
        """The full shards written, with the position after each."""
        return list(zip(self.shards, self.resume_points, strict=False))


class IndexedReader:
    """Batches of documents with their global indices, leaving out those already in a resumed run's shards
    (a document of split s before s's resume position); notes where each input starts and which failed."""

    def __init__(
        self, sources: Sequence[Source], *, text_field: str, counter: ByteCounter, batch_bytes: int,
        validation_fraction: float, starts: dict[str, int],
    ) -> None:  # fmt: skip
        self._sources = sources
        self._text_field = text_field
        self._counter = counter
        self._batch_bytes = batch_bytes
        fraction = Fraction(str(validation_fraction))
        self._p, self._q = fraction.numerator, fraction.denominator
        self._starts = starts
        self.first_documents: list[int] = []  # the global index of each input's first document
        self.num_documents = 0
        self.failed_input: int | None = None  # an input whose reading failed (a bad document)
        # Per batch handed out and not yet taken back: its documents' global indices and names.
        self.pending: collections.deque[tuple[np.ndarray, list[str]]] = collections.deque()

    def batches(self) -> Iterator[DocumentBatch]:
        texts: list[str | bytes] = []
        names: list[str] = []
        indices: list[int] = []
        size = 0
        skip_below = max(self._starts.values(), default=0)
        for number, source in enumerate(self._sources):
            self.first_documents.append(self.num_documents)
            for text, name in self._documents_of(number, source):
                index = self.num_documents
                self.num_documents += 1
                if index < skip_below and index < self._starts[self._split_of(index)]:
                    continue  # its tokens are in the shards already
                texts.append(text)
                names.append(name)
                indices.append(index)
                size += len(text)
                if size >= self._batch_bytes:
                    yield self._handed_out(texts, names, indices)
                    texts, names, indices, size = [], [], [], 0
        if texts:
            yield self._handed_out(texts, names, indices)

    def input_of(self, name: str) -> int | None:
        """The input holding the pending document named `name` (a tokenizer error names it)."""
        for indices, names in self.pending:
            if name in names:
                return bisect_right(self.first_documents, int(indices[names.index(name)])) - 1
        return None

    def _documents_of(self, number: int, source: Source) -> Iterator[Document]:
        try:
            yield from read_documents([source], text_field=self._text_field, counter=self._counter)
        except BatchpilotError as error:
            if not isinstance(error, StorageError):  # a bad document, not a storage failure
                self.failed_input = number
            raise

    def _split_of(self, index: int) -> str:
        # is_validation with integers: ceil(i x p / q) = -((-i x p) // q)
        before, after = -((-index * self._p) // self._q), -((-(index + 1) * self._p) // self._q)
        return "validation" if after > before else "train"

    def _handed_out(self, texts: list[str | bytes], names: list[str], indices: list[int]) -> DocumentBatch:
        self.pending.append((np.asarray(indices, dtype=np.int64), names))
        return texts, names


def validation_mask(first_index: int, num_documents: int, validation_fraction: float) -> np.ndarray:
    """`is_validation` of documents `first_index ...` at once (integer arithmetic on the exact fraction)."""
    return validation_of(
        np.arange(first_index, first_index + num_documents, dtype=np.int64), validation_fraction
    )


def validation_of(index: np.ndarray, validation_fraction: float) -> np.ndarray:
    fraction = Fraction(str(validation_fraction))
    # ceil(i x p / q) = -((-i x p) // q)
    before = -((-index * fraction.numerator) // fraction.denominator)
    after = -((-(index + 1) * fraction.numerator) // fraction.denominator)
    return np.asarray(after > before)


def write_noted(
    storage: Storage, name: str, data: bytes, *, precondition: int | None, noted: list[str]
) -> None:
    """`storage.write`, with `name` noted first: a Ctrl-C between the object landing and the write
    returning still leaves it noted for removal. An object that was already there (`precondition` 0
    failed) is someone else's, and is not."""
    noted.append(name)
    try:
        storage.write(name, data, if_generation_match=precondition)
    except PreconditionFailed:
        noted.pop()
        raise
