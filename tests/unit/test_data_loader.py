"""The loader in one process (expansion factor 1) on a local shard set, and shard-set errors.

Most tests use small blocks and windows (5 samples x 3 blocks) so that a few steps cross many windows
and blocks span shard boundaries; the expected samples are read directly, one range per sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from batchpilot.data.loader import TokenLoader
from batchpilot.data.prepare import prepare
from batchpilot.data.sampling import SampleOrder, sample_token_range, step_positions
from batchpilot.data.shards import HEADER_BYTES, ShardSet, encode_shard
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.errors import BatchpilotError
from batchpilot.storage import Storage

SEQ_LEN = 16
SMALL = {"shuffle_block_samples": 5, "shuffle_window_blocks": 3}


@pytest.fixture
def shard_uri(tmp_path: Path) -> str:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for index in range(30):
        (corpus / f"{index:02d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 300 + index * 10, dtype=np.uint8))
        )
    uri = f"file://{tmp_path}/shards"
    prepare(
        inputs=sorted(corpus.iterdir()),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=700,
        validation_fraction=0.1,
        show_progress=False,
    )
    return uri


def expected_step(
    uri: str, *, consumed: int, global_batch: int, seed: int = 0, block: int = 5, window: int = 3
) -> torch.Tensor:
    """The step's global batch, read directly: one row per position."""
    shards = ShardSet.open(uri=uri)
    order = SampleOrder(
        num_samples=(shards.num_tokens - 1) // SEQ_LEN, seed=seed, block_samples=block, window_blocks=window
    )
    ranges = [
        sample_token_range(order.sample_at(p), seq_len=SEQ_LEN)
        for p in step_positions(consumed_samples=consumed, global_batch_size=global_batch)
    ]
    return torch.from_numpy(np.stack(shards.read_tokens(ranges)).astype(np.int64))


@pytest.mark.parametrize(("block", "window"), [(5, 3), (128, 8)], ids=["small-blocks", "defaults"])
def test_micro_batches_shape_content_and_world_size_independence(
    shard_uri: str, block: int, window: int
) -> None:
    expected = expected_step(shard_uri, consumed=48, global_batch=24, block=block, window=window)
    for world_size, micro in ((1, 4), (2, 3), (4, 2), (3, 2)):
        accumulation = 24 // (micro * world_size)
        rows: list[torch.Tensor] = [torch.empty(0)] * 24
        for rank in range(world_size):
            with TokenLoader(
                uri=shard_uri,
                seq_len=SEQ_LEN,
                seed=0,
                rank=rank,
                world_size=world_size,
                shuffle_block_samples=block,
                shuffle_window_blocks=window,
            ) as loader:
                batches = loader.micro_batches(
                    consumed_samples=48,
                    global_batch_size=24,
                    micro_batch_size=micro,
                    gradient_accumulation_steps=accumulation,
                )
            assert len(batches) == accumulation
            for a, batch in enumerate(batches):
                assert batch.dtype == torch.int64 and batch.shape == (micro, SEQ_LEN + 1)
                for m in range(micro):
                    rows[a * micro * world_size + rank * micro + m] = batch[m]
        assert torch.equal(torch.stack(rows), expected), f"world size {world_size}"


def test_prefetch_follows_the_trainer_and_survives_a_batch_change(shard_uri: str) -> None:
    with TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=0, prefetch_steps=3, **SMALL) as loader:
        consumed = 0
        for global_batch in (4, 4, 4, 8, 8, 4):
            (batch,) = loader.micro_batches(
                consumed_samples=consumed,
                global_batch_size=global_batch,
                micro_batch_size=global_batch,
                gradient_accumulation_steps=1,
            )
            assert torch.equal(batch, expected_step(shard_uri, consumed=consumed, global_batch=global_batch))
            consumed += global_batch
        # Epochs wrap around: positions past the end read a new permutation.
        far = loader.num_samples * 3 + 5
        (batch,) = loader.micro_batches(
            consumed_samples=far, global_batch_size=4, micro_batch_size=4, gradient_accumulation_steps=1
        )
        assert torch.equal(batch, expected_step(shard_uri, consumed=far, global_batch=4))
        assert loader.vocab_size == 257 and loader.stats.num_steps == 7


def test_a_resumed_loader_reads_what_an_uninterrupted_one_reads(shard_uri: str) -> None:
    def run(start_step: int, num_steps: int) -> list[torch.Tensor]:
        with TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=4, **SMALL) as loader:
            return [
                batch
                for step in range(start_step, num_steps)
                for batch in loader.micro_batches(
                    consumed_samples=6 * step,
                    global_batch_size=6,
                    micro_batch_size=3,
                    gradient_accumulation_steps=2,
                )
            ]

    uninterrupted = run(0, 160)  # past the end of the first epoch
    for start_step in (1, 7, 120):  # mid-window, and shortly before the epoch boundary (~750 samples)
        assert all(
            torch.equal(a, b)
            for a, b in zip(run(start_step, 160), uninterrupted[2 * start_step :], strict=True)
        )


class CountingStorage:
    """Wraps a storage and records every read's (name, start, end)."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.reads, self.data = inner, list[tuple[str, int, int | None]](), list[bytes]()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        self.reads.append((name, start, end))
        self.data.append(self.inner.read(name, start=start, end=end, generation=generation))
        return self.data[-1]


def test_an_epoch_in_order_reads_each_block_once_with_few_large_reads(shard_uri: str) -> None:
    with TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=0, prefetch_steps=0, **SMALL) as loader:
        assert loader._shards is not None and loader._cache is not None
        storage = loader._shards.storage = CountingStorage(loader._shards.storage)
        order, global_batch = loader.order, 8
        windows: set[tuple[int, int]] = set()
        for consumed in range(0, order.num_samples - global_batch + 1, global_batch):
            (batch,) = loader.micro_batches(
                consumed_samples=consumed,
                global_batch_size=global_batch,
                micro_batch_size=global_batch,
                gradient_accumulation_steps=1,
            )
            assert torch.equal(batch, expected_step(shard_uri, consumed=consumed, global_batch=global_batch))
            windows |= {order.window_of(p) for p in range(consumed, consumed + global_batch)}
            # The cache holds only the windows of the current step: at most two of 3 blocks of 5 here.
            assert loader._cache.num_cached_samples <= 2 * 3 * 5
        # One rank trains whole windows, so it reads each of their blocks whole, once (adjacent blocks
        # overlap by one token, which one request reads once).
        blocks = [b for epoch, window in windows for b in order.window_blocks_of(epoch=epoch, window=window)]
        assert len(blocks) == len(set(blocks)) >= order.num_blocks - 3
        block_bytes = sum((len(order.block_samples_range(b)) * SEQ_LEN + 1) * 2 for b in blocks)
        assert block_bytes - 2 * len(blocks) <= loader.stats.num_storage_bytes_read <= block_bytes
        assert sum(len(data) for data in storage.data) == loader.stats.num_storage_bytes_read
        # One ranged read per block and shard it spans (adjacent blocks may share one), never per sample.
        num_shards = len(loader._shards.shards)
        assert len(storage.reads) == loader.stats.num_storage_requests <= len(blocks) + num_shards
        assert len(storage.reads) < loader.stats.num_samples_read / 4


def test_validation_split_and_arithmetic_errors(shard_uri: str) -> None:
    with TokenLoader(uri=shard_uri, split="validation", seq_len=SEQ_LEN, seed=0, shuffle=False) as loader:
        (batch,) = loader.micro_batches(
            consumed_samples=0, global_batch_size=2, micro_batch_size=2, gradient_accumulation_steps=1
        )
        (tokens,) = ShardSet.open(uri=shard_uri, split="validation").read_tokens([(0, SEQ_LEN + 1)])
        assert batch[0].tolist() == tokens.tolist()
        with pytest.raises(BatchpilotError, match="global_batch_size"):
            loader.micro_batches(
                consumed_samples=0, global_batch_size=3, micro_batch_size=2, gradient_accumulation_steps=1
            )


def test_a_shard_rewritten_while_reading_is_an_error(shard_uri: str, tmp_path: Path) -> None:
    with TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=0, prefetch_steps=0, **SMALL) as loader:
        loader.micro_batches(
            consumed_samples=0, global_batch_size=64, micro_batch_size=64, gradient_accumulation_steps=1
        )
        shard = tmp_path / "shards/train-00000.bin"
        shard.write_bytes(shard.read_bytes())  # same bytes, new version
        with pytest.raises(BatchpilotError, match=r"train-00000.bin: changed after it was opened"):
            for step in range(1, 20):
                loader.micro_batches(
                    consumed_samples=64 * step,
                    global_batch_size=64,
                    micro_batch_size=64,
                    gradient_accumulation_steps=1,
                )


def test_corrupted_missing_and_mistyped_shards_are_named(shard_uri: str, tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    shard = folder / "train-00001.bin"
    original = shard.read_bytes()
    shard.write_bytes(
        original[:HEADER_BYTES] + bytes([original[HEADER_BYTES] ^ 1]) + original[HEADER_BYTES + 1 :]
    )
    with pytest.raises(BatchpilotError, match=r"train-00001.bin: is corrupted: CRC32C"):
        TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=0)
    shard.write_bytes(original[:-2])
    with pytest.raises(BatchpilotError, match=r"train-00001.bin: is \d+ bytes, the manifest says"):
        ShardSet.open(uri=shard_uri)
    shard.unlink()
    with pytest.raises(
        BatchpilotError, match=r"train-00001.bin: is listed in the manifest but does not exist"
    ):
        ShardSet.open(uri=shard_uri)
    shard.write_bytes(original)
    # A manifest that says uint32 over uint16 shards.
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "dtype": "uint32"}))
    with pytest.raises(
        BatchpilotError, match=r"train-00000.bin: holds uint16 tokens but the manifest says uint32"
    ):
        ShardSet.open(uri=shard_uri, verify_checksums=False)
    manifest_path.write_text("{not json")
    with pytest.raises(BatchpilotError, match=r"manifest.json: is not a valid manifest"):
        ShardSet.open(uri=shard_uri)
    manifest_path.unlink()
    with pytest.raises(BatchpilotError, match=r"manifest.json: does not exist"):
        TokenLoader(uri=shard_uri, seq_len=SEQ_LEN, seed=0)
    shard.write_bytes(b"NOTASHARD" + encode_shard(np.zeros(3, np.uint16))[9:])
    with pytest.raises(BatchpilotError, match="not a batchpilot shard"):
        from batchpilot.data.shards import decode_header

        decode_header(shard.read_bytes(), uri=str(shard))


def test_too_little_data_for_one_sample(shard_uri: str) -> None:
    with pytest.raises(BatchpilotError, match="less than one sample"):
        TokenLoader(uri=shard_uri, split="validation", seq_len=100_000, seed=0)
