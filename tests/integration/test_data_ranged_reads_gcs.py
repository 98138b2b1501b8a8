"""Each rank's ranged reads of its own samples, against a real GCS server (fake-gcs-server)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from batchpilot.data.loader import TokenLoader
from batchpilot.data.prepare import prepare
from batchpilot.data.sampling import rank_micro_batches, sample_token_range
from batchpilot.data.shards import HEADER_BYTES, ShardSet
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.storage import Storage

SEQ_LEN = 16
ORDER = {"shuffle_block_samples": 16, "shuffle_window_blocks": 4}  # windows of 64 samples


class RecordingStorage:
    """Wraps a storage and records every read's range and the bytes it returned."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.reads = inner, list[tuple[str, int, int | None, int]]()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        data = self.inner.read(name, start=start, end=end, generation=generation)
        with self._lock:
            self.reads.append((name, start, end, len(data)))
        return data


def test_eight_ranks_read_their_own_samples_from_gcs_with_ranged_reads(
    gcs_bucket: str, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(2)
    for index in range(10):
        (corpus / f"{index:02d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 1000 + 53 * index, dtype=np.uint8))
        )
    uri = f"gs://{gcs_bucket}/ranged"
    prepare(
        inputs=sorted(corpus.iterdir()),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=4000,
        validation_fraction=0.0,
        show_progress=False,
    )
    shards = ShardSet.open(uri=uri)
    world_size, micro, global_batch, num_steps = 8, 2, 64, 6
    rows: dict[int, list[int]] = {}
    reads: list[tuple[str, int, int | None, int]] = []
    for rank in range(world_size):
        with TokenLoader(
            uri=uri, seq_len=SEQ_LEN, seed=5, rank=rank, world_size=world_size, prefetch_steps=0, **ORDER
        ) as loader:
            assert loader._shards is not None
            storage = loader._shards.storage = RecordingStorage(loader._shards.storage)
            order = loader.order
            for step in range(num_steps):
                batches = loader.micro_batches(
                    consumed_samples=step * global_batch,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    gradient_accumulation_steps=global_batch // (micro * world_size),
                )
                positions = rank_micro_batches(
                    consumed_samples=step * global_batch,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    data_parallel_size=world_size,
                    data_parallel_rank=rank,
                )
                for batch, micro_positions in zip(batches, positions, strict=True):
                    rows.update(zip(micro_positions, batch.tolist(), strict=True))
        reads += storage.reads
    num_positions = num_steps * global_batch
    assert sorted(rows) == list(range(num_positions))
    expected = shards.read_tokens(
        [sample_token_range(order.sample_at(p), seq_len=SEQ_LEN) for p in range(num_positions)]
    )
    assert [rows[p] for p in range(num_positions)] == [tokens.tolist() for tokens in expected]
    # Every read is a range of token bytes, never a whole shard, and all of them together are about
    # the bytes trained (6 windows of 64 samples of 17 uint16 tokens).
    sizes = {shard.name: shard.num_bytes for shard in shards.shards}
    assert all(
        start >= HEADER_BYTES and end is not None and end <= sizes[name] for name, start, end, _ in reads
    )
    assert all(returned == end - start for _, start, end, returned in reads if end is not None)
    fetched, trained = sum(returned for *_, returned in reads), num_positions * (SEQ_LEN + 1) * 2
    assert fetched / trained <= 1.1, f"{fetched / trained:.3f} bytes fetched per byte trained"
