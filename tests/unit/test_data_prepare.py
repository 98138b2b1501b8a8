"""`batchpilot data prepare` and the shard format, on a local folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchpilot.cli import main
from batchpilot.data.prepare import collect_inputs, prepare
from batchpilot.data.shards import HEADER_BYTES, ShardSet
from batchpilot.data.tokenizers import ByteTokenizer, load_tokenizer
from batchpilot.errors import BatchpilotError


def make_corpus(folder: Path, *, num_documents: int = 20) -> list[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    documents = []
    for index in range(num_documents):
        text = f"document {index}: " + " ".join(f"word{index * 7 + j}" for j in range(40 + index)) + "\n"
        (folder / f"doc{index:03d}.txt").write_text(text)
        documents.append(text.encode())
    (folder / "ignored.bin").write_bytes(b"\x00\x01")  # not *.txt
    return documents


def byte_stream(documents: list[bytes]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(d, np.uint8).astype(np.int64), 256) for d in documents])


def test_prepare_writes_shards_and_manifest(tmp_path: Path) -> None:
    documents = make_corpus(tmp_path / "corpus")
    uri = f"file://{tmp_path}/shards"
    manifest = prepare(
        inputs=collect_inputs([str(tmp_path / "corpus")], glob="*.txt"),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=1000,
        validation_fraction=0.1,
        show_progress=False,
    )
    validation = [d for i, d in enumerate(documents) if i in (0, 10)]  # every 10th document
    train = [d for i, d in enumerate(documents) if i not in (0, 10)]
    assert manifest.num_tokens("train") == byte_stream(train).size
    assert manifest.num_tokens("validation") == byte_stream(validation).size
    assert all(s.num_tokens == 1000 for s in manifest.splits["train"][:-1])
    document = json.loads((tmp_path / "shards/manifest.json").read_text())
    assert document["vocab_size"] == 257 and document["dtype"] == "uint16"
    assert document["tokenizer"] == {"kind": "bytes"}
    shard = (tmp_path / "shards" / manifest.splits["train"][0].name).read_bytes()
    assert shard[:8] == b"BPTOKENS" and len(shard) == HEADER_BYTES + 2000
    shards = ShardSet.open(uri=uri, split="train")
    total = shards.num_tokens
    (everything,) = shards.read_tokens([(0, total)])
    np.testing.assert_array_equal(everything.astype(np.int64), byte_stream(train))
    # A range that crosses shard boundaries.
    (middle,) = shards.read_tokens([(990, 2011)])
    np.testing.assert_array_equal(middle, everything[990:2011])


def test_refuses_to_overwrite_without_force_and_cleans_up_with_it(tmp_path: Path) -> None:
    make_corpus(tmp_path / "corpus")
    uri = f"file://{tmp_path}/shards"
    args = ["data", "prepare", str(tmp_path / "corpus"), "--out", uri, "--no-progress"]
    assert main([*args, "--shard-size-tokens", "500"]) == 0
    many = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert main([*args, "--shard-size-tokens", "5K"]) == 2
    assert main([*args, "--shard-size-tokens", "5K", "--force"]) == 0
    few = sorted(p.name for p in (tmp_path / "shards").iterdir() if not p.name.startswith("."))
    assert len(few) < len(many) and set(few) <= set(many)
    ShardSet.open(uri=uri)


def test_cli_errors_name_the_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "inspect", f"file://{tmp_path}/empty"]) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path}/empty/manifest.json: does not exist" in error and "batchpilot data prepare" in error
    assert len(error.strip().splitlines()) == 1
    assert main(["data", "prepare", str(tmp_path / "missing.txt"), "--out", f"file://{tmp_path}/x"]) == 2
    assert "missing.txt: does not exist" in capsys.readouterr().err
    assert main(["data", "prepare", "--out", f"file://{tmp_path}/x"]) == 2


def test_demo_corpus_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"file://{tmp_path}/demo"
    assert (
        main(["data", "prepare", "--demo", "--out", uri, "--shard-size-tokens", "4M", "--no-progress"]) == 0
    )
    capsys.readouterr()
    assert main(["data", "inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "validation" in out and "vocab_size 257" in out
    shards = ShardSet.open(uri=uri, split="validation")
    assert shards.num_tokens > 1000


def test_huggingface_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    documents = make_corpus(tmp_path / "corpus", num_documents=6)
    words = sorted({w for d in documents for w in d.decode().split()})
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    manifest = prepare(
        inputs=collect_inputs([str(tmp_path / "corpus")], glob="*.txt"),
        out_uri=f"file://{tmp_path}/shards",
        tokenizer=tokenizer,
        shard_size_tokens=64,
        validation_fraction=0.0,
        show_progress=False,
    )
    assert manifest.vocab_size == len(vocab) and manifest.eos_token_id == 1
    assert manifest.tokenizer["kind"] == "huggingface" and "validation" not in manifest.splits
    (tokens,) = ShardSet.open(uri=f"file://{tmp_path}/shards").read_tokens(
        [(0, manifest.num_tokens("train"))]
    )
    expected = [t for d in documents for t in [vocab[w] for w in d.decode().split()] + [1]]
    assert tokens.tolist() == expected
    with pytest.raises(BatchpilotError, match="--eos-token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"), eos_token="<nope>")


def test_invalid_options(tmp_path: Path) -> None:
    make_corpus(tmp_path / "corpus", num_documents=3)
    files = collect_inputs([str(tmp_path / "corpus")], glob="*.txt")
    common = {"inputs": files, "tokenizer": ByteTokenizer(), "show_progress": False}
    with pytest.raises(BatchpilotError, match="--validation-fraction"):
        prepare(out_uri=f"file://{tmp_path}/a", shard_size_tokens=100, validation_fraction=0.6, **common)  # type: ignore[arg-type]
    with pytest.raises(BatchpilotError, match="no training data"):
        prepare(
            inputs=files[:1],
            tokenizer=ByteTokenizer(),
            show_progress=False,
            out_uri=f"file://{tmp_path}/c",
            shard_size_tokens=100,
            validation_fraction=0.5,
        )
    with pytest.raises(BatchpilotError, match="--shard-size-tokens"):
        prepare(out_uri=f"file://{tmp_path}/b", shard_size_tokens=1, validation_fraction=0, **common)  # type: ignore[arg-type]
    with pytest.raises(BatchpilotError, match="holds no files matching"):
        collect_inputs([str(tmp_path / "corpus")], glob="*.md")
