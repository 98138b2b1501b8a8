"""Corpora -> token shards + manifest at a `file://` or `gs://` URI.

Documents come from `batchpilot.data.corpora` (text files, JSON Lines, Parquet, `datasets` folders) in a
fixed order, so the same inputs give the same shards; they are tokenized in batches on `workers`
processes and written back in that order. A deterministic, evenly spread `validation_fraction` of the
documents goes to the validation split. Shards are written first, then the tokenizer file (for a
tokenizer.json) and the manifest last, so a reader never sees a manifest naming an object that is not
fully written.
"""

from __future__ import annotations

import contextlib
import math
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from batchpilot.data.corpora import ByteCounter, Document, Source, read_documents, text_sources
from batchpilot.data.shards import (
    MANIFEST_NAME,
    SPLITS,
    Manifest,
    ShardEntry,
    crc32c,
    encode_shard,
    token_dtype,
)
from batchpilot.data.storage import (
    LocalStorage,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    open_storage,
)
from batchpilot.data.tokenizers import TOKENIZER_OBJECT, DocumentBatch, Tokenizer, encode_in_order
from batchpilot.errors import BatchpilotError

# Documents are tokenized in batches of about this many bytes (characters for decoded text): bounds memory
# (2 x workers batches are in flight), amortises tokenizer calls and inter-process messages.
_BATCH_BYTES = 2**20
# Folders of the standard library left out of the demo corpus: tests hold deliberately broken files.
_DEMO_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"})


def demo_inputs() -> list[Path]:
    """The Python standard library's own `.py` files (about 11 MB on CPython 3.11): real text, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not _DEMO_EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    if not files:
        raise BatchpilotError("--demo", f"found no .py files under {root}", "pass input files instead")
    return sorted(files)


def collect_inputs(paths: Sequence[str], *, glob: str) -> list[Path]:
    """Files named directly, plus files matching `glob` anywhere under named folders, sorted."""
    files: set[Path] = set()
    for text in paths:
        path = Path(text)
        if path.is_file():
            files.add(path)
        elif path.is_dir():
            found = [p for p in path.rglob(glob) if p.is_file() and not p.name.startswith(".")]
            if not found:
                raise BatchpilotError(
                    text, f"holds no files matching {glob!r}", "pass --glob, e.g. --glob '*.md'"
                )
            files.update(found)
        else:
            raise BatchpilotError(text, "does not exist", "pass existing text files or folders")
    if not files:
        raise BatchpilotError("INPUT", "no input files given", "pass files or folders, or --demo")
    return sorted(files)


def is_validation(document_index: int, validation_fraction: float) -> bool:
    """Evenly spread: the first n documents hold exactly ceil(n x fraction) validation documents.

    So any fraction > 0 holds out at least the first document, and small corpora still get a split.
    """
    fraction = Fraction(str(validation_fraction))
    return math.ceil((document_index + 1) * fraction) > math.ceil(document_index * fraction)


@dataclass
class _SplitWriter:
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


def _document_batches(documents: Iterator[Document], *, batch_bytes: int) -> Iterator[DocumentBatch]:
    """Consecutive documents in batches of about `batch_bytes` (the last may be smaller)."""
    texts: list[str | bytes] = []
    names: list[str] = []
    size = 0
    for text, name in documents:
        texts.append(text)
        names.append(name)
        size += len(text)
        if size >= batch_bytes:
            yield texts, names
            texts, names, size = [], [], 0
    if texts:
        yield texts, names


def validation_mask(first_index: int, num_documents: int, validation_fraction: float) -> np.ndarray:
    """`is_validation` of documents `first_index ...` at once (integer arithmetic on the exact fraction)."""
    fraction = Fraction(str(validation_fraction))
    index = np.arange(first_index, first_index + num_documents, dtype=np.int64)
    # ceil(i x p / q) = -((-i x p) // q)
    before = -((-index * fraction.numerator) // fraction.denominator)
    after = -((-(index + 1) * fraction.numerator) // fraction.denominator)
    return np.asarray(after > before)


def _claim_destination(storage: Storage, *, force: bool) -> list[str]:
    """Refuses a non-empty destination unless `force`; returns the objects already there."""
    existing = storage.list()
    if existing and not force:
        what = "a shard set" if MANIFEST_NAME in existing else f"{len(existing)} object(s)"
        raise BatchpilotError(
            storage.uri, f"already holds {what}", "pass --force to replace it, or choose another --out"
        )
    if MANIFEST_NAME in existing:
        # Readers must not find the old manifest naming shards that are being replaced.
        storage.delete(MANIFEST_NAME)
    return existing


@dataclass(frozen=True)
class PrepareStats:
    """What a prepare read and wrote, for the closing line."""

    num_documents: int
    num_tokens: int
    input_bytes: int
    seconds: float


def prepare(
    *,
    inputs: Sequence[Path | Source],
    out_uri: str,
    tokenizer: Tokenizer,
    shard_size_tokens: int,
    validation_fraction: float,
    text_field: str = "text",
    workers: int = 1,
    batch_bytes: int | None = None,
    force: bool = False,
    show_progress: bool = True,
    stats: list[PrepareStats] | None = None,
) -> Manifest:
    """Tokenizes `inputs` into shards at `out_uri` and writes the manifest last.

    A run that fails or is interrupted (Ctrl-C) part-way deletes what it wrote (and a local folder it
    created), so the same command can simply be run again. With `force` it deletes what was there too:
    that stopped being a shard set when its manifest was deleted, before the first shard was written.

    Args:
        inputs: `Source`s from `batchpilot.data.corpora.collect_sources`, or text files (one document
            each).
        out_uri: `file://path` or `gs://bucket/prefix`; must be empty unless `force`.
        tokenizer: see `batchpilot.data.tokenizers.load_tokenizer`.
        shard_size_tokens: tokens per shard (the last shard of a split may hold fewer).
        validation_fraction: share of documents for the validation split, in [0, 0.5].
        text_field: the JSON field or column holding the text (JSON Lines, Parquet, datasets).
        workers: tokenizer processes; 1 tokenizes in this process. The output is the same for any count.
        batch_bytes: documents per tokenizer call, in bytes of text (default `_BATCH_BYTES`).
        force: replace whatever is at `out_uri`.
        show_progress: draw a progress bar (input bytes, documents, tokens, tokens/s).
        stats: if given, a `PrepareStats` is appended to it.

    Returns:
        The manifest written.
    """
    if shard_size_tokens < 2:
        raise BatchpilotError("--shard-size-tokens", f"must be at least 2, got {shard_size_tokens}")
    if not 0 <= validation_fraction <= 0.5:
        raise BatchpilotError(
            "--validation-fraction", f"must be between 0 and 0.5, got {validation_fraction}"
        )
    if workers < 1:
        raise BatchpilotError("--workers", f"must be at least 1, got {workers}")
    sources = [item for item in inputs if isinstance(item, Source)]
    sources += text_sources([item for item in inputs if not isinstance(item, Source)])
    storage = open_storage(out_uri)
    created = _missing_folders(storage)
    existing = _claim_destination(storage, force=force)
    dtype = token_dtype(tokenizer.vocab_size)
    written: list[str] = []  # every object this run wrote, or may have: removed again if it fails
    writers = {
        split: _SplitWriter(
            storage, split, dtype, shard_size_tokens, precondition=None if force else 0, pending=[],
            written=written,
        )
        for split in SPLITS
    }  # fmt: skip
    started = time.perf_counter()
    counter = ByteCounter()
    try:
        num_documents = _write_shards(
            _document_batches(
                read_documents(sources, text_field=text_field, counter=counter),
                batch_bytes=batch_bytes or _BATCH_BYTES,
            ),
            writers=writers, tokenizer=tokenizer, dtype=dtype, workers=workers,
            validation_fraction=validation_fraction, counter=counter,
            total_bytes=sum(source.size_bytes for source in sources), show_progress=show_progress,
        )  # fmt: skip
        manifest = _finish_shard_set(
            storage=storage, writers=writers, written=written, tokenizer=tokenizer, dtype=dtype,
            num_documents=num_documents, validation_fraction=validation_fraction, force=force,
        )  # fmt: skip
    except BaseException:
        _remove_partial(storage, written=[*written, *existing], created=created)
        raise
    for name in sorted(set(existing) - set(written)):  # leftovers of the replaced shard set
        storage.delete(name)
    if stats is not None:
        num_tokens = sum(manifest.num_tokens(split) for split in manifest.splits)
        seconds = time.perf_counter() - started
        stats.append(PrepareStats(num_documents, num_tokens, input_bytes=counter.num_bytes, seconds=seconds))
    return manifest


def _write_shards(
    batches: Iterator[DocumentBatch],
    *,
    writers: dict[str, _SplitWriter],
    tokenizer: Tokenizer,
    dtype: str,
    workers: int,
    validation_fraction: float,
    counter: ByteCounter,
    total_bytes: int,
    show_progress: bool,
) -> int:
    """Tokenizes `batches` and adds each document to its split's writer, in order; returns the number of
    documents (empty ones were skipped by the readers)."""
    columns = (
        TextColumn("prepare"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[documents]:,} docs  {task.fields[tokens]:,} tokens  {task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    num_documents = num_validation = num_tokens = 0
    started = time.perf_counter()
    with (
        Progress(*columns, disable=not show_progress) as progress,
        contextlib.closing(encode_in_order(batches, tokenizer=tokenizer, dtype=dtype, workers=workers)) as encoded,
    ):  # fmt: skip
        task = progress.add_task("prepare", total=total_bytes, documents=0, tokens=0, rate="")
        for tokens, lengths in encoded:
            validation = validation_mask(num_documents, lengths.size, validation_fraction)
            _add_runs(tokens, lengths, validation, writers=writers)
            num_documents += lengths.size
            num_validation += int(validation.sum())
            num_tokens += tokens.size
            rate = num_tokens / max(time.perf_counter() - started, 1e-9)
            progress.update(task, completed=min(counter.num_bytes, total_bytes), documents=num_documents,
                            tokens=num_tokens, rate=f"{rate:,.0f} tokens/s")  # fmt: skip
    _check_documents(num_documents, num_validation=num_validation, validation_fraction=validation_fraction)
    return num_documents


def _add_runs(
    tokens: np.ndarray, lengths: np.ndarray, validation: np.ndarray, *, writers: dict[str, _SplitWriter]
) -> None:
    """Adds each run of consecutive documents of one split as one slice of `tokens`."""
    ends = np.cumsum(lengths)
    changes = np.flatnonzero(validation[1:] != validation[:-1]) + 1
    run_starts = [0, *changes.tolist()]
    run_ends = [*changes.tolist(), lengths.size]
    for first, stop in zip(run_starts, run_ends, strict=True):
        begin = int(ends[first - 1]) if first else 0
        split = "validation" if validation[first] else "train"
        writers[split].add(tokens[begin : int(ends[stop - 1])])


def _finish_shard_set(
    *,
    storage: Storage,
    writers: dict[str, _SplitWriter],
    written: list[str],
    tokenizer: Tokenizer,
    dtype: str,
    num_documents: int,
    validation_fraction: float,
    force: bool,
) -> Manifest:
    """The last shards, the tokenizer file, then the manifest; notes each object in `written` first."""
    splits = {split: writer.finish() for split, writer in writers.items()}
    _check_splits(splits, validation_fraction=validation_fraction, num_documents=num_documents)
    precondition = None if force else 0
    tokenizer_file = tokenizer.file_bytes()
    if tokenizer_file is not None:  # exported models (batchpilot export --format hf) copy it from here
        write_noted(storage, TOKENIZER_OBJECT, tokenizer_file, precondition=precondition, noted=written)
    manifest = Manifest(
        dtype=dtype,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        tokenizer=tokenizer.describe(),
        splits={split: shards for split, shards in splits.items() if shards},
    )
    manifest_bytes = manifest.to_json().encode()
    write_noted(storage, MANIFEST_NAME, manifest_bytes, precondition=precondition, noted=written)
    return manifest


def _check_documents(num_documents: int, *, num_validation: int, validation_fraction: float) -> None:
    """Refuses an empty corpus, and one whose every document went to validation (checked once tokenized:
    a streamed corpus has no document count up front; the failure removes what was written)."""
    if not num_documents:
        raise BatchpilotError(
            "INPUT", "holds no documents (every file, line or row read was empty)",
            "check the inputs, and --text-field for JSON Lines, Parquet and datasets",
        )  # fmt: skip
    if num_validation == num_documents:
        raise BatchpilotError(
            "INPUT",
            f"{num_documents} non-empty document(s) all go to the validation split "
            f"(--validation-fraction {validation_fraction} holds out at least one), leaving no training data",
            "add input files, or pass --validation-fraction 0 to train on them all",
        )


def _missing_folders(storage: Storage) -> list[Path]:
    """The local destination folder and those of its parents that do not exist yet, deepest first."""
    if not isinstance(storage, LocalStorage):
        return []
    folder = Path(storage.uri.removeprefix("file://"))
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


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


def _remove_partial(storage: Storage, *, written: list[str], created: list[Path]) -> None:
    """Deletes the objects a failed or interrupted run wrote or replaced (the manifest first), then the local
    folders it created."""
    for name in sorted(set(written), key=lambda name: (name != MANIFEST_NAME, name)):
        with contextlib.suppress(ObjectNotFound):
            storage.delete(name)
    for folder in created:
        with contextlib.suppress(OSError):  # not empty: something else is in there, leave it
            folder.rmdir()


def _check_splits(
    splits: dict[str, tuple[ShardEntry, ...]], *, validation_fraction: float, num_documents: int
) -> None:
    """Both splits need at least one sample's worth of data (two tokens) when asked for."""
    if sum(shard.num_tokens for shard in splits["train"]) < 2:
        raise BatchpilotError(
            "INPUT", f"{num_documents} non-empty document(s) leave no training data", "add input"
        )
    if validation_fraction > 0 and not splits["validation"]:
        raise BatchpilotError(
            "--validation-fraction",
            f"{validation_fraction} of {num_documents} document(s) selects none",
            f"add documents or raise it to at least {1 / max(num_documents, 1):.3g}",
        )
