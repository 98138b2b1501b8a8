"""Checkpoints on GCS (fake-gcs-server through the real client): objects first, latest last, guarded."""

from __future__ import annotations

import pytest
import torch
from gcs_server import fault_proxy

from batchpilot.storage import PreconditionFailed, open_storage
from batchpilot.storage.gcs import GCSStorage
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state


def save(checkpointer: Checkpointer, step: int) -> str:
    return checkpointer.save(
        step=step,
        consumed_samples=step * 8,
        model={"w": torch.arange(4.0) * step},
        optimizer={"state": {}, "param_groups": []},
        rng=capture_rng_state(),
        extra={"world_size": 2},
    )


def test_checkpoint_round_trip_and_pruning_on_gcs(gcs_bucket):
    uri = f"gs://{gcs_bucket}/runs/demo/ckpt"
    checkpointer = Checkpointer(uri=uri, keep_last=2)
    assert checkpointer.load() is None
    for step in (3, 6, 9):
        assert save(checkpointer, step) == f"{uri}/{step:09d}"
    loaded = Checkpointer(uri=uri).load()
    assert (loaded.step, loaded.consumed_samples, loaded.meta["world_size"]) == (9, 72, 2)
    assert torch.equal(loaded.model["w"], torch.arange(4.0) * 9)
    names = open_storage(uri).list()
    assert sorted({n.split("/")[0] for n in names}) == ["000000006", "000000009", "latest"]


def test_latest_is_guarded_by_its_generation_on_gcs(gcs_bucket):
    uri = f"gs://{gcs_bucket}/ckpt"
    storage = open_storage(uri)
    checkpointer = Checkpointer(uri=uri, storage=storage)
    save(checkpointer, 1)
    stale = storage.stat("latest").generation
    save(checkpointer, 2)
    with pytest.raises(PreconditionFailed):
        storage.write("latest", b"000000001\n", if_generation_match=stale)
    assert checkpointer.latest_step() == 2


def test_a_byte_flipped_in_transit_is_caught_and_read_again(gcs_server, gcs_bucket, monkeypatch):
    """Every second object read through the proxy arrives with one byte flipped (same length). A whole-object
    read (meta.json, rng.pt) is caught by the client's CRC32C check and repeated; a ranged read of a shard's
    blocks (GCS has no checksum for a range) by the block's SHA-256 from meta.json, and the block is read
    again. The checkpoint loads with the bytes that were saved. Breaks when whole-object reads skip the
    CRC32C, or when a block that fails its checksum is not read again."""
    uri = f"gs://{gcs_bucket}/flip"
    saved = {"model": {"w": torch.arange(4096.0)}, "optimizer": {"state": {}, "param_groups": []}}
    Checkpointer(uri=uri).save_sharded(step=1, consumed_samples=8, state=saved, rng=capture_rng_state())
    with fault_proxy(upstream_port=gcs_server.port, fail_every=2, faults=("flip",)) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        loaded = Checkpointer(uri=uri).load()
        assert loaded is not None
        assert torch.equal(loaded.full_state()["model"]["w"], saved["model"]["w"])
    assert proxy.injected.count("flip") >= 2  # rng.pt, and the shard or .metadata


def test_a_large_object_upload_resumes_after_failed_chunks(gcs_server, gcs_bucket, monkeypatch):
    """A checkpoint file over 8 MiB goes up as a resumable upload; every fourth request fails (503, 429, a
    dropped connection, ...) and the client sends the failed chunk again from where GCS stopped, not the
    whole object. Breaks when such objects are uploaded in one request retried whole."""
    data = bytes(range(256)) * (40 * 1024)  # 10 MiB: ten chunks of 1 MiB
    with fault_proxy(upstream_port=gcs_server.port, fail_every=4) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        storage = GCSStorage(bucket=gcs_bucket, prefix="big", upload_chunk_bytes=1024 * 1024)
        storage.write("000000001/__0_0.distcp", data)
        assert len(proxy.injected) >= 3
        assert proxy.request_body_bytes < 2 * len(data)  # failed chunks again, not the object each time
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    assert open_storage(f"gs://{gcs_bucket}/big").read("000000001/__0_0.distcp") == data
