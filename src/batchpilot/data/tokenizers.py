"""Tokenizers for `prepare`: bytes by default, or a Hugging Face `tokenizer.json`.

Each appends its end-of-document token after every document, so samples that cross a document boundary
show the model where one text ends.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from batchpilot.errors import BatchpilotError

# Special tokens tried, in order, as the end-of-document token of a tokenizer.json.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eos|>")


class Tokenizer(Protocol):
    """Text bytes -> token ids."""

    vocab_size: int
    eos_token_id: int

    def encode_documents(self, documents: list[bytes], *, names: list[str]) -> list[np.ndarray]:
        """Token ids of each document followed by the end-of-document token, as uint32 arrays.

        `names` (one per document, e.g. file paths) only serve error messages.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this tokenizer."""
        ...


class ByteTokenizer:
    """One token per byte (0-255) and 256 as end-of-document: no vocabulary file, any input decodes."""

    vocab_size = 257
    eos_token_id = 256

    def encode_documents(self, documents: list[bytes], *, names: list[str]) -> list[np.ndarray]:
        del names  # every byte string is valid input
        encoded = []
        for document in documents:
            tokens = np.empty(len(document) + 1, dtype=np.uint32)
            tokens[:-1] = np.frombuffer(document, dtype=np.uint8)
            tokens[-1] = self.eos_token_id
            encoded.append(tokens)
        return encoded

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes"}


class HuggingFaceTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package (install batchpilot[data])."""

    def __init__(self, path: str, *, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise BatchpilotError(
                "--tokenizer", "needs the `tokenizers` package", "pip install 'batchpilot[data]'"
            ) from None
        file = Path(path)
        try:
            raw = file.read_bytes()
            self._tokenizer = HFTokenizer.from_str(raw.decode())
        except Exception as error:  # tokenizers raises plain Exception for a malformed file
            raise BatchpilotError(
                "--tokenizer", f"cannot load {path}: {error}", "pass a tokenizer.json file"
            ) from None
        self._sha256 = hashlib.sha256(raw).hexdigest()
        self._name = file.name
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

    def encode_documents(self, documents: list[bytes], *, names: list[str]) -> list[np.ndarray]:
        texts = []
        for name, document in zip(names, documents, strict=True):
            try:
                texts.append(document.decode("utf-8"))
            except UnicodeDecodeError as error:
                raise BatchpilotError(
                    name,
                    f"is not UTF-8 ({error.reason} at byte {error.start})",
                    "convert it, or drop --tokenizer",
                ) from None
        encoded = []
        for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
            tokens = np.empty(len(encoding.ids) + 1, dtype=np.uint32)
            tokens[:-1] = encoding.ids
            tokens[-1] = self.eos_token_id
            encoded.append(tokens)
        return encoded

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "huggingface",
            "file": self._name,
            "sha256": self._sha256,
            "eos_token": self.eos_token,
        }


def load_tokenizer(path: str | None, *, eos_token: str | None = None) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the tokenizer.json at `path`."""
    if path is None:
        if eos_token is not None:
            raise BatchpilotError("--eos-token", "only applies with --tokenizer", "drop --eos-token")
        return ByteTokenizer()
    return HuggingFaceTokenizer(path, eos_token=eos_token)
