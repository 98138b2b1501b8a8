"""`batchpilot data import-megatron`: Megatron-LM .bin/.idx datasets (written byte by byte from the
documented layout, tests/megatron_files.py) become shard sets with the same documents and token ids, and
a model trains on them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tests.megatron_files import corpus, megatron_bytes, write_megatron

from batchpilot.cli import main
from batchpilot.data.megatron import document_pieces, open_source, read_index
from batchpilot.data.sampling import num_samples, sample_at
from batchpilot.data.shard_writer import is_validation
from batchpilot.data.shards import read_manifest
from batchpilot.runstate import read_metrics
from batchpilot.storage import open_storage
from helpers import run_batchpilot, tiny_config, write_plan


def import_cli(*argv: str) -> int:
    return main(["data", "import-megatron", *argv, "--no-progress"])


def split_tokens(uri: str) -> dict[str, list[int]]:
    """Each split's token stream, read back from the shards (headers skipped)."""
    storage = open_storage(uri)
    manifest = read_manifest(storage)
    return {
        split: np.concatenate(
            [np.frombuffer(storage.read(s.name)[32:], dtype=manifest.dtype) for s in shards]
        ).tolist()
        for split, shards in manifest.splits.items()
    }


def expected_splits(documents: list[list[list[int]]], fraction: float) -> dict[str, list[int]]:
    """What prepare's split rule makes of `documents` (each the concatenation of its sequences)."""
    splits: dict[str, list[int]] = {"train": [], "validation": []}
    for number, document in enumerate(documents):
        tokens = [t for sequence in document for t in sequence]
        splits["validation" if is_validation(number, fraction) else "train"].extend(tokens)
    return {split: tokens for split, tokens in splits.items() if tokens}


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_documents_and_tokens_round_trip_with_the_split_of_prepare(tmp_path: Path, dtype: str) -> None:
    vocab = 70_000 if dtype == "int32" else 1000  # int32 data: ids above uint16, so uint32 shards
    documents = corpus(40, seed=1, vocab_size=vocab, eod=vocab - 1)
    prefix = write_megatron(tmp_path / "src" / "corpus_text_document", documents, dtype=dtype)
    uri = f"file://{tmp_path}/set"
    argv = [str(prefix), "--out", uri, "--vocab-size", str(vocab), "--eos-token-id", str(vocab - 1)]
    assert import_cli(*argv, "--validation-fraction", "0.1", "--shard-size-tokens", "300") == 0
    assert split_tokens(uri) == expected_splits(documents, 0.1)
    manifest = read_manifest(open_storage(uri))
    assert manifest.dtype == ("uint32" if dtype == "int32" else "uint16")
    assert (manifest.vocab_size, manifest.eos_token_id) == (vocab, vocab - 1)
    assert manifest.tokenizer == {
        "kind": "megatron", "sources": [str(prefix)], "source_dtypes": [dtype], "eod_appended": False,
    }  # fmt: skip
    assert max(s.num_tokens for s in manifest.splits["train"]) == 300


def test_several_prefixes_are_imported_in_order_and_count_documents_across_them(tmp_path: Path) -> None:
    first, second = corpus(7, seed=2, vocab_size=500), corpus(9, seed=3, vocab_size=500)
    a = write_megatron(tmp_path / "a" / "part", first)
    b = write_megatron(tmp_path / "b" / "part", second, dtype="int32")
    uri = f"file://{tmp_path}/set"
    assert import_cli(str(a), str(b), "--out", uri, "--vocab-size", "500", "--eos-token-id", "0",
                      "--validation-fraction", "0.2") == 0  # fmt: skip
    assert split_tokens(uri) == expected_splits(first + second, 0.2)


def test_append_eod_adds_the_id_only_where_a_document_lacks_it(tmp_path: Path, capsys) -> None:
    documents = [[[5, 6], [7, 9]], [[8, 8, 8]], [[4], []], [[3, 9]]]  # 1st and 4th end with 9 already
    prefix = write_megatron(tmp_path / "d", documents)
    uri = f"file://{tmp_path}/set"
    argv = [str(prefix), "--out", uri, "--vocab-size", "10", "--eos-token-id", "9"]
    assert import_cli(*argv, "--validation-fraction", "0", "--append-eod") == 0
    assert split_tokens(uri) == {"train": [5, 6, 7, 9, 8, 8, 8, 9, 4, 9, 3, 9]}
    assert read_manifest(open_storage(uri)).tokenizer["eod_appended"] is True
    said = " ".join(capsys.readouterr().out.split())
    assert "imported 4 document(s), 12 tokens" in said
    assert "end-of-document id 9 appended to 2, 2 ended with it" in said
    assert import_cli(*argv, "--validation-fraction", "0", "--force") == 0  # default: exactly as stored
    assert split_tokens(uri) == {"train": [5, 6, 7, 9, 8, 8, 8, 4, 3, 9]}
    said = " ".join(capsys.readouterr().out.split())
    assert (
        "2 of 4 end with end-of-document id 9; tokens kept as stored (--append-eod adds it to the others)"
        in said
    )


def test_documents_are_streamed_in_bounded_reads(tmp_path: Path) -> None:
    """A read smaller than a document: documents come in pieces, none larger than one read."""
    documents = [[list(range(100)), list(range(50))], [list(range(30))], [[]], [list(range(7))]]
    source = open_source(str(write_megatron(tmp_path / "d", documents)))
    pieces = list(document_pieces(source, read_index(source), read_bytes=64))
    assert max(len(tokens) for _, tokens, _ in pieces) == 32  # 64 bytes of uint16
    assert [(n, ends) for n, _, ends in pieces if ends] == [(0, True), (1, True), (3, True)]
    whole = [[t for s in d for t in s] for d in documents]
    for number in (0, 1, 3):
        assert np.concatenate([t for n, t, _ in pieces if n == number]).tolist() == whole[number]


def test_a_tokenizer_json_sets_the_vocabulary_and_is_stored_with_the_shards(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prefix = write_megatron(tmp_path / "d", corpus(5, seed=4, vocab_size=32, eod=1))
    uri = f"file://{tmp_path}/set"
    argv = [str(prefix), "--out", uri, "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert import_cli(*argv, "--validation-fraction", "0") == 0
    manifest = read_manifest(open_storage(uri))
    assert (manifest.vocab_size, manifest.eos_token_id) == (32, 1)
    assert manifest.tokenizer["eos_token"] == "</s>" and manifest.tokenizer["file"] == "tokenizer.json"
    assert (tmp_path / "set" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_import_from_and_to_gcs(gcs_bucket: str, gcs_client, tmp_path: Path) -> None:
    documents = corpus(12, seed=5, vocab_size=300, eod=299)
    idx, data = megatron_bytes(documents)
    bucket = gcs_client.bucket(gcs_bucket)
    bucket.blob("megatron/run1/corpus_text_document.idx").upload_from_string(idx)
    bucket.blob("megatron/run1/corpus_text_document.bin").upload_from_string(data)
    prefix, uri = f"gs://{gcs_bucket}/megatron/run1/corpus_text_document", f"gs://{gcs_bucket}/sets/imported"
    argv = [
        prefix,
        "--out",
        uri,
        "--vocab-size",
        "300",
        "--eos-token-id",
        "299",
        "--validation-fraction",
        "0.1",
    ]
    assert import_cli(*argv) == 0
    assert split_tokens(uri) == expected_splits(documents, 0.1)
    assert read_manifest(open_storage(uri)).tokenizer["sources"] == [prefix]


@pytest.mark.slow
def test_a_model_trains_one_epoch_of_the_imported_tokens(tmp_path: Path) -> None:
    """64 samples of seq_len 32 in the imported train split, 64 samples trained: every one of them once."""
    documents = [[list(range(i % 7, 300, 3)), [299]] for i in range(21)]  # ~2,100 tokens below 300
    prefix = write_megatron(tmp_path / "src" / "d", documents)
    data_uri = f"file://{tmp_path}/set"
    argv = [str(prefix), "--out", data_uri, "--vocab-size", "300", "--eos-token-id", "299"]
    assert import_cli(*argv, "--validation-fraction", "0") == 0
    train_tokens = read_manifest(open_storage(data_uri)).num_tokens("train")
    total = num_samples(num_tokens=train_tokens, seq_len=32)
    assert total == 65
    config = tiny_config(data_uri=data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"]["args"]["vocab_size"] = 300
    config["cluster"]["max_nodes"] = 1
    config["batch"] = {"global_batch_size": 16, "micro_batch_size": 16, "schedule": "0:16"}
    config["train"].update(total_samples=64, warmup_samples=16, eval_samples=0)
    plan = write_plan(tmp_path / "run", config)
    out = tmp_path / "run" / "out"
    result = run_batchpilot("train", "--plan", plan, "--stage", "all", "--output-dir", str(out), "--audit")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [record["loss"] for record in read_metrics(out / "metrics.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(300), abs=0.5)  # a fresh model on 300 ids
    positions = [
        int(p) for path in (out / "audit").glob("positions-rank*.txt")
        for line in path.read_text().splitlines() for p in line.split()[2:]
    ]  # fmt: skip
    samples = sorted(sample_at(p, num_samples=total, seed=0) for p in positions)
    assert len(samples) == 64 and len(set(samples)) == 64 and max(samples) < total
    assert json.loads((tmp_path / "set" / "manifest.json").read_text())["tokenizer"]["kind"] == "megatron"
