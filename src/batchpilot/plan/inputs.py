"""The config against its inputs: a local shard set (it exists, its vocabulary fits the model) and an
explore.json (measured for this config's model and setting).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchpilot.config import FINGERPRINT_DEFAULTS, Config, explore_fingerprint
from batchpilot.errors import BatchpilotError


def data_problems(
    *,
    data_uri: str,
    model_vocab_size: Callable[[], int],
    seq_len: int = 0,
    split: str = "train",
    largest_batch: int = 0,
) -> list[BatchpilotError]:
    """A local shard set (file://) against the config: it exists, holds a readable manifest, the model
    embeds every token id of its vocabulary (`model_vocab_size` is asked only then: it builds the model's
    shape), and its `split` holds at least one global batch (`largest_batch` samples of `seq_len` tokens).
    A gs:// set is left to `batchpilot doctor`, which has the credentials to read it.
    """
    if not data_uri.startswith("file://"):
        return []
    from batchpilot.data.shards import read_manifest
    from batchpilot.storage import open_storage

    fix = f"prepare it with `batchpilot data prepare ... --out {data_uri}` (--demo for the demo set) or point data.uri at a shard set"
    folder = Path(data_uri.removeprefix("file://"))
    if not folder.is_dir():
        where = "" if folder.is_absolute() else f" in {Path.cwd()} (a relative file:// URI starts there)"
        return [BatchpilotError("data.uri", f"{data_uri} does not exist{where}", fix)]
    try:
        manifest = read_manifest(open_storage(data_uri))
    except BatchpilotError as error:
        return [
            BatchpilotError("data.uri", f"{data_uri} holds no shard set: {error.field} {error.problem}", fix)
        ]
    problems: list[BatchpilotError] = []
    if seq_len and largest_batch:
        from batchpilot.data.sampling import num_samples

        tokens = manifest.num_tokens(split)
        samples = num_samples(num_tokens=tokens, seq_len=seq_len)
        if samples < largest_batch:
            problems.append(
                BatchpilotError(
                    "data.uri",
                    f"{data_uri} holds {samples:,} samples of {seq_len} tokens in its {split} split "
                    f"({tokens:,} tokens), fewer than one global batch of {largest_batch:,}: every step would "
                    "repeat samples",
                    "prepare more data, or lower the batch sizes (or data.seq_len)",
                )
            )
    problem = vocabulary_problem(
        model_vocab_size=model_vocab_size(), data_vocab_size=manifest.vocab_size, data_uri=data_uri
    )
    return problems if problem is None else [*problems, problem]


def vocabulary_problem(
    *, model_vocab_size: int, data_vocab_size: int, data_uri: str
) -> BatchpilotError | None:
    """The rule between a shard set and the model (`plan` on local data, `doctor` on any): the model embeds
    every token id of the vocabulary the set was tokenized into (its manifest's `vocab_size`)."""
    if model_vocab_size >= data_vocab_size:
        return None
    return BatchpilotError(
        "model.args.vocab_size",
        f"the model embeds {model_vocab_size} token ids but {data_uri}'s vocabulary has {data_vocab_size}",
        f"set model.args.vocab_size to at least {data_vocab_size}",
    )


def explore_problems(config: Config, explore: dict[str, Any] | None) -> list[BatchpilotError]:
    """An explore.json measured for another model or setting than the config's: one error naming every
    field that differs. An explore.json without a fingerprint (written before explore recorded one) names
    nothing to compare and is taken as it is."""
    recorded = (explore or {}).get("fingerprint")
    if not isinstance(recorded, dict):
        return []
    expected = json.loads(json.dumps(explore_fingerprint(config)))  # as explore.json reads back
    differences = []
    for key, value in expected.items():
        there = recorded.get(key, FINGERPRINT_DEFAULTS.get(key))
        if key == "model.args" and isinstance(there, dict) and isinstance(value, dict):
            differences += [
                f"model.args.{arg} {there.get(arg)!r} there, {value.get(arg)!r} here"
                for arg in sorted(set(there) | set(value))
                if there.get(arg) != value.get(arg)
            ]
        elif there != value:
            differences.append(f"{key} {there!r} there, {value!r} here")
    if not differences:
        return []
    return [
        BatchpilotError(
            "--explore",
            f"was measured for another model or setting than this config's: {'; '.join(differences)}",
            "run `batchpilot explore` with this config, or plan with the config explore measured",
        )
    ]
