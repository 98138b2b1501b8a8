"""The progress journal of `data prepare` (`prepare-progress.json`), which lets an interrupted run resume.

After each full shard prepare rewrites one object beside the shards: the settings fingerprint, the inputs
as listed, the first document index of each input read, and per split the shards written so far, each
with the resume position after it: `(document, tokens)`, the global index of the first document whose
tokens are not all in the split's shards up to that one, and how many of its tokens (end-of-document
token included) are. The journal is small (one entry per shard: 60k entries, a few MB, for 1T tokens in
16M-token shards) and its writes are capped at one every `JOURNAL_INTERVAL_S`, plus one when the run
stops; it is deleted once the manifest is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from batchpilot.data.corpora import Source
from batchpilot.data.shards import FORMAT_VERSION, ShardEntry
from batchpilot.errors import BatchpilotError
from batchpilot.storage import Storage

JOURNAL_NAME = "prepare-progress.json"
_JOURNAL_FORMAT = "batchpilot-prepare-progress"
_JOURNAL_VERSION = 1
# At most one journal write per this many seconds while shards are written (a write of a 60k-shard journal
# is a few MB); the state when the run stops is always written.
JOURNAL_INTERVAL_S = 5.0
# The option a user changes for each setting, for the refusal naming it.
_SETTING_FIELDS = {
    "tokenizer": "--tokenizer",
    "vocab_size": "--tokenizer",
    "eos_token_id": "--eos-token",
    "dtype": "--tokenizer",
    "text_field": "--text-field",
    "shard_size_tokens": "--shard-size-tokens",
    "validation_fraction": "--validation-fraction",
    "shard_format_version": "batchpilot version",
}
_START_OVER = "pass --force to start over"

# A split's resume position: (global document index, tokens of it already written).
Position = tuple[int, int]


def settings_fingerprint(
    *, tokenizer: dict[str, Any], vocab_size: int, eos_token_id: int, dtype: str, text_field: str,
    shard_size_tokens: int, validation_fraction: float,
) -> dict[str, Any]:  # fmt: skip
    """Everything besides the inputs that decides the shards' bytes."""
    return {
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
        "text_field": text_field,
        "shard_size_tokens": shard_size_tokens,
        "validation_fraction": validation_fraction,
        "shard_format_version": FORMAT_VERSION,
    }


def input_fingerprints(sources: Sequence[Source]) -> list[dict[str, Any]]:
    """Each input as listed: URI, format, size, and its GCS generation or local modification time."""
    listed = []
    for source in sources:
        version = (
            {"generation": source.generation}
            if source.storage is not None
            else {"mtime_ns": Path(source.name).stat().st_mtime_ns}
        )
        listed.append(
            {"uri": source.uri, "format": source.format, "size_bytes": source.size_bytes, **version}
        )
    return listed


def kept_documents(positions: dict[str, Position], *, validation_fraction: float) -> int:
    """Documents whose tokens are all in the written shards: train documents before the train position,
    validation documents before the validation position."""
    fraction = Fraction(str(validation_fraction))
    train = positions.get("train", (0, 0))[0]
    validation = positions.get("validation", (0, 0))[0]
    return train - math.ceil(train * fraction) + math.ceil(validation * fraction)


class Journal:
    """Writes the journal of one run: `shard_written` after each full shard, `settle` when the run stops."""

    def __init__(
        self, storage: Storage, *, settings: dict[str, Any], inputs: list[dict[str, Any]],
        first_documents: list[int], splits: Callable[[], dict[str, list[tuple[ShardEntry, Position]]]],
        noted: list[str],
    ) -> None:  # fmt: skip
        self._storage = storage
        self._settings = settings
        self._inputs = inputs
        self._first_documents = first_documents
        self._splits = splits
        self._noted = noted
        self._last_write_s = -math.inf
        self.stored: dict[str, Any] | None = None  # the journal last written

    def shard_written(self) -> None:
        if time.monotonic() - self._last_write_s >= JOURNAL_INTERVAL_S:
            self._write(self.document())

    def document(self, *, before_document: int | None = None) -> dict[str, Any]:
        """The journal of the shards written, or of those holding only documents before `before_document`."""
        splits = {}
        for split, entries in self._splits().items():
            if before_document is not None:
                entries = [entry for entry in entries if entry[1] <= (before_document, 0)]
            splits[split] = [
                {"name": shard.name, "num_tokens": shard.num_tokens, "num_bytes": shard.num_bytes,
                 "crc32c": f"{shard.crc32c:08x}", "resume": list(position)}
                for shard, position in entries
            ]  # fmt: skip
        return {
            "format": _JOURNAL_FORMAT,
            "version": _JOURNAL_VERSION,
            "settings": self._settings,
            "inputs": self._inputs,
            "first_documents": list(self._first_documents),
            "splits": splits,
        }

    def settle(self, *, before_document: int | None) -> dict[str, Any] | None:
        """Writes the state a stopped run keeps; returns the journal left at the destination, or None when
        no shard is kept. A journal that cannot be written (storage down) leaves the last one written."""
        document = self.document(before_document=before_document)
        if not num_shards(document):
            return None
        # A write that fails (e.g. the storage error that stopped the run) leaves the previous journal.
        with contextlib.suppress(BatchpilotError):
            self._write(document)
        return self.stored if self.stored is not None and num_shards(self.stored) else None

    def _write(self, document: dict[str, Any]) -> None:
        if JOURNAL_NAME not in self._noted:
            self._noted.append(JOURNAL_NAME)  # removed with the shards if nothing is kept
        self._storage.write(JOURNAL_NAME, json.dumps(document, separators=(",", ":")).encode())
        self._last_write_s = time.monotonic()
        self.stored = document


def num_shards(document: dict[str, Any]) -> int:
    return sum(len(shards) for shards in document["splits"].values())


def shard_names(document: dict[str, Any]) -> list[str]:
    return [shard["name"] for shards in document["splits"].values() for shard in shards]


def positions(document: dict[str, Any]) -> dict[str, Position]:
    """Each split's resume position: after its last shard, or the start."""
    return {
        split: (int(shards[-1]["resume"][0]), int(shards[-1]["resume"][1])) if shards else (0, 0)
        for split, shards in document["splits"].items()
    }


def shard_entries(document: dict[str, Any], split: str) -> list[tuple[ShardEntry, Position]]:
    return [
        (ShardEntry(name=s["name"], num_tokens=int(s["num_tokens"]), num_bytes=int(s["num_bytes"]),
                    crc32c=int(s["crc32c"], 16)), (int(s["resume"][0]), int(s["resume"][1])))
        for s in document["splits"].get(split, [])
    ]  # fmt: skip


def read_journal(storage: Storage) -> dict[str, Any]:
    """The journal at `storage`, or one line saying it is not one."""
    where = f"{storage.uri.rstrip('/')}/{JOURNAL_NAME}"
    try:
        document = json.loads(storage.read(JOURNAL_NAME))
        valid = document["format"] == _JOURNAL_FORMAT and document["version"] == _JOURNAL_VERSION
        positions(document)
    except (ValueError, KeyError, TypeError, IndexError):
        valid = False
    if not valid:
        raise BatchpilotError(where, "is not a prepare progress journal this batchpilot reads", _START_OVER)
    return dict(document)


def check_resumable(
    document: dict[str, Any], *, settings: dict[str, Any], inputs: list[dict[str, Any]], uri: str
) -> None:
    """Refuses, in one line naming what differs, other settings or a change to an input holding documents
    that are (partly) in the written shards; inputs after those may differ."""
    for key, value in settings.items():
        before = document["settings"].get(key)
        if before != value:
            raise BatchpilotError(
                _SETTING_FIELDS.get(key, key),
                f"{key} is {value!r}, but the interrupted prepare at {uri} used {before!r}",
                f"run it with the same settings to resume, or {_START_OVER}",
            )
    ends = [position[0] + (1 if position[1] else 0) for position in positions(document).values()]
    first_documents = document["first_documents"]
    protected = sum(1 for first in first_documents if first < max(ends, default=0))
    for number, before in enumerate(document["inputs"][:protected], start=1):
        if number > len(inputs):
            raise BatchpilotError(
                "INPUT", f"input {number} of the interrupted prepare at {uri} ({before['uri']}) is not listed",
                f"list the same inputs to resume, or {_START_OVER}",
            )  # fmt: skip
        now = inputs[number - 1]
        if before["uri"] != now["uri"]:
            raise BatchpilotError(
                "INPUT", f"input {number} is {now['uri']}, but the interrupted prepare at {uri} read {before['uri']}",
                f"list the same inputs to resume, or {_START_OVER}",
            )  # fmt: skip
        if before != now:
            what = ", ".join(
                f"{key} {before.get(key)} -> {now.get(key)}" for key in sorted({*before, *now})
                if before.get(key) != now.get(key)
            )  # fmt: skip
            raise BatchpilotError(
                now["uri"],
                f"changed since the interrupted prepare at {uri} read it ({what}); its documents are in the "
                "shards kept",
                f"restore it to resume, or {_START_OVER}",
            )
