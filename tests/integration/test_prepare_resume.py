"""`data prepare` resumes after an interruption: a storage error, Ctrl-C, a bad input found part-way.

Every case stops a run part-way, checks what is kept (the journaled shards and `prepare-progress.json`,
no partial object), resumes with the same call and compares every object, manifest.json included, byte
for byte with an uninterrupted run of the same inputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.integration.test_corpora import make_documents, objects, write_jsonl

import batchpilot.data.prepare as prepare_module
from batchpilot.cli import main
from batchpilot.data.corpora import collect_sources
from batchpilot.data.prepare import PrepareInterrupted, PrepareStopped, prepare
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage, StorageError
from batchpilot.storage.gcs import GCSStorage

zstandard = pytest.importorskip("zstandard")

JOURNAL = "prepare-progress.json"
NAMES = ("a.jsonl", "b.jsonl", "c.jsonl.zst", "d.jsonl")


def write_corpus(folder: Path, *, bad: str | None = None) -> list[str]:
    """Four inputs of 120 documents each, the third zstd; returns them. `bad`: the third is cut in half
    ("truncated", found at its end) or its record 101 has no text field ("missing-field", found part-way)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = [write_jsonl(folder / name, make_documents(120, seed=number)) for number, name in enumerate(NAMES)]
    third = folder / "c.jsonl.zst"
    if bad == "truncated":
        third.write_bytes(third.read_bytes()[: third.stat().st_size // 2])
    elif bad == "missing-field":
        lines = data[2].splitlines()
        lines[100] = json.dumps({"id": 100, "body": "no text"}).encode()
        third.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))
    else:
        assert bad is None, bad
    return [str(folder / name) for name in NAMES]


def run(out: str | Path, inputs: list[str], *, workers: int = 1, force: bool = False, **options: Any) -> None:
    prepare(
        inputs=collect_sources(inputs),
        out_uri=out if isinstance(out, str) else f"file://{out}",
        tokenizer=ByteTokenizer(),
        shard_size_tokens=options.get("shard_size_tokens", 1000),
        validation_fraction=0.05,
        workers=workers,
        batch_bytes=2048,  # many batches: more than the workers' window of 2 x workers
        force=force,
        show_progress=False,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    run(folder / "set", write_corpus(folder / "corpus"))
    assert JOURNAL not in objects(folder / "set")  # deleted once the manifest is written
    return objects(folder / "set")


def fail_shard_write(
    monkeypatch: pytest.MonkeyPatch, storage: type, *, after: int, error: BaseException, landed: bool = False,
    everything: bool = False,
) -> None:  # fmt: skip
    """Shard writes after the first `after` raise `error` (after the object landed, if `landed`); with
    `everything`, every later write does (the journal's too: the storage is gone)."""
    original = storage.write
    count = [0]

    def write(self: Any, name: str, data: bytes, **kwargs: Any) -> int:
        failing = count[0] >= after
        if name.endswith(".bin"):
            count[0] += 1
        if failing and (name.endswith(".bin") or everything):
            if landed:
                original(self, name, data, **kwargs)
            raise error
        return original(self, name, data, **kwargs)

    monkeypatch.setattr(storage, "write", write)


def journal_of(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / JOURNAL).read_text()))


def journaled(folder: Path) -> list[str]:
    splits = journal_of(folder)["splits"].values()
    return sorted([JOURNAL, *(shard["name"] for shards in splits for shard in shards)])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    ("after", "error", "landed", "everything", "num_kept"),
    [
        (1, StorageError("gs://b/train-00001.bin", "connection reset"), False, False, 1),
        (7, StorageError("gs://b/train-00007.bin", "connection reset"), True, False, 7),
        (20, KeyboardInterrupt(), False, False, 20),
        (12, StorageError("gs://b/x", "unreachable"), False, True, 1),  # only the first journal got out
    ],
    ids=["storage-error-after-1", "landed-not-journaled-after-7", "ctrl-c-after-20", "storage-down-after-12"],
)
def test_a_run_stopped_part_way_keeps_its_journaled_shards_and_resumes_to_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, bytes], workers: int,
    after: int, error: BaseException, landed: bool, everything: bool, num_kept: int,
) -> None:  # fmt: skip
    inputs = write_corpus(tmp_path / "corpus")
    out = tmp_path / "set"
    with monkeypatch.context() as patch:
        fail_shard_write(patch, LocalStorage, after=after, error=error, landed=landed, everything=everything)
        expected = PrepareInterrupted if isinstance(error, KeyboardInterrupt) else PrepareStopped
        with pytest.raises(expected) as raised:
            run(out, inputs, workers=workers)
    kept = journaled(out)
    assert len(kept) - 1 == num_kept
    assert sorted(objects(out)) == kept  # the shard that failed (or landed unjournaled) is gone
    assert f"({num_kept} shards) are kept at file://{out}" in str(getattr(raised.value, "kept", ""))
    assert "run the same command again to resume, or add --force to start over" in raised.value.kept
    run(out, inputs, workers=workers)
    assert objects(out) == uninterrupted


def test_the_cli_says_it_resumes_and_the_journal_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = write_corpus(tmp_path / "corpus")
    argv = ["data", "prepare", *inputs, "--out", f"file://{tmp_path}/set", "--shard-size-tokens", "1000",
            "--validation-fraction", "0.05", "--workers", "1", "--no-progress"]  # fmt: skip
    with monkeypatch.context() as patch:
        fail_shard_write(patch, LocalStorage, after=9, error=KeyboardInterrupt())
        assert main(argv) == 130
    error = capsys.readouterr().err.strip().splitlines()
    journal = journal_of(tmp_path / "set")
    train, validation = (
        shards[-1]["resume"][0] if shards else 0
        for shards in (journal["splits"]["train"], journal["splits"]["validation"])
    )
    num_documents = train - -(-train // 20) + -(-validation // 20)  # ceil(n / 20) validation documents
    assert error == [
        f"batchpilot: interrupted: {num_documents:,} documents (9 shards) are kept at file://{tmp_path}/set: "
        "run the same command again to resume, or add --force to start over"
    ]
    assert main(argv) == 0
    assert (
        f"resuming: {num_documents:,} documents and 9 shards already prepared at file://{tmp_path}/set"
        in (capsys.readouterr().out)
    )
    assert not (tmp_path / "set" / JOURNAL).exists()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    ("bad", "problem"),
    [("truncated", ".zst: ends inside a zstd frame"), ("missing-field", ".zst:101: has no field 'text'")],
)
def test_a_bad_input_found_part_way_is_replaced_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, bytes], workers: int, bad: str,
    problem: str, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(prepare_module, "_BATCH_BYTES", 2048)  # shards are written before c.jsonl.zst is read
    inputs = write_corpus(tmp_path / "corpus", bad=bad)
    out = tmp_path / "set"
    argv = ["data", "prepare", *inputs, "--out", f"file://{out}", "--shard-size-tokens", "1000",
            "--validation-fraction", "0.05", "--workers", str(workers), "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"batchpilot: error: {tmp_path}/corpus/c.jsonl{problem}"), line
    assert line.endswith(
        f"are kept at file://{out}: run the same command again to resume, or add --force to start over"
    ), line
    # Kept: only shards of documents before c.jsonl.zst's first (238: 119 non-empty in a.jsonl and b.jsonl),
    # also where shards of its first 100 records were written: the file may be replaced.
    journal = journal_of(out)
    assert journal["first_documents"][:3] == [0, 119, 238]
    assert [shards[-1]["resume"] <= [238, 0] for shards in journal["splits"].values()] == [True, True]
    assert sorted(objects(out)) == journaled(out)
    write_jsonl(tmp_path / "corpus" / "c.jsonl.zst", make_documents(120, seed=2))  # the good copy: resumes
    assert main(argv) == 0
    assert objects(out) == uninterrupted


def test_other_settings_or_a_changed_input_before_the_position_are_refused_and_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, bytes]
) -> None:
    inputs = write_corpus(tmp_path / "corpus")
    out = tmp_path / "set"
    with monkeypatch.context() as patch:
        fail_shard_write(patch, LocalStorage, after=55, error=KeyboardInterrupt())  # inside b.jsonl
        with pytest.raises(PrepareInterrupted):
            run(out, inputs)
    assert journal_of(out)["splits"]["train"][-1]["resume"][0] > 119
    kept = objects(out)

    def refused(call: Callable[[], None], *fragments: str) -> None:
        with pytest.raises(BatchpilotError) as raised:
            call()
        for fragment in [*fragments, "pass --force to start over"]:
            assert fragment in str(raised.value), str(raised.value)
        assert objects(out) == kept

    refused(lambda: run(out, inputs, shard_size_tokens=2000), "--shard-size-tokens", "used 1000")
    refused(lambda: run(out, inputs[:1]), "input 2 of the interrupted prepare", "b.jsonl")
    first = tmp_path / "corpus" / "a.jsonl"
    written_ns = first.stat().st_mtime_ns
    write_jsonl(first, make_documents(121, seed=0))
    refused(lambda: run(out, inputs), "a.jsonl: changed since the interrupted prepare", "size_bytes")
    write_jsonl(tmp_path / "corpus" / "a.jsonl", make_documents(120, seed=0))  # the same bytes, a new mtime
    refused(lambda: run(out, inputs), "a.jsonl: changed", "mtime_ns")
    os.utime(first, ns=(written_ns, written_ns))
    (out / "notes.txt").write_text("not the prepare's")
    kept = objects(out)
    refused(lambda: run(out, inputs), "not this prepare's (first: notes.txt)")
    run(out, inputs, force=True)  # --force starts over, whatever is there
    assert objects(out) == uninterrupted


def test_inputs_after_the_position_may_change_and_a_partial_shard_left_by_a_kill_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = write_corpus(tmp_path / "corpus")
    out = tmp_path / "set"
    with monkeypatch.context() as patch:
        fail_shard_write(patch, LocalStorage, after=4, error=KeyboardInterrupt())  # inside a.jsonl
        with pytest.raises(PrepareInterrupted):
            run(out, inputs)
    assert journal_of(out)["splits"]["train"][-1]["resume"][0] < 119
    write_jsonl(tmp_path / "corpus" / "d.jsonl", make_documents(80, seed=9))
    (out / "train-00004.bin").write_bytes(b"what a killed run left: written, never journaled")
    run(out, inputs)
    run(tmp_path / "fresh", inputs)
    assert objects(out) == objects(tmp_path / "fresh")


def test_a_gcs_destination_resumes_to_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gcs_client: Any, gcs_bucket: str,
    uninterrupted: dict[str, bytes],
) -> None:  # fmt: skip
    inputs = write_corpus(tmp_path / "corpus")
    uri = f"gs://{gcs_bucket}/set"
    with monkeypatch.context() as patch:
        fail_shard_write(patch, GCSStorage, after=6, error=KeyboardInterrupt(), landed=True)
        with pytest.raises(PrepareInterrupted) as raised:
            run(uri, inputs, workers=2)
    assert "(6 shards) are kept at gs://" in str(raised.value.kept)

    def stored() -> dict[str, bytes]:
        blobs = gcs_client.list_blobs(gcs_bucket, prefix="set/")
        return {blob.name.removeprefix("set/"): blob.download_as_bytes() for blob in blobs}

    journal = json.loads(stored()[JOURNAL])
    names = [shard["name"] for shards in journal["splits"].values() for shard in shards]
    assert sorted(stored()) == sorted([JOURNAL, *names]) and len(names) == 6
    run(uri, inputs, workers=2)
    assert stored() == uninterrupted
