"""Megatron-LM indexed datasets (`PREFIX.bin` + `PREFIX.idx`) -> a batchpilot shard set, no re-tokenizing.

The `.idx` file (little-endian), as Megatron-LM's `IndexedDataset` writes it:

| bytes | field |
| --- | --- |
| 0-8 | magic `MMIDIDX\\x00\\x00` (9 bytes) |
| 9-16 | version, uint64 (1) |
| 17 | dtype code, uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 |
| 18-25 | sequence count n, uint64 |
| 26-33 | document count d, uint64 (one more than the documents: it holds both ends) |
| 34- | n int32 sequence lengths (tokens), n int64 sequence pointers (byte offsets into `.bin`), d int64 document indices (document k is sequences `[idx[k], idx[k+1])`; the first is 0, the last n) |

A multimodal dataset adds n int8 sequence modes at the end; those are refused. The `.bin` file is the
tokens of every sequence back to back. Documents are streamed from the `.bin` in ranged reads of at
most `_READ_BYTES`, so memory stays bounded whatever the size of the corpus.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from batchpilot.data.prepare import (
    _check_splits,
    _claim_destination,
    _missing_folders,
    _remove_partial,
)
from batchpilot.data.shard_writer import SplitWriter, is_validation, write_noted
from batchpilot.data.shards import MANIFEST_NAME, SPLITS, Manifest, token_dtype
from batchpilot.data.tokenizers import TOKENIZER_OBJECT
from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage, ObjectInfo, ObjectNotFound, Storage, join_uri, open_storage

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
# Largest ranged read of a .bin: bounds memory, and is few enough requests for GCS latency not to matter.
_READ_BYTES = 8 * 2**20


@dataclass(frozen=True)
class MegatronSource:
    """One `PREFIX.bin` + `PREFIX.idx` pair in a storage (a local folder or a GCS prefix)."""

    prefix: str
    storage: Storage
    stem: str

    @property
    def idx_name(self) -> str:
        return f"{self.stem}.idx"

    @property
    def bin_name(self) -> str:
        return f"{self.stem}.bin"

    def uri(self, name: str) -> str:
        return join_uri(self.storage.uri, name)


@dataclass(frozen=True)
class MegatronIndex:
    """The parsed `.idx` of one source, checked against its `.bin`.

    Attributes:
        dtype: the tokens' numpy dtype (little-endian).
        sequence_lengths: tokens per sequence (int32).
        document_bounds: token offset of each document's start, then the total (int64, d entries).
        bin_generation: the `.bin` version checked; reads of another one fail instead of mixing them.
    """

    dtype: np.dtype
    sequence_lengths: np.ndarray
    document_bounds: np.ndarray
    bin_generation: int

    @property
    def num_tokens(self) -> int:
        return int(self.document_bounds[-1])

    @property
    def num_documents(self) -> int:
        """Documents with at least one token (empty ones are skipped, as `prepare` skips empty files)."""
        return int(np.count_nonzero(np.diff(self.document_bounds)))


def open_source(prefix: str) -> MegatronSource:
    """The pair at a local path prefix, `file://` or `gs://bucket/path/prefix` (no `.bin`/`.idx`)."""
    if prefix.endswith((".bin", ".idx")):
        raise BatchpilotError(
            prefix, "names one file of the pair", f"pass the prefix without the extension: {prefix[:-4]}"
        )
    if prefix.startswith("gs://"):
        root, _, stem = prefix.rstrip("/").rpartition("/")
        if root == "gs:/" or not stem:
            raise BatchpilotError(prefix, "names no dataset prefix", "use gs://bucket/path/prefix")
        return MegatronSource(prefix=prefix, storage=open_storage(root), stem=stem)
    path = Path(prefix.removeprefix("file://")).absolute()
    return MegatronSource(prefix=prefix, storage=LocalStorage(path.parent), stem=path.name)


def read_index(source: MegatronSource) -> MegatronIndex:
    """Reads and checks `PREFIX.idx` and the size of `PREFIX.bin`; any mismatch is one error naming both."""
    idx_uri, bin_uri = source.uri(source.idx_name), source.uri(source.bin_name)
    data = _read_existing(source, source.idx_name)
    if len(data) < INDEX_HEADER.size:
        raise BatchpilotError(idx_uri, f"is {len(data)} bytes, shorter than a Megatron index header (34)")
    magic, version, code, num_sequences, num_doc_indices = INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC:
        raise BatchpilotError(
            idx_uri,
            f"is not a Megatron-LM index (magic {magic!r}, expected {INDEX_MAGIC!r})",
            "pass the prefix of a .bin/.idx pair written by Megatron-LM's preprocess_data.py",
        )
    if version != INDEX_VERSION:
        raise BatchpilotError(idx_uri, f"has index version {version}; batchpilot reads version 1")
    if DTYPE_CODES.get(code) not in {"uint8", "int8", "int16", "int32", "int64", "uint16"}:
        what = f"float dtype {DTYPE_CODES[code]}" if code in DTYPE_CODES else "unknown dtype code"
        raise BatchpilotError(idx_uri, f"has {what} ({code}); token ids must be integers")
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    expected = INDEX_HEADER.size + 12 * num_sequences + 8 * num_doc_indices
    if len(data) == expected + num_sequences and num_sequences:
        raise BatchpilotError(
            idx_uri, "holds sequence modes (a multimodal dataset)", "import text-only datasets"
        )
    if len(data) != expected:
        raise BatchpilotError(
            idx_uri,
            f"is {len(data):,} bytes; its header ({num_sequences:,} sequences, {num_doc_indices:,} document "
            f"indices) needs {expected:,}",
        )
    offset = INDEX_HEADER.size
    lengths = np.frombuffer(data, dtype="<i4", count=num_sequences, offset=offset)
    pointers = np.frombuffer(data, dtype="<i8", count=num_sequences, offset=offset + 4 * num_sequences)
    doc_indices = np.frombuffer(data, dtype="<i8", count=num_doc_indices, offset=offset + 12 * num_sequences)
    starts = _check_sequences(lengths, pointers, itemsize=dtype.itemsize, idx_uri=idx_uri)
    _check_documents(doc_indices, num_sequences=num_sequences, idx_uri=idx_uri)
    total_bytes = int(starts[-1]) * dtype.itemsize
    bin_info = _stat_existing(source, source.bin_name)
    bin_bytes = bin_info.size_bytes
    if bin_bytes != total_bytes:
        raise BatchpilotError(
            bin_uri,
            f"does not match {idx_uri}: idx says {total_bytes:,} bytes of tokens, bin holds {bin_bytes:,}",
        )
    return MegatronIndex(
        dtype=dtype,
        sequence_lengths=lengths,
        document_bounds=starts[doc_indices],
        bin_generation=bin_info.generation,
    )


def _check_sequences(lengths: np.ndarray, pointers: np.ndarray, *, itemsize: int, idx_uri: str) -> np.ndarray:
    """Token offsets of each sequence's start and of the end; the pointers must be those x itemsize."""
    if lengths.size and lengths.min() < 0:
        first = int(np.argmax(lengths < 0))
        raise BatchpilotError(idx_uri, f"gives sequence {first} a negative length ({int(lengths[first])})")
    starts = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    wrong = np.flatnonzero(pointers != starts[:-1] * itemsize)
    if wrong.size:
        first = int(wrong[0])
        raise BatchpilotError(
            idx_uri,
            f"points sequence {first} at byte {int(pointers[first]):,}, but the lengths before it put it at "
            f"{int(starts[first]) * itemsize:,} ({itemsize} byte(s) per token)",
        )
    return starts


def _check_documents(doc_indices: np.ndarray, *, num_sequences: int, idx_uri: str) -> None:
    """Document indices run from 0 to the sequence count, never going back."""
    if doc_indices.size == 0 or doc_indices[0] != 0 or doc_indices[-1] != num_sequences:
        ends = f"{int(doc_indices[0])} .. {int(doc_indices[-1])}" if doc_indices.size else "none"
        raise BatchpilotError(
            idx_uri, f"has document indices {ends}; they must run from 0 to the {num_sequences:,} sequences"
        )
    if np.any(np.diff(doc_indices) < 0):
        raise BatchpilotError(idx_uri, "has document indices that go back (not sorted)")


def _read_existing(source: MegatronSource, name: str) -> bytes:
    try:
        return source.storage.read(name)
    except ObjectNotFound as error:
        raise _missing(source, name, error) from None


def _stat_existing(source: MegatronSource, name: str) -> ObjectInfo:
    try:
        return source.storage.stat(name)
    except ObjectNotFound as error:
        raise _missing(source, name, error) from None


def _missing(source: MegatronSource, name: str, error: ObjectNotFound) -> BatchpilotError:
    if error.field != source.uri(name):  # the bucket or folder itself: keep storage's own message
        return error
    return BatchpilotError(
        source.uri(name), "does not exist", f"a Megatron-LM dataset is {source.stem}.bin + {source.stem}.idx"
    )


def document_pieces(
    source: MegatronSource, index: MegatronIndex, *, read_bytes: int = _READ_BYTES
) -> Iterator[tuple[int, np.ndarray, bool]]:
    """(document number, tokens, whether they end the document) for every non-empty document, in order.

    The `.bin` is read in ranges of at most `read_bytes`; a document longer than that comes in pieces.
    """
    bounds, itemsize = index.document_bounds, index.dtype.itemsize
    chunk_tokens = max(1, read_bytes // itemsize)
    document = 0
    for start in range(0, index.num_tokens, chunk_tokens):
        end = min(start + chunk_tokens, index.num_tokens)
        data = source.storage.read(
            source.bin_name, start=start * itemsize, end=end * itemsize, generation=index.bin_generation
        )
        if len(data) != (end - start) * itemsize:
            raise BatchpilotError(
                source.uri(source.bin_name),
                f"returned {len(data):,} bytes for [{start * itemsize:,}, {end * itemsize:,})",
                "it changed while being imported; run again",
            )
        tokens = np.frombuffer(data, dtype=index.dtype)
        position = start
        while position < end:
            while bounds[document + 1] <= position:  # also steps over empty documents
                document += 1
            stop = min(end, int(bounds[document + 1]))
            yield document, tokens[position - start : stop - start], stop == bounds[document + 1]
            position = stop


@dataclass(frozen=True)
class Vocabulary:
    """What the imported ids mean: their range, the end-of-document id, and the tokenizer (if known).

    Attributes:
        vocab_size: every id must be below it.
        eos_token_id: the manifest's end-of-document token (appended with `append_eod`).
        describe: tokenizer fields for the manifest, e.g. a tokenizer.json's name and SHA-256.
        tokenizer_json: that file's bytes, stored beside the shards as `tokenizer.json`.
    """

    vocab_size: int
    eos_token_id: int
    describe: dict[str, Any]
    tokenizer_json: bytes | None = None


@dataclass(frozen=True)
class ImportResult:
    manifest: Manifest
    num_documents: int
    num_tokens: int
    num_documents_ending_with_eos: int  # in the source, before any appended token


def import_megatron(
    *,
    prefixes: Sequence[str],
    out_uri: str,
    vocabulary: Vocabulary,
    shard_size_tokens: int,
    validation_fraction: float,
    append_eod: bool = False,
    force: bool = False,
    show_progress: bool = True,
) -> ImportResult:
    """Copies the documents of `prefixes`, in order, into a shard set at `out_uri`; the manifest last.

    Every source's index is read and checked against its `.bin` before anything is written. Splits,
    shard cutting, `force` and the cleanup of a failed or interrupted run are those of `prepare`.

    Args:
        prefixes: Megatron-LM dataset prefixes (see `open_source`).
        out_uri: `file://path` or `gs://bucket/prefix`; must be empty unless `force`.
        vocabulary: id range, end-of-document id and tokenizer of the tokens.
        shard_size_tokens: tokens per shard (the last shard of a split may hold fewer).
        validation_fraction: share of documents for the validation split, in [0, 0.5].
        append_eod: append `eos_token_id` to every document that does not already end with it.
        force: replace whatever is at `out_uri`.
        show_progress: draw a progress bar over the tokens.

    Returns:
        The manifest written and what was imported.
    """
    if shard_size_tokens < 2:
        raise BatchpilotError("--shard-size-tokens", f"must be at least 2, got {shard_size_tokens}")
    if not 0 <= validation_fraction <= 0.5:
        raise BatchpilotError(
            "--validation-fraction", f"must be between 0 and 0.5, got {validation_fraction}"
        )
    if not 0 <= vocabulary.eos_token_id < vocabulary.vocab_size:
        raise BatchpilotError(
            "--eos-token-id", f"{vocabulary.eos_token_id} is not below --vocab-size {vocabulary.vocab_size}"
        )
    sources = [open_source(prefix) for prefix in prefixes]
    indexes = [read_index(source) for source in sources]
    num_documents = sum(index.num_documents for index in indexes)
    if num_documents and all(is_validation(i, validation_fraction) for i in range(num_documents)):
        raise BatchpilotError(
            "PREFIX",
            f"{num_documents} non-empty document(s) all go to the validation split "
            f"(--validation-fraction {validation_fraction} holds out at least one), leaving no training data",
            "import more documents, or pass --validation-fraction 0 to train on them all",
        )
    storage = open_storage(out_uri)
    created = _missing_folders(storage)
    existing = _claim_destination(storage, force=force)
    written: list[str] = []  # every object this run wrote, or may have: removed again if it fails
    try:
        result = _write_shard_set(
            list(zip(sources, indexes, strict=True)), storage=storage, written=written,
            vocabulary=vocabulary, shard_size_tokens=shard_size_tokens,
            validation_fraction=validation_fraction, append_eod=append_eod, force=force,
            show_progress=show_progress,
        )  # fmt: skip
    except BaseException:
        _remove_partial(storage, written=[*written, *existing], created=created)
        raise
    for name in sorted(set(existing) - set(written)):  # leftovers of the replaced shard set
        storage.delete(name)
    return result


def _write_shard_set(
    pairs: list[tuple[MegatronSource, MegatronIndex]],
    *,
    storage: Storage,
    written: list[str],
    vocabulary: Vocabulary,
    shard_size_tokens: int,
    validation_fraction: float,
    append_eod: bool,
    force: bool,
    show_progress: bool,
) -> ImportResult:
    """Every split's shards, the tokenizer.json if any, then the manifest."""
    dtype = token_dtype(vocabulary.vocab_size)
    precondition = None if force else 0
    writers = {
        split: SplitWriter(
            storage, split, dtype, shard_size_tokens, precondition, pending=[], written=written
        )
        for split in SPLITS
    }
    eos = np.array([vocabulary.eos_token_id], dtype=np.uint32)
    counts = {"documents": 0, "tokens": 0, "ending_with_eos": 0}
    columns = (
        TextColumn("import"),
        BarColumn(),
        TextColumn("{task.fields[documents]:,} documents, {task.completed:,.0f} / {task.total:,.0f} tokens"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        task = progress.add_task("import", total=sum(index.num_tokens for _, index in pairs), documents=0)
        for source, index in pairs:
            for document, tokens, ends in document_pieces(source, index):
                _check_ids(tokens, vocab_size=vocabulary.vocab_size, source=source, document=document)
                number = counts["documents"]
                split = "validation" if is_validation(number, validation_fraction) else "train"
                writers[split].add(tokens)
                counts["tokens"] += tokens.size
                if ends:
                    counts["documents"] += 1
                    if tokens[-1] == vocabulary.eos_token_id:
                        counts["ending_with_eos"] += 1
                    elif append_eod:
                        writers[split].add(eos)
                        counts["tokens"] += 1
                progress.update(task, advance=tokens.size, documents=counts["documents"])
    splits = {split: writer.finish() for split, writer in writers.items()}
    _check_splits(splits, validation_fraction=validation_fraction, num_documents=counts["documents"])
    tokenizer = {
        "kind": "megatron",
        "sources": [source.prefix for source, _ in pairs],
        "source_dtypes": [index.dtype.name for _, index in pairs],
        "eod_appended": append_eod,
        **vocabulary.describe,
    }
    if vocabulary.tokenizer_json is not None:
        write_noted(
            storage, TOKENIZER_OBJECT, vocabulary.tokenizer_json, precondition=precondition, noted=written
        )
    manifest = Manifest(
        dtype=dtype,
        vocab_size=vocabulary.vocab_size,
        eos_token_id=vocabulary.eos_token_id,
        tokenizer=tokenizer,
        splits={split: shards for split, shards in splits.items() if shards},
    )
    write_noted(storage, MANIFEST_NAME, manifest.to_json().encode(), precondition=precondition, noted=written)
    return ImportResult(
        manifest=manifest,
        num_documents=counts["documents"],
        num_tokens=counts["tokens"],
        num_documents_ending_with_eos=counts["ending_with_eos"],
    )


def _check_ids(tokens: np.ndarray, *, vocab_size: int, source: MegatronSource, document: int) -> None:
    """Every id in [0, vocab_size); the first one outside names its document."""
    bad = np.flatnonzero((tokens >= vocab_size) | (tokens < 0))
    if bad.size:
        raise BatchpilotError(
            source.uri(source.bin_name),
            f"document {document} holds token id {int(tokens[bad[0]])}, outside the vocabulary "
            f"(--vocab-size {vocab_size})",
            "pass the vocabulary size (or --tokenizer) the dataset was tokenized with",
        )
