"""`data prepare` on real corpus formats: JSON Lines (plain, gzip, zstd), Parquet, a `datasets` save_to_disk
folder and gs:// inputs give the same shard set for the same documents, with any number of workers."""

from __future__ import annotations

import gzip
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchpilot.data.corpora as corpora
from batchpilot.cli import main
from batchpilot.data.corpora import collect_sources
from batchpilot.data.prepare import prepare
from batchpilot.data.shard_writer import is_validation, validation_mask
from batchpilot.data.shards import ShardSet
from batchpilot.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer
from batchpilot.errors import BatchpilotError
from hf_files import bpe_tokenizer_json

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "a", "of", "batch", "size", "node", "shard", "token", "stage", "ramp", "loss", "step", "data"]


def make_documents(num_documents: int, *, seed: int = 0) -> list[str]:
    """English-like documents of varied length, with non-ASCII text and one empty document (skipped)."""
    rng = random.Random(seed)
    documents = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 120))) + f" naïve №{i}\n"
        for i in range(num_documents)
    ]
    documents[3] = ""
    return documents


def write_jsonl(path: Path, documents: list[str], *, field: str = "text") -> bytes:
    data = "".join(json.dumps({"id": i, field: text}) + "\n" for i, text in enumerate(documents)).encode()
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        # Two frames: a reader must go on after the first.
        half = len(data) // 2
        compressor = zstandard.ZstdCompressor()
        path.write_bytes(compressor.compress(data[:half]) + compressor.compress(data[half:]))
    else:
        path.write_bytes(data)
    return data


def write_parquet(path: Path, documents: list[str]) -> None:
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pq.write_table(table, path, row_group_size=97)  # many row groups, not aligned with the batches


def bpe_tokenizer(path: Path, documents: list[str]) -> Path:
    path.write_bytes(bpe_tokenizer_json(documents, vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"]))
    return path


def objects(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))}


def prepare_into(
    out: Path,
    inputs: list[str],
    *,
    tokenizer: Tokenizer,
    workers: int = 1,
    text_field: str = "text",
    validation_fraction: float = 0.05,
) -> dict[str, bytes]:
    prepare(
        inputs=collect_sources(inputs),
        out_uri=f"file://{out}",
        tokenizer=tokenizer,
        shard_size_tokens=1000,
        validation_fraction=validation_fraction,
        text_field=text_field,
        workers=workers,
        batch_bytes=2048,  # many batches: more than the workers' window of 2 x workers
        show_progress=False,
    )
    return objects(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("corpus")
    documents = make_documents(600)
    for name in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst"):
        write_jsonl(folder / name, documents)
    write_parquet(folder / "c.parquet", documents)
    return {
        "folder": folder,
        "documents": documents,
        "tokenizer": bpe_tokenizer(folder / "bpe.json", documents),
    }


def test_parquet_and_zstd_jsonl_give_identical_shard_sets_with_one_and_two_workers(
    corpus: dict[str, Any], tmp_path: Path
) -> None:
    folder, tokenizer = corpus["folder"], load_tokenizer(str(corpus["tokenizer"]))
    runs = {
        (name, workers): prepare_into(
            tmp_path / f"{name}-{workers}", [str(folder / name)], tokenizer=tokenizer, workers=workers
        )
        for name in ("c.parquet", "c.jsonl.zst")
        for workers in (1, 2)
    }
    reference = runs["c.parquet", 1]
    assert {name for name in reference if name.endswith(".bin")} >= {"train-00000.bin", "train-00001.bin"}
    assert "validation-00000.bin" in reference and "manifest.json" in reference
    for key, found in runs.items():
        assert found == reference, key
    # The tokens are the documents' (the empty one skipped), each followed by the end-of-document token.
    shards = ShardSet.open(uri=f"file://{tmp_path}/c.parquet-1")
    train = shards.read_tokens([(0, shards.manifest.num_tokens("train"))])[0]
    kept = [text for text in corpus["documents"] if text]
    expected = [
        token
        for index, text in enumerate(kept)
        if not is_validation(index, 0.05)
        for token in [
            *tokenizer._tokenizer.encode(text, add_special_tokens=False).ids,
            tokenizer.eos_token_id,
        ]  # type: ignore[attr-defined]
    ]
    assert train.tolist() == expected


def test_jsonl_and_gzip_jsonl_equal_parquet(corpus: dict[str, Any], tmp_path: Path) -> None:
    folder = corpus["folder"]
    found = {
        name: prepare_into(tmp_path / name, [str(folder / name)], tokenizer=ByteTokenizer())
        for name in ("c.parquet", "c.jsonl", "c.jsonl.gz")
    }
    assert found["c.jsonl"] == found["c.parquet"]
    assert found["c.jsonl.gz"] == found["c.parquet"]


def test_a_save_to_disk_folder_is_read_in_its_state_json_order(
    corpus: dict[str, Any], tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    documents = corpus["documents"]
    dataset = datasets.Dataset.from_dict({"body": documents, "id": list(range(len(documents)))})
    dataset.save_to_disk(str(tmp_path / "saved"), num_shards=3)  # 200 consecutive documents per file
    state_path = tmp_path / "saved" / "state.json"
    state = json.loads(state_path.read_text())
    files = state["_data_files"]
    assert [entry["filename"] for entry in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    state["_data_files"] = [files[1], files[0], files[2]]  # not the sorted order
    state_path.write_text(json.dumps(state))
    reordered = documents[200:400] + documents[:200] + documents[400:]
    write_parquet(tmp_path / "reordered.parquet", reordered)
    expected = prepare_into(
        tmp_path / "from-parquet", [str(tmp_path / "reordered.parquet")], tokenizer=ByteTokenizer()
    )
    found = prepare_into(tmp_path / "from-saved", [str(tmp_path / "saved")], tokenizer=ByteTokenizer(),
                         text_field="body", workers=2)  # fmt: skip
    assert found == expected


def test_a_gcs_prefix_and_object_read_in_ranged_chunks(
    corpus: dict[str, Any], tmp_path: Path, gcs_client: Any, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = corpus["folder"]
    bucket = gcs_client.bucket(gcs_bucket)
    for name in ("c.parquet", "c.jsonl.zst"):
        bucket.blob(f"corpus/{name}").upload_from_filename(str(folder / name))
    bucket.blob("corpus/README.md").upload_from_string(b"not a document: no *.txt suffix")
    monkeypatch.setattr(corpora, "READ_CHUNK_BYTES", 4096)  # every object in several ranged reads
    assert all((folder / name).stat().st_size > 2 * 4096 for name in ("c.parquet", "c.jsonl.zst"))
    tokenizer = ByteTokenizer()
    local = prepare_into(tmp_path / "local", [str(folder / "c.parquet")], tokenizer=tokenizer)
    one_object = prepare_into(
        tmp_path / "object", [f"gs://{gcs_bucket}/corpus/c.parquet"], tokenizer=tokenizer
    )
    assert one_object == local
    # The prefix: c.jsonl.zst, then c.parquet (sorted), i.e. every document twice.
    both = prepare_into(tmp_path / "prefix", [f"gs://{gcs_bucket}/corpus"], tokenizer=tokenizer, workers=2)
    twice = prepare_into(
        tmp_path / "twice", [str(folder / "c.jsonl"), str(folder / "c.parquet")], tokenizer=tokenizer
    )
    assert both == twice
    assert both["manifest.json"] != local["manifest.json"]


def test_the_tokenizer_json_is_copied_into_the_shard_set(corpus: dict[str, Any], tmp_path: Path) -> None:
    source = corpus["tokenizer"]
    out = tmp_path / "set"
    argv = ["data", "prepare", str(corpus["folder"] / "c.jsonl.zst"), "--out", f"file://{out}",
            "--tokenizer", str(source), "--workers", "2", "--shard-size-tokens", "2K", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert (out / "tokenizer.json").read_bytes() == source.read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["object"] == "tokenizer.json"
    assert manifest["tokenizer"]["file"] == "bpe.json"
    shards = ShardSet.open(uri=f"file://{out}")  # the extra object does not disturb a reader
    assert shards.manifest.num_tokens("train") > 2000
    # Replaced by a byte-level set: the old tokenizer.json goes with the rest of the old set.
    assert main([*argv[:5], "--force", "--no-progress"]) == 0
    assert not (out / "tokenizer.json").exists()


def test_validation_mask_equals_is_validation() -> None:
    for fraction in (0.0, 0.01, 0.05, 0.3, 0.5, 0.123456789):
        for first in (0, 7, 10_000_000):
            mask = validation_mask(first, 300, fraction)
            assert mask.tolist() == [is_validation(first + i, fraction) for i in range(300)], (
                fraction,
                first,
            )


def test_text_field_and_format_options_reach_the_reader(tmp_path: Path) -> None:
    documents = make_documents(40)
    write_jsonl(tmp_path / "data.json", documents, field="content")  # no .jsonl suffix: --format says it
    write_parquet(tmp_path / "c.parquet", documents)
    argv = ["--no-progress", "--validation-fraction", "0.1", "--workers", "1"]
    assert main(["data", "prepare", str(tmp_path / "c.parquet"), "--out", f"file://{tmp_path}/a", *argv]) == 0
    assert main(["data", "prepare", str(tmp_path / "data.json"), "--out", f"file://{tmp_path}/b", "--format",
                 "jsonl", "--text-field", "content", *argv]) == 0  # fmt: skip
    assert objects(tmp_path / "a") == objects(tmp_path / "b")
    first = np.frombuffer((tmp_path / "a" / "train-00000.bin").read_bytes()[32:], dtype=np.uint16)
    assert bytes(first[: len(documents[1].encode())].astype(np.uint8)) == documents[1].encode()


class DyingTokenizer(ByteTokenizer):
    """Byte-level, but the worker process that meets the document `die` exits at once (as if killed)."""

    def encode_documents(self, documents: Any, *, names: Any, dtype: str) -> Any:
        if "die\n" in documents:
            os._exit(9)
        return super().encode_documents(documents, names=names, dtype=dtype)


def test_a_worker_that_dies_ends_the_run_with_one_line_and_keeps_the_journaled_shards(tmp_path: Path) -> None:
    documents = make_documents(300)
    write_jsonl(tmp_path / "c.jsonl", documents)
    # The workers can run this tokenizer: without the document, the run succeeds.
    assert prepare_into(
        tmp_path / "alive", [str(tmp_path / "c.jsonl")], tokenizer=DyingTokenizer(), workers=2
    )
    documents[200] = "die\n"
    write_jsonl(tmp_path / "c.jsonl", documents)
    started = time.monotonic()
    with pytest.raises(BatchpilotError, match="a tokenizer worker process died") as raised:
        prepare_into(
            tmp_path / "out" / "set", [str(tmp_path / "c.jsonl")], tokenizer=DyingTokenizer(), workers=2
        )
    assert raised.value.field == "--workers"
    assert "are kept at file://" in str(raised.value) and "run the same command again to resume" in str(
        raised.value
    )
    assert time.monotonic() - started < 30
    journal = json.loads((tmp_path / "out" / "set" / "prepare-progress.json").read_text())
    kept = sorted(shard["name"] for split in journal["splits"].values() for shard in split)
    assert kept and sorted(objects(tmp_path / "out" / "set")) == sorted(["prepare-progress.json", *kept])
    # The same settings (a byte tokenizer) on workers that live: the run resumes to an uninterrupted run's bytes.
    resumed = prepare_into(
        tmp_path / "out" / "set", [str(tmp_path / "c.jsonl")], tokenizer=ByteTokenizer(), workers=2
    )
    assert resumed == prepare_into(tmp_path / "fresh", [str(tmp_path / "c.jsonl")], tokenizer=ByteTokenizer())
