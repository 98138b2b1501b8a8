"""Corpus readers for `data prepare`: text files, JSON Lines, Parquet and `datasets` folders, local or on GCS.

Every input becomes a list of `Source`s (one object each) in a fixed order: inputs are sorted by path (a
`save_to_disk` folder sorts as one input and keeps its `state.json` file order), so the same inputs always
give the same documents in the same order. Reading streams each object through bounded buffers: JSON
Lines line by line (gzip and zstd decompressed as a stream), Parquet by record batches, Arrow IPC streams
batch by batch, and GCS objects in ranged reads of `READ_CHUNK_BYTES` pinned to the generation listed, so
an object rewritten while it is read is an error instead of a mix of two versions.

Empty documents are skipped in every format (each would add a lone end-of-document token).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from batchpilot.errors import BatchpilotError
from batchpilot.storage import Storage, join_uri, open_storage

FORMATS = ("auto", "text", "jsonl", "parquet", "hf-dataset")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_PARQUET_SUFFIXES = (".parquet",)
# Bytes per read of an object (and per GCS request): the buffer each open input holds.
READ_CHUNK_BYTES = 8 * 2**20
# Rows per record batch read from Parquet (the rows of one batch are in memory at once).
_PARQUET_BATCH_ROWS = 1024
_EXTRA = "pip install 'batchpilot[corpora]'"

# A document: its text (bytes for whole text files, decoded by the tokenizer) and a name for messages.
Document = tuple[str | bytes, str]


@dataclass
class ByteCounter:
    """Input bytes read so far, over all sources (for the progress bar)."""

    num_bytes: int = 0


@dataclass(frozen=True)
class Source:
    """One input object.

    Attributes:
        uri: where it is, for messages (a local path or `gs://...`).
        format: `text` (the object is one document), `jsonl`, `parquet` or `arrow` (an IPC stream).
        size_bytes: its size when listed.
        name: the local path, or the object name in `storage`.
        storage: the GCS storage holding it; None for a local file.
        generation: the GCS generation listed, which every read is pinned to.
    """

    uri: str
    format: str
    size_bytes: int
    name: str
    storage: Storage | None = field(default=None, compare=False)
    generation: int | None = None

    def open(self, counter: ByteCounter) -> BinaryIO:
        """A buffered, seekable binary reader over the object, counting bytes into `counter`."""
        raw = _ObjectReader(self, counter)
        return io.BufferedReader(raw, buffer_size=READ_CHUNK_BYTES)

    def read_all(self, counter: ByteCounter) -> bytes:
        """The whole object (a text document)."""
        if self.storage is None:
            try:
                data = Path(self.name).read_bytes()
            except OSError as error:
                raise BatchpilotError(self.uri, f"cannot be read: {error.strerror}") from None
        else:
            data = self.storage.read(self.name, generation=self.generation)
        counter.num_bytes += len(data)
        return data


class _ObjectReader(io.RawIOBase):
    """Ranged reads of one local file (`pread`) or GCS object (pinned generation); seekable."""

    def __init__(self, source: Source, counter: ByteCounter) -> None:
        self._source = source
        self._counter = counter
        self._position = 0
        self._fd: int | None = None
        if source.storage is None:
            try:
                self._fd = os.open(source.name, os.O_RDONLY)
            except OSError as error:
                raise BatchpilotError(source.uri, f"cannot be read: {error.strerror}") from None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._source.size_bytes}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        end = min(self._position + len(buffer), self._source.size_bytes)
        if end <= self._position:
            return 0
        if self._fd is not None:
            data = os.pread(self._fd, end - self._position, self._position)
        else:
            assert self._source.storage is not None
            data = self._source.storage.read(
                self._source.name, start=self._position, end=end, generation=self._source.generation
            )
        buffer[: len(data)] = data
        self._position += len(data)
        self._counter.num_bytes += len(data)
        return len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


def format_of(name: str) -> str | None:
    """The format a file name's suffix says, or None (a text file, if picked by --glob)."""
    lower = name.lower()
    if lower.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


def _picked(relative: PurePosixPath, *, fmt: str, glob: str) -> str | None:
    """The format of a file found inside a folder, or None when the folder search leaves it out."""
    by_suffix = format_of(relative.name)
    if fmt == "auto":
        return by_suffix or ("text" if relative.match(glob) else None)
    if fmt == "text":
        return "text" if relative.match(glob) else None
    return fmt if by_suffix == fmt else None


def collect_sources(inputs: Sequence[str], *, glob: str = "*.txt", fmt: str = "auto") -> list[Source]:
    """The objects to read, in order: inputs sorted by path, a `save_to_disk` folder in its own file order.

    Args:
        inputs: local files or folders, `gs://bucket/object` or `gs://bucket/prefix`.
        glob: which files of a folder are text documents (formats with a suffix are found by it).
        fmt: `auto` (by suffix; a named file without a known suffix is text), or one format for all.
    """
    if fmt not in FORMATS:
        raise BatchpilotError("--format", f"is {fmt!r}", f"use one of {', '.join(FORMATS)}")
    units: dict[tuple[str, ...], list[Source]] = {}
    for text in inputs:
        units.update(_gcs_units(text, glob=glob, fmt=fmt) if text.startswith("gs://") else
                     _local_units(text, glob=glob, fmt=fmt))  # fmt: skip
    if not units:
        raise BatchpilotError("INPUT", "no input files given", "pass files or folders, or --demo")
    return [source for key in sorted(units) for source in units[key]]


def text_sources(paths: Sequence[Path]) -> list[Source]:
    """Local text files, one document each, in the order given."""
    return [_local_source(path, "text") for path in paths]


def _local_source(path: Path, fmt: str) -> Source:
    return Source(uri=str(path), format=fmt, size_bytes=path.stat().st_size, name=str(path))


def _named_file_format(name: str, fmt: str, uri: str) -> str:
    if fmt == "hf-dataset":
        raise BatchpilotError(uri, "is a file, not a save_to_disk folder", "pass the dataset's folder")
    return format_of(name) or "text" if fmt == "auto" else fmt


def _local_units(text: str, *, glob: str, fmt: str) -> dict[tuple[str, ...], list[Source]]:
    path = Path(text)
    if path.is_file():
        return {path.parts: [_local_source(path, _named_file_format(path.name, fmt, text))]}
    if not path.is_dir():
        raise BatchpilotError(text, "does not exist", "pass existing files or folders")
    if fmt in ("auto", "hf-dataset") and (path / "state.json").is_file():
        state = (path / "state.json").read_bytes()
        return {path.parts: [_local_source(path / name, "arrow") for name in _arrow_files(state, text)]}
    _refuse_dataset_dict((path / "dataset_dict.json").is_file(), text)
    if fmt == "hf-dataset":
        raise BatchpilotError(text, "has no state.json", "pass a folder written by Dataset.save_to_disk")
    units = {}
    for found in path.rglob("*"):
        relative = PurePosixPath(found.relative_to(path).as_posix())
        picked = _picked(relative, fmt=fmt, glob=glob)
        if picked and not found.name.startswith(".") and found.is_file():
            units[found.parts] = [_local_source(found, picked)]
    if not units:
        raise _no_files(text, fmt=fmt, glob=glob)
    return units


def _gcs_units(uri: str, *, glob: str, fmt: str) -> dict[tuple[str, ...], list[Source]]:
    bucket = uri.removeprefix("gs://").partition("/")[0]
    storage = open_storage(uri)
    names = [name for name in storage.list() if not name.endswith("/")]
    if not names:  # not a prefix: one object
        parent_uri, _, name = uri.rstrip("/").rpartition("/")
        if parent_uri == "gs:/":
            raise BatchpilotError(uri, "holds no objects", "pass a prefix or object that exists")
        parent = open_storage(parent_uri)
        info = parent.stat(name)
        source = Source(uri=uri, format=_named_file_format(name, fmt, uri), size_bytes=info.size_bytes,
                        name=name, storage=parent, generation=info.generation)  # fmt: skip
        return {("gs:", bucket, *uri.removeprefix("gs://").split("/")[1:]): [source]}
    key = ("gs:", *storage.uri.removeprefix("gs://").split("/"))
    if fmt in ("auto", "hf-dataset") and "state.json" in names:
        files = _arrow_files(storage.read("state.json"), uri)
        return {key: [_gcs_source(storage, name, "arrow") for name in files]}
    _refuse_dataset_dict("dataset_dict.json" in names, uri)
    if fmt == "hf-dataset":
        raise BatchpilotError(uri, "has no state.json", "pass a prefix written by Dataset.save_to_disk")
    units = {}
    for name in names:
        picked = _picked(PurePosixPath(name), fmt=fmt, glob=glob)
        if picked and not PurePosixPath(name).name.startswith("."):
            units[(*key, *name.split("/"))] = [_gcs_source(storage, name, picked)]
    if not units:
        raise _no_files(uri, fmt=fmt, glob=glob)
    return units


def _gcs_source(storage: Storage, name: str, fmt: str) -> Source:
    info = storage.stat(name)
    return Source(uri=join_uri(storage.uri, name), format=fmt, size_bytes=info.size_bytes, name=name,
                  storage=storage, generation=info.generation)  # fmt: skip


def _no_files(where: str, *, fmt: str, glob: str) -> BatchpilotError:
    wanted = {"auto": f"{glob!r}, *.jsonl[.gz|.zst] or *.parquet", "text": repr(glob),
              "jsonl": "*.jsonl[.gz|.zst]", "parquet": "*.parquet"}[fmt]  # fmt: skip
    return BatchpilotError(
        where, f"holds no files matching {wanted}", "pass --glob, e.g. --glob '*.md', or --format"
    )


def _refuse_dataset_dict(is_dict: bool, where: str) -> None:
    if is_dict:
        raise BatchpilotError(
            where, "is a DatasetDict (dataset_dict.json)", f"pass one split's folder, e.g. {where}/train"
        )


def _arrow_files(state_json: bytes, where: str) -> list[str]:
    """The `.arrow` files of a save_to_disk folder, in the order its state.json lists them."""
    try:
        files = [str(entry["filename"]) for entry in json.loads(state_json)["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise BatchpilotError(
            f"{where}/state.json", f"does not list the data files ({error})", "pass a save_to_disk folder"
        ) from None
    if not files:
        raise BatchpilotError(f"{where}/state.json", "lists no data files", "pass a save_to_disk folder")
    return files


def read_documents(sources: Sequence[Source], *, text_field: str, counter: ByteCounter) -> Iterator[Document]:
    """Every non-empty document of `sources`, in order."""
    readers: dict[str, Callable[[Source, str, ByteCounter], Iterator[Document]]] = {
        "text": _text_documents,
        "jsonl": _jsonl_documents,
        "parquet": _parquet_documents,
        "arrow": _arrow_documents,
    }
    for source in sources:
        yield from readers[source.format](source, text_field, counter)


def _text_documents(source: Source, text_field: str, counter: ByteCounter) -> Iterator[Document]:
    del text_field  # the whole file is the text
    data = source.read_all(counter)
    if data:
        yield data, source.uri


def _jsonl_documents(source: Source, text_field: str, counter: ByteCounter) -> Iterator[Document]:
    with source.open(counter) as raw:
        stream = _decompressed(raw, source)
        try:
            for number, line in enumerate(stream, start=1):
                text = _jsonl_text(line, text_field=text_field, where=f"{source.uri}:{number}")
                if text:
                    yield text, f"{source.uri}:{number}"
        except (OSError, EOFError, zlib.error) as error:  # gzip's truncated and corrupt streams
            raise BatchpilotError(
                source.uri,
                f"is not a complete gzip stream ({error})",
                "copy it again from its source, or drop the file",
            ) from None


def _jsonl_text(line: bytes, *, text_field: str, where: str) -> str | None:
    """The text of one JSON Lines record; None for a blank line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as error:
        detail = f"{error.msg} at column {error.colno}" if isinstance(error, json.JSONDecodeError) else error
        raise BatchpilotError(
            where, f"is not valid JSON ({detail})", "write one JSON object per line"
        ) from None
    if not isinstance(record, dict):
        raise BatchpilotError(
            where, f"is a JSON {type(record).__name__}, not an object", "write one JSON object per line"
        )
    if text_field not in record:
        present = ", ".join(map(repr, record)) or "none"
        raise BatchpilotError(
            where, f"has no field {text_field!r} (fields: {present})", "name the text field with --text-field"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise BatchpilotError(
            where,
            f"field {text_field!r} is a JSON {type(text).__name__}, not a string",
            "name the text field with --text-field",
        )
    return text


def _decompressed(raw: BinaryIO, source: Source) -> BinaryIO:
    lower = source.uri.lower()
    if lower.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if lower.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(raw, source.uri), buffer_size=READ_CHUNK_BYTES)
    return raw


class _ZstdReader(io.RawIOBase):
    """A streaming zstd decoder over any number of frames that refuses a stream ending inside a frame
    (zstandard's own `stream_reader` returns what it decoded and no error)."""

    def __init__(self, raw: BinaryIO, uri: str) -> None:
        zstandard = _require("zstandard", uri)
        self._raw = raw
        self._uri = uri
        self._context = zstandard.ZstdDecompressor()
        self._error = zstandard.ZstdError
        self._frame: Any = None  # the decompressobj of the frame being decoded
        self._pending = memoryview(b"")
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending and not self._done:
            self._fill()
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _fill(self) -> None:
        data = self._raw.read(2**20)
        if not data:
            if self._frame is not None:
                raise BatchpilotError(
                    self._uri,
                    "ends inside a zstd frame: the file is truncated",
                    "copy it again from its source",
                )
            self._done = True
            return
        output = []
        try:
            while data:
                if self._frame is None:
                    self._frame = self._context.decompressobj()
                output.append(self._frame.decompress(data))
                data = b""
                if self._frame.eof:
                    data, self._frame = self._frame.unused_data, None
        except self._error as error:
            raise BatchpilotError(
                self._uri,
                f"is not a valid zstd stream ({error})",
                "copy it again from its source, or drop the file",
            ) from None
        self._pending = memoryview(b"".join(output))


def _parquet_documents(source: Source, text_field: str, counter: ByteCounter) -> Iterator[Document]:
    pa = _require("pyarrow", source.uri)
    parquet = _require("pyarrow.parquet", source.uri)
    with source.open(counter) as raw:
        try:
            file = parquet.ParquetFile(raw)
            _check_column(file.schema_arrow, text_field, source.uri)
            batches = file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field])
            yield from _column_documents(batches, source.uri, text_field)
        except pa.lib.ArrowException as error:
            raise _unreadable(source.uri, "Parquet", error) from None


def _arrow_documents(source: Source, text_field: str, counter: ByteCounter) -> Iterator[Document]:
    pa = _require("pyarrow", source.uri)
    with source.open(counter) as raw:
        try:
            reader = pa.ipc.open_stream(raw)
            _check_column(reader.schema, text_field, source.uri)
            batches = (batch.select([text_field]) for batch in reader)
            yield from _column_documents(batches, source.uri, text_field)
        except pa.lib.ArrowException as error:
            raise _unreadable(source.uri, "Arrow IPC stream", error) from None


def _unreadable(uri: str, what: str, error: Exception) -> BatchpilotError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return BatchpilotError(uri, f"is not a readable {what} file ({detail})", "check or re-export the file")


def _check_column(schema: Any, text_field: str, uri: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        present = ", ".join(map(repr, schema.names)) or "none"
        raise BatchpilotError(
            uri,
            f"has no column {text_field!r} (columns: {present})",
            "name the text column with --text-field",
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise BatchpilotError(
            uri, f"column {text_field!r} holds {kind}, not strings", "name the text column with --text-field"
        )


def _column_documents(batches: Any, uri: str, text_field: str) -> Iterator[Document]:
    """The non-empty texts of the first column of each record batch; a null is an error naming its row."""
    row = 0
    for batch in batches:
        texts = batch.column(0).to_pylist()
        for offset, text in enumerate(texts):
            if text is None:
                raise BatchpilotError(
                    f"{uri} row {row + offset}",
                    f"column {text_field!r} is null, not a string",
                    "drop or fill the row",
                )
            if text:
                yield text, f"{uri} row {row + offset}"
        row += len(texts)


def _require(module: str, uri: str) -> Any:
    """Imports a package of the `corpora` extra, or one line saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.partition(".")[0]
        raise BatchpilotError(uri, f"reading it needs the `{package}` package", _EXTRA) from None
