"""The data layer against a real GCS server (fake-gcs-server) through google-cloud-storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gcs_server import GCSServer, fault_proxy

from batchpilot.cli import main
from batchpilot.data.loader import TokenLoader
from batchpilot.data.shards import ShardSet, crc32c
from batchpilot.errors import BatchpilotError
from batchpilot.storage import GenerationChanged, ObjectNotFound, PreconditionFailed, open_storage
from batchpilot.storage.gcs import GCSStorage, transient_retry


def make_corpus(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(1)
    for index in range(24):
        (folder / f"{index:02d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 500 + 37 * index, dtype=np.uint8))
        )
    return folder


def prepare_cli(corpus: Path, uri: str, *extra: str) -> int:
    return main(
        ["data", "prepare", str(corpus), "--out", uri, "--shard-size-tokens", "1500", "--no-progress", *extra]
    )


def steps(uri: str, *, num_steps: int = 6) -> list[torch.Tensor]:
    with TokenLoader(uri=uri, seq_len=32, seed=7) as loader:
        return [
            loader.micro_batches(
                consumed_samples=16 * step,
                global_batch_size=16,
                micro_batch_size=8,
                gradient_accumulation_steps=2,
            )[1]
            for step in range(num_steps)
        ]


def test_prepare_to_gcs_and_read_back(gcs_bucket: str, tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    gs_uri, local_uri = f"gs://{gcs_bucket}/sets/demo", f"file://{tmp_path}/local"
    assert prepare_cli(corpus, gs_uri) == 0 and prepare_cli(corpus, local_uri) == 0
    storage = open_storage(gs_uri)
    names = storage.list()
    assert "manifest.json" in names and "train-00000.bin" in names
    for name in names:  # the same bytes as a local prepare, and GCS agrees on the checksum
        data = storage.read(name)
        assert data == (tmp_path / "local" / name).read_bytes()
        assert storage.stat(name).crc32c == crc32c(data)
    assert all(torch.equal(a, b) for a, b in zip(steps(gs_uri), steps(local_uri), strict=True))
    assert prepare_cli(corpus, gs_uri) == 2  # refuses to overwrite
    assert open_storage(f"gs://{gcs_bucket}/sets").list() == [f"demo/{name}" for name in names]


def test_storage_contract_on_gcs(gcs_bucket: str) -> None:
    storage = open_storage(f"gs://{gcs_bucket}/ckpt")
    generation = storage.write("latest", b"0123456789", if_generation_match=0)
    assert storage.read("latest", start=3, end=7) == b"3456"
    assert storage.read("latest", start=8) == b"89"
    assert storage.read("latest", start=4, end=4) == b""
    assert storage.stat("latest").generation == generation and storage.exists("latest")
    with pytest.raises(PreconditionFailed, match=f"gs://{gcs_bucket}/ckpt/latest"):
        storage.write("latest", b"x", if_generation_match=0)
    newer = storage.write("latest", b"abc", if_generation_match=generation)
    assert newer != generation
    with pytest.raises(GenerationChanged, match="pinned generation"):
        storage.read("latest", generation=generation)
    storage.delete("latest")
    with pytest.raises(ObjectNotFound, match=f"gs://{gcs_bucket}/ckpt/latest: does not exist"):
        storage.stat("latest")


def test_generation_pinning_detects_an_overwrite(gcs_bucket: str, tmp_path: Path) -> None:
    uri = f"gs://{gcs_bucket}/pinned"
    assert prepare_cli(make_corpus(tmp_path / "corpus"), uri) == 0
    shards = ShardSet.open(uri=uri)
    before = shards.read_tokens([(0, 100)])[0]
    storage = open_storage(uri)
    storage.write("train-00000.bin", storage.read("train-00000.bin"))  # same bytes, new generation
    with pytest.raises(GenerationChanged, match=rf"gs://{gcs_bucket}/pinned/train-00000.bin: changed after"):
        shards.read_tokens([(0, 100)])
    assert np.array_equal(ShardSet.open(uri=uri).read_tokens([(0, 100)])[0], before)


def test_missing_and_corrupted_objects_are_named(gcs_bucket: str, tmp_path: Path, gcs_client: Any) -> None:
    with pytest.raises(BatchpilotError, match=r"gs://no-such-bucket: does not exist"):
        ShardSet.open(uri="gs://no-such-bucket/data")
    with pytest.raises(BatchpilotError, match=rf"gs://{gcs_bucket}/nothing/manifest.json: does not exist"):
        ShardSet.open(uri=f"gs://{gcs_bucket}/nothing")
    assert prepare_cli(make_corpus(tmp_path / "corpus"), "gs://no-such-bucket/x") == 2
    uri = f"gs://{gcs_bucket}/corrupt"
    assert prepare_cli(tmp_path / "corpus", uri) == 0
    blob = gcs_client.bucket(gcs_bucket).blob("corrupt/train-00001.bin")
    data = bytearray(blob.download_as_bytes())
    data[-1] ^= 0xFF
    blob.upload_from_string(bytes(data))
    with pytest.raises(BatchpilotError, match=rf"gs://{gcs_bucket}/corrupt/train-00001.bin: is corrupted"):
        ShardSet.open(uri=uri)


@pytest.mark.slow
def test_transient_errors_are_retried_and_the_data_is_identical(
    gcs_server: GCSServer, gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    direct_uri = f"gs://{gcs_bucket}/direct"
    assert prepare_cli(corpus, direct_uri) == 0
    expected = steps(direct_uri)
    with fault_proxy(upstream_port=gcs_server.port, fail_every=3) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        assert prepare_cli(corpus, f"gs://{gcs_bucket}/proxied") == 0
        for uri in (direct_uri, f"gs://{gcs_bucket}/proxied"):
            assert all(torch.equal(a, b) for a, b in zip(steps(uri), expected, strict=True))
        assert len(proxy.injected) >= 20 and {"503", "429", "drop", "truncate", "408"} <= set(proxy.injected)


def test_a_server_that_keeps_failing_is_reported(
    gcs_server: GCSServer, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fault_proxy(upstream_port=gcs_server.port, fail_every=1) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        storage = GCSStorage(bucket=gcs_bucket, prefix="x", retry=transient_retry(deadline_s=1.0))
        with pytest.raises(BatchpilotError, match=rf"gs://{gcs_bucket}/x/obj: still failing after retrying"):
            storage.read("obj")
