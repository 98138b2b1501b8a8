"""Corpora -> token shards + manifest at a `file://` or `gs://` URI.

Documents come from `batchpilot.data.corpora` (text files, JSON Lines, Parquet, `datasets` folders) in a
fixed order, so the same inputs give the same shards; they are tokenized in batches on `workers`
processes and written back in that order. A deterministic, evenly spread `validation_fraction` of the
documents goes to the validation split. Shards are written first, then the tokenizer file (for a
tokenizer.json) and the manifest last, so a reader never sees a manifest naming an object that is not
fully written. A progress journal (`batchpilot.data.prepare_journal`) written after each shard lets an
interrupted run resume to the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import signal
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from batchpilot.data import prepare_journal as journals
from batchpilot.data.corpora import ByteCounter, Source, text_sources
from batchpilot.data.prepare_journal import JOURNAL_NAME, Journal
from batchpilot.data.shard_writer import IndexedReader, JournaledWriter, validation_of, write_noted
from batchpilot.data.shards import (
    MANIFEST_NAME,
    SPLITS,
    Manifest,
    ShardEntry,
    token_dtype,
)
from batchpilot.data.tokenizers import TOKENIZER_OBJECT, Tokenizer, encode_in_order
from batchpilot.errors import BatchpilotError
from batchpilot.storage import (
    LocalStorage,
    ObjectNotFound,
    Storage,
    StorageError,
    open_storage,
)

logger = logging.getLogger(__name__)
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


# Objects a prepare writes besides its journal and manifest: a journal's destination may hold these from
# a run killed before it noted them (or from the set a --force run was replacing); anything else is not ours.
_OWN_OBJECT = re.compile(r"(train|validation)-\d{5,}\.bin|" + re.escape(TOKENIZER_OBJECT))


def _claim_or_resume(
    storage: Storage, *, force: bool, settings: dict[str, Any], inputs: list[dict[str, Any]]
) -> tuple[list[str], dict[str, Any] | None]:
    """The objects already there, and the journal to resume from: a destination holding a journal and no
    manifest resumes unless `force` (partial objects its run did not journal are deleted first)."""
    existing = storage.list()
    if force or JOURNAL_NAME not in existing or MANIFEST_NAME in existing:
        existing = _claim_destination(storage, force=force)
        if JOURNAL_NAME in existing:  # the journal of shards about to be replaced must not outlive them
            storage.delete(JOURNAL_NAME)
        return existing, None
    journal = journals.read_journal(storage)
    journals.check_resumable(journal, settings=settings, inputs=inputs, uri=storage.uri)
    kept = {JOURNAL_NAME, *journals.shard_names(journal)}
    partial = [name for name in existing if name not in kept]
    foreign = [name for name in partial if not _OWN_OBJECT.fullmatch(name)]
    if foreign:
        raise BatchpilotError(
            storage.uri, f"holds {len(foreign)} object(s) that are not this prepare's (first: {foreign[0]})",
            "move them away to resume, or pass --force to start over",
        )  # fmt: skip
    for name in partial:
        storage.delete(name)
    return sorted(kept), journal


class PrepareInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped a prepare; `kept` says what is kept and how to go on, or is None."""

    def __init__(self, signal_name: str, kept: str | None) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.kept = kept


class PrepareStopped(BatchpilotError):
    """A BatchpilotError that stopped a prepare after shards were kept: one line with what to do next."""

    def __init__(self, error: BatchpilotError, *, kept: str) -> None:
        self.kept = kept
        super().__init__(error.field, error.problem, error.fix)

    def __str__(self) -> str:
        return f"{super().__str__()}; {self.kept}"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the run stops as it does on Ctrl-C."""


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM (a preemption, `kill`) raises `_Terminated` here instead of ending the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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

    After each full shard the progress journal (`prepare_journal`) is updated. A run that fails or is
    interrupted (Ctrl-C, SIGTERM) part-way keeps the journaled shards and the journal, and removes only
    partial objects; the same call then resumes where it stopped, and the shard set ends byte for byte as
    an uninterrupted run's. A bad document keeps only the shards that hold documents of the inputs before
    its own, so that input may be replaced. A run that fails before its first shard deletes what it wrote
    (and a local folder it created). With `force` it starts over and deletes what was there: that stopped
    being a shard set when its manifest was deleted, before the first shard was written.

    Args:
        inputs: `Source`s from `batchpilot.data.corpora.collect_sources`, or text files (one document
            each).
        out_uri: `file://path` or `gs://bucket/prefix`; must be empty (or hold an interrupted run's
            journal) unless `force`.
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

    Raises:
        PrepareStopped: a BatchpilotError after shards were kept, naming them and how to resume.
        PrepareInterrupted: Ctrl-C or SIGTERM, with what was kept.
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
    dtype = token_dtype(tokenizer.vocab_size)
    settings = journals.settings_fingerprint(
        tokenizer=tokenizer.describe(), vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
        dtype=dtype, text_field=text_field, shard_size_tokens=shard_size_tokens,
        validation_fraction=validation_fraction,
    )  # fmt: skip
    listed = journals.input_fingerprints(sources)
    created = _missing_folders(storage)
    existing, resumed = _claim_or_resume(storage, force=force, settings=settings, inputs=listed)
    written: list[str] = []  # every object this run wrote, or may have: removed again if nothing is kept
    writers = _writers(
        storage, dtype=dtype, shard_size_tokens=shard_size_tokens, force=force, written=written,
        resumed=resumed, validation_fraction=validation_fraction,
    )  # fmt: skip
    started = time.perf_counter()
    counter = ByteCounter()
    reader = IndexedReader(
        sources, text_field=text_field, counter=counter, batch_bytes=batch_bytes or _BATCH_BYTES,
        validation_fraction=validation_fraction,
        starts={split: writer.resume_document for split, writer in writers.items()},
    )  # fmt: skip
    journal = Journal(
        storage, settings=settings, inputs=listed, first_documents=reader.first_documents,
        splits=lambda: {split: writer.entries() for split, writer in writers.items()}, noted=written,
    )  # fmt: skip
    journal.stored = resumed
    for writer in writers.values():
        writer.on_shard = journal.shard_written
    try:
        with _sigterm_stops():
            num_documents = _write_shards(
                reader, writers=writers, tokenizer=tokenizer, dtype=dtype, workers=workers,
                validation_fraction=validation_fraction, counter=counter,
                total_bytes=sum(source.size_bytes for source in sources), show_progress=show_progress,
            )  # fmt: skip
            manifest = _finish_shard_set(
                storage=storage, writers=writers, written=written, tokenizer=tokenizer, dtype=dtype,
                num_documents=num_documents, validation_fraction=validation_fraction, force=force,
            )  # fmt: skip
    except BaseException as error:
        _stop(error, storage=storage, journal=journal, reader=reader, written=[*written, *existing],
              created=created, force=force, validation_fraction=validation_fraction)  # fmt: skip
        raise
    _remove_journal_and_leftovers(storage, existing=existing, manifest=manifest)
    if stats is not None:
        num_tokens = sum(manifest.num_tokens(split) for split in manifest.splits)
        seconds = time.perf_counter() - started
        stats.append(PrepareStats(num_documents, num_tokens, input_bytes=counter.num_bytes, seconds=seconds))
    return manifest


def _writers(
    storage: Storage, *, dtype: str, shard_size_tokens: int, force: bool, written: list[str],
    resumed: dict[str, Any] | None, validation_fraction: float,
) -> dict[str, JournaledWriter]:  # fmt: skip
    """Each split's writer, continuing after the shards of `resumed` (a journal) if given."""
    writers = {
        split: JournaledWriter(
            storage, split, dtype, shard_size_tokens, precondition=None if force else 0, pending=[],
            written=written,
        )
        for split in SPLITS
    }  # fmt: skip
    if resumed is not None:
        for split, writer in writers.items():
            writer.resume(journals.shard_entries(resumed, split))
        logger.info(
            f"resuming: {_kept_documents(resumed, validation_fraction):,} documents and "
            f"{journals.num_shards(resumed)} shards already prepared at {storage.uri}"
        )
    return writers


def _remove_journal_and_leftovers(storage: Storage, *, existing: list[str], manifest: Manifest) -> None:
    """After the manifest (a run stopped in between left a whole set): the journal, then what is left of a
    replaced shard set."""
    with contextlib.suppress(ObjectNotFound):
        storage.delete(JOURNAL_NAME)
    final = {MANIFEST_NAME, *(s.name for shards in manifest.splits.values() for s in shards)}
    if manifest.tokenizer.get("object") == TOKENIZER_OBJECT:  # a byte-level set replacing one drops it
        final.add(TOKENIZER_OBJECT)
    for name in sorted(set(existing) - final - {JOURNAL_NAME}):
        storage.delete(name)


def _kept_documents(journal: dict[str, Any], validation_fraction: float) -> int:
    return journals.kept_documents(journals.positions(journal), validation_fraction=validation_fraction)


def _stop(
    error: BaseException, *, storage: Storage, journal: Journal, reader: IndexedReader, written: list[str],
    created: list[Path], force: bool, validation_fraction: float,
) -> None:  # fmt: skip
    """Keeps the journaled shards of a stopped run and removes the rest; raises the error that says so.

    A bad document (a reader or tokenizer error naming it) keeps only shards holding documents of the inputs
    before its own, so that input may be replaced before resuming. Returns when nothing is kept (everything
    written is removed, as before the journal existed) and the caller re-raises `error`.
    """
    failed = reader.failed_input
    if failed is None and isinstance(error, BatchpilotError) and not isinstance(error, StorageError):
        failed = reader.input_of(error.field)  # a tokenizer error names its document
    before = reader.first_documents[failed] if failed is not None else None
    kept = journal.settle(before_document=before)
    if kept is None:
        _remove_partial(storage, written=written, created=created)
        if isinstance(error, _Terminated):
            raise PrepareInterrupted("SIGTERM", None) from None
        return
    keep = {JOURNAL_NAME, *journals.shard_names(kept)}
    with contextlib.suppress(StorageError):  # what is left is deleted when the run resumes
        _remove_partial(storage, written=[name for name in written if name not in keep], created=[])
    again = "run the same command without --force to resume, or with it" if force else (
        "run the same command again to resume, or add --force")  # fmt: skip
    line = (
        f"{_kept_documents(kept, validation_fraction):,} documents ({journals.num_shards(kept)} shards) are "
        f"kept at {storage.uri}: {again} to start over"
    )
    if isinstance(error, KeyboardInterrupt):
        raise PrepareInterrupted("SIGTERM" if isinstance(error, _Terminated) else "SIGINT", line) from None
    if isinstance(error, BatchpilotError):
        raise PrepareStopped(error, kept=line) from None


def _write_shards(
    reader: IndexedReader,
    *,
    writers: dict[str, JournaledWriter],
    tokenizer: Tokenizer,
    dtype: str,
    workers: int,
    validation_fraction: float,
    counter: ByteCounter,
    total_bytes: int,
    show_progress: bool,
) -> int:
    """Tokenizes the reader's batches and adds each document to its split's writer, in order; returns the
    number of documents (empty ones were skipped by the readers; those a resumed run skips count)."""
    columns = (
        TextColumn("prepare"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[documents]:,} docs  {task.fields[tokens]:,} tokens  {task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    num_tokens = 0
    started = time.perf_counter()
    batches = reader.batches()
    with (
        Progress(*columns, disable=not show_progress) as progress,
        contextlib.closing(encode_in_order(batches, tokenizer=tokenizer, dtype=dtype, workers=workers)) as encoded,
    ):  # fmt: skip
        task = progress.add_task("prepare", total=total_bytes, documents=0, tokens=0, rate="")
        for tokens, lengths in encoded:
            indices, _ = reader.pending.popleft()
            _add_runs(tokens, lengths, indices, validation_of(indices, validation_fraction), writers=writers)
            num_tokens += tokens.size
            rate = num_tokens / max(time.perf_counter() - started, 1e-9)
            progress.update(task, completed=min(counter.num_bytes, total_bytes), documents=int(indices[-1]) + 1,
                            tokens=num_tokens, rate=f"{rate:,.0f} tokens/s")  # fmt: skip
    num_documents = reader.num_documents
    num_validation = math.ceil(num_documents * Fraction(str(validation_fraction)))
    _check_documents(num_documents, num_validation=num_validation, validation_fraction=validation_fraction)
    return num_documents


def _add_runs(
    tokens: np.ndarray, lengths: np.ndarray, indices: np.ndarray, validation: np.ndarray, *,
    writers: dict[str, JournaledWriter],
) -> None:  # fmt: skip
    """Adds each run of consecutive documents of one split as one slice of `tokens`."""
    ends = np.cumsum(lengths)
    changes = np.flatnonzero(validation[1:] != validation[:-1]) + 1
    run_starts = [0, *changes.tolist()]
    run_ends = [*changes.tolist(), lengths.size]
    for first, stop in zip(run_starts, run_ends, strict=True):
        begin = int(ends[first - 1]) if first else 0
        split = "validation" if validation[first] else "train"
        writers[split].add_documents(
            tokens[begin : int(ends[stop - 1])], indices[first:stop], lengths[first:stop]
        )


def _finish_shard_set(
    *,
    storage: Storage,
    writers: dict[str, JournaledWriter],
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
