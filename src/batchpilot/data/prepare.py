"""Text files -> token shards + manifest at a `file://` or `gs://` URI.

Documents are whole input files, taken in sorted path order so the same inputs give the same shards. A
deterministic, evenly spread `validation_fraction` of the documents goes to the validation split.
Shards are written first and the manifest last, so a reader never sees a manifest naming a shard that is
not fully written.
"""

from __future__ import annotations

import contextlib
import math
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

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
from batchpilot.data.tokenizers import Tokenizer
from batchpilot.errors import BatchpilotError

# Documents are tokenized in batches of about this many bytes (bounds memory, amortises tokenizer calls).
_BATCH_BYTES = 4 * 2**20
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
        self.pending.append(tokens.astype(self.dtype))
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


def _document_batches(files: Sequence[Path]) -> Iterator[list[tuple[Path, bytes]]]:
    batch: list[tuple[Path, bytes]] = []
    size = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise BatchpilotError(str(path), f"cannot be read: {error.strerror}") from None
        if data:  # an empty file would add a lone end-of-document token
            batch.append((path, data))
            size += len(data)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


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


def prepare(
    *,
    inputs: Sequence[Path],
    out_uri: str,
    tokenizer: Tokenizer,
    shard_size_tokens: int,
    validation_fraction: float,
    force: bool = False,
    show_progress: bool = True,
) -> Manifest:
    """Tokenizes `inputs` into shards at `out_uri` and writes the manifest last.

    A run that fails or is interrupted (Ctrl-C) part-way deletes what it wrote (and a local folder it
    created), so the same command can simply be run again. With `force` it deletes what was there too:
    that stopped being a shard set when its manifest was deleted, before the first shard was written.

    Args:
        inputs: text files; each is one document.
        out_uri: `file://path` or `gs://bucket/prefix`; must be empty unless `force`.
        tokenizer: see `batchpilot.data.tokenizers.load_tokenizer`.
        shard_size_tokens: tokens per shard (the last shard of a split may hold fewer).
        validation_fraction: share of documents for the validation split, in [0, 0.5].
        force: replace whatever is at `out_uri`.
        show_progress: draw a progress bar over the input bytes.

    Returns:
        The manifest written.
    """
    if shard_size_tokens < 2:
        raise BatchpilotError("--shard-size-tokens", f"must be at least 2, got {shard_size_tokens}")
    if not 0 <= validation_fraction <= 0.5:
        raise BatchpilotError(
            "--validation-fraction", f"must be between 0 and 0.5, got {validation_fraction}"
        )
    _check_documents(inputs, validation_fraction=validation_fraction)
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
    try:
        manifest = _write_shard_set(
            inputs, storage=storage, writers=writers, written=written, tokenizer=tokenizer, dtype=dtype,
            validation_fraction=validation_fraction, force=force, show_progress=show_progress,
        )  # fmt: skip
    except BaseException:
        _remove_partial(storage, written=[*written, *existing], created=created)
        raise
    for name in sorted(set(existing) - set(written)):  # leftovers of the replaced shard set
        storage.delete(name)
    return manifest


def _write_shard_set(
    inputs: Sequence[Path],
    *,
    storage: Storage,
    writers: dict[str, _SplitWriter],
    written: list[str],
    tokenizer: Tokenizer,
    dtype: str,
    validation_fraction: float,
    force: bool,
    show_progress: bool,
) -> Manifest:
    """Every split's shards, then the manifest; notes each object in `written` before writing it."""
    total_bytes = sum(path.stat().st_size for path in inputs)
    columns = (
        TextColumn("prepare"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    document_index = 0
    with Progress(*columns, disable=not show_progress) as progress:
        task = progress.add_task("prepare", total=total_bytes)
        for batch in _document_batches(inputs):
            encoded = tokenizer.encode_documents(
                [data for _, data in batch], names=[str(p) for p, _ in batch]
            )
            for tokens in encoded:
                split = "validation" if is_validation(document_index, validation_fraction) else "train"
                writers[split].add(tokens)
                document_index += 1
            progress.advance(task, sum(len(data) for _, data in batch))
    splits = {split: writer.finish() for split, writer in writers.items()}
    _check_splits(splits, validation_fraction=validation_fraction, num_documents=document_index)
    manifest = Manifest(
        dtype=dtype,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        tokenizer=tokenizer.describe(),
        splits={split: shards for split, shards in splits.items() if shards},
    )
    manifest_bytes = manifest.to_json().encode()
    write_noted(storage, MANIFEST_NAME, manifest_bytes, precondition=None if force else 0, noted=written)
    return manifest


def _check_documents(inputs: Sequence[Path], *, validation_fraction: float) -> None:
    """Refuses, before anything is written, inputs whose every document would go to validation."""
    num_documents = sum(1 for path in inputs if path.stat().st_size > 0)  # empty files are skipped
    if num_documents and all(is_validation(i, validation_fraction) for i in range(num_documents)):
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
