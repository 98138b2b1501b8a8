"""Tokenizers for `prepare`: bytes by default, or a Hugging Face `tokenizer.json`.

Each appends its end-of-document token after every document, so samples that cross a document boundary
show the model where one text ends.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import multiprocessing
import os
import signal
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from batchpilot.errors import BatchpilotError

# The name of the tokenizer file's copy in a shard set (beside manifest.json).
TOKENIZER_OBJECT = "tokenizer.json"
# Special tokens tried, in order, as the end-of-document token of a tokenizer.json.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eos|>")


class Tokenizer(Protocol):
    """Text -> token ids."""

    vocab_size: int
    eos_token_id: int

    def encode_documents(
        self, documents: Sequence[str | bytes], *, names: Sequence[str], dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each document's token ids followed by the end-of-document token, all concatenated in `dtype`,
        and each document's token count (end-of-document token included).

        A document is a `str` or UTF-8 `bytes`; `names` (one per document, e.g. file paths) only serve
        error messages. One flat array per batch, not one per document: it is what crosses from a worker
        process (pickled as one buffer) and what the shard writer concatenates.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this tokenizer."""
        ...

    def file_bytes(self) -> bytes | None:
        """The tokenizer file to store in the shard set (`tokenizer.json`), or None."""
        ...


def _utf8(document: str | bytes, name: str) -> bytes:
    if isinstance(document, bytes):
        return document
    try:
        return document.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate from a JSON escape such as "\ud800"
        raise BatchpilotError(
            name, f"is not valid Unicode ({error.reason} at character {error.start})", "fix the text"
        ) from None


def _text(document: str | bytes, name: str) -> str:
    if isinstance(document, str):
        return document
    try:
        return document.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BatchpilotError(
            name,
            f"is not UTF-8 ({error.reason} at byte {error.start})",
            "convert it, or drop --tokenizer",
        ) from None


def _with_eos(flat_ids: np.ndarray, lengths: np.ndarray, *, eos_token_id: int, dtype: str) -> np.ndarray:
    """`flat_ids` with the end-of-document token inserted after each document (`lengths` include it)."""
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths) - 1
    body = np.ones(tokens.size, dtype=bool)
    body[ends] = False
    tokens[body] = flat_ids
    tokens[ends] = eos_token_id
    return tokens


class ByteTokenizer:
    """One token per byte (0-255) and 256 as end-of-document: no vocabulary file, any input decodes."""

    vocab_size = 257
    eos_token_id = 256

    def encode_documents(
        self, documents: Sequence[str | bytes], *, names: Sequence[str], dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        data = [_utf8(document, name) for document, name in zip(documents, names, strict=True)]
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data)) + 1
        flat = np.frombuffer(b"".join(data), dtype=np.uint8)
        return _with_eos(flat, lengths, eos_token_id=self.eos_token_id, dtype=dtype), lengths

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes"}

    def file_bytes(self) -> bytes | None:
        return None


class HuggingFaceTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package (install batchpilot[data]).

    Pickles as the file's bytes, so worker processes rebuild the same tokenizer.
    """

    def __init__(self, path: str, *, eos_token: str | None = None) -> None:
        file = Path(path)
        try:
            raw = file.read_bytes()
        except OSError as error:
            raise BatchpilotError(
                "--tokenizer", f"cannot load {path}: {error.strerror}", "pass a tokenizer.json file"
            ) from None
        self._load(raw, name=file.name, path=path, eos_token=eos_token)

    @classmethod
    def from_bytes(cls, raw: bytes, *, name: str, eos_token: str | None) -> HuggingFaceTokenizer:
        """The tokenizer of a tokenizer.json's bytes (what unpickling calls)."""
        tokenizer = cls.__new__(cls)
        tokenizer._load(raw, name=name, path=name, eos_token=eos_token)
        return tokenizer

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_huggingface, (self._raw, self._name, self.eos_token))

    def _load(self, raw: bytes, *, name: str, path: str, eos_token: str | None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise BatchpilotError(
                "--tokenizer", "needs the `tokenizers` package", "pip install 'batchpilot[data]'"
            ) from None
        try:
            self._tokenizer = HFTokenizer.from_str(raw.decode())
        except Exception as error:  # tokenizers raises plain Exception for a malformed file
            raise BatchpilotError(
                "--tokenizer", f"cannot load {path}: {error}", "pass a tokenizer.json file"
            ) from None
        self._raw = raw
        self._sha256 = hashlib.sha256(raw).hexdigest()
        self._name = name
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self.eos_token, self.eos_token_id = self._find_eos(eos_token, path=path)

    def _find_eos(self, eos_token: str | None, *, path: str) -> tuple[str, int]:
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token, int(token_id)
        if eos_token:
            raise BatchpilotError("--eos-token", f"{eos_token!r} is not a token of {path}")
        raise BatchpilotError(
            "--tokenizer",
            f"{path} has none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)})",
            "name one with --eos-token",
        )

    def encode_documents(
        self, documents: Sequence[str | bytes], *, names: Sequence[str], dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        texts = [_text(document, name) for document, name in zip(documents, names, strict=True)]
        try:
            # encode_batch_fast (tokenizers >= 0.21): the same ids as encode_batch, without character
            # offsets (about 15% faster); older releases have only encode_batch.
            encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
            encodings = encode(texts, add_special_tokens=False)
        except Exception:  # a str the Rust side refuses: a lone surrogate; name the document
            for text, name in zip(texts, names, strict=True):
                _utf8(text, name)
            raise
        ids = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
        flat = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()) - len(ids)
        )
        return _with_eos(flat, lengths, eos_token_id=self.eos_token_id, dtype=dtype), lengths

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "huggingface",
            "file": self._name,
            "sha256": self._sha256,
            "eos_token": self.eos_token,
            "object": TOKENIZER_OBJECT,
        }

    def file_bytes(self) -> bytes | None:
        return self._raw


def _rebuild_huggingface(raw: bytes, name: str, eos_token: str) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.from_bytes(raw, name=name, eos_token=eos_token)


def load_tokenizer(path: str | None, *, eos_token: str | None = None) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the tokenizer.json at `path`."""
    if path is None:
        if eos_token is not None:
            raise BatchpilotError("--eos-token", "only applies with --tokenizer", "drop --eos-token")
        return ByteTokenizer()
    return HuggingFaceTokenizer(path, eos_token=eos_token)


# A batch of documents and their names (for messages).
DocumentBatch = tuple[list[str | bytes], list[str]]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def _tokenizers_single_threaded() -> Iterator[None]:
    """The `tokenizers` library encodes a batch with a rayon pool over every core unless
    TOKENIZERS_PARALLELISM is false (read on each call): one worker is one core."""
    before = os.environ.get(_PARALLELISM_ENV)
    os.environ[_PARALLELISM_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PARALLELISM_ENV, None)
        else:
            os.environ[_PARALLELISM_ENV] = before


_PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_worker_tokenizer: Tokenizer | None = None


class _WorkerError(Exception):
    """A BatchpilotError raised in a worker, carried back by its parts (BatchpilotError does not unpickle)."""


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and shuts the pool down
    os.environ[_PARALLELISM_ENV] = "false"
    _worker_tokenizer = tokenizer


def _encode_in_worker(
    documents: list[str | bytes], names: list[str], dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None
    try:
        return _worker_tokenizer.encode_documents(documents, names=names, dtype=dtype)
    except BatchpilotError as error:
        raise _WorkerError(error.field, error.problem, error.fix) from None


def encode_in_order(
    batches: Iterator[DocumentBatch], *, tokenizer: Tokenizer, dtype: str, workers: int
) -> Generator[tuple[np.ndarray, np.ndarray], None, None]:
    """`tokenizer.encode_documents` of each batch, in order, on `workers` processes.

    At most `2 x workers` batches are submitted ahead of the one being returned, so memory stays bounded
    whatever the corpus size (`Pool.imap` would read the whole input ahead). `workers=1` encodes here, in
    this process. Close the iterator (`contextlib.closing`) when stopping early: that cancels what was
    queued and waits for the batches the workers are on, at most one each.
    """
    if workers < 1:
        raise BatchpilotError("--workers", f"must be at least 1, got {workers}")
    if workers == 1:
        with _tokenizers_single_threaded():
            for documents, names in batches:
                yield tokenizer.encode_documents(documents, names=names, dtype=dtype)
        return
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),  # no fork of a process with threads
        initializer=_start_worker,
        initargs=(tokenizer,),
    )
    window: collections.deque[Future[tuple[np.ndarray, np.ndarray]]] = collections.deque()
    try:
        for documents, names in batches:
            window.append(pool.submit(_encode_in_worker, documents, names, dtype))
            if len(window) >= 2 * workers:
                yield _result(window.popleft())
        while window:
            yield _result(window.popleft())
    except BrokenProcessPool:  # from submit or result, whichever first sees the pool broken
        raise BatchpilotError(
            "--workers",
            f"a tokenizer worker process died (of {workers}; killed for memory?)",
            "pass fewer --workers",
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    try:
        return future.result()
    except _WorkerError as error:
        raise BatchpilotError(*error.args) from None
