"""What a rank fetches from storage: its own samples, not the blocks they sit in.

The loaders of every rank of a simulated world run one after another in this process (expansion factor
1), each with its storage wrapped to count the bytes it returns, so 128 ranks need no 128 processes.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from batchpilot.data.loader import TokenLoader, read_runs
from batchpilot.data.prepare import prepare
from batchpilot.data.sampling import (
    SampleOrder,
    rank_micro_batches,
    rank_of_position,
    sample_token_range,
)
from batchpilot.data.shards import ShardSet
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.storage import Storage

SEQ_LEN = 16


class ByteCountingStorage:
    """Wraps a storage and counts the bytes and requests its reads return."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.num_bytes, self.num_requests = inner, 0, 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        data = self.inner.read(name, start=start, end=end, generation=generation)
        with self._lock:
            self.num_bytes, self.num_requests = self.num_bytes + len(data), self.num_requests + 1
        return data


def prepare_corpus(uri: str, corpus: Path, *, num_files: int, seed: int = 0) -> str:
    corpus.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(num_files):
        (corpus / f"{index:03d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 900 + 37 * index, dtype=np.uint8))
        )
    prepare(
        inputs=sorted(corpus.iterdir()),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=20_000,
        validation_fraction=0.0,
        show_progress=False,
    )
    return uri


@pytest.fixture(scope="module")
def corpus_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """About 72K tokens in 4 shards: 4,500 samples of 16 tokens, four and a half windows of 1,024."""
    tmp = tmp_path_factory.mktemp("reads")
    return prepare_corpus(f"file://{tmp}/shards", tmp / "corpus", num_files=60)


def direct_rows(uri: str, order: SampleOrder, positions: range) -> list[list[int]]:
    """The rows of `positions`, read directly, one range per sample."""
    shards = ShardSet.open(uri=uri, verify_checksums=False)
    ranges = [sample_token_range(order.sample_at(p), seq_len=SEQ_LEN) for p in positions]
    return [tokens.astype(np.int64).tolist() for tokens in shards.read_tokens(ranges)]


def run_world(
    uri: str,
    *,
    world_size: int,
    local_world_size: int,
    steps: list[tuple[int, int, int]],
    order: dict[str, int] | None = None,
    prefetch_steps: int = 1,
) -> tuple[dict[int, list[list[int]]], int, int, int]:
    """Each rank's loader in turn reads `steps` of (consumed, global batch, micro batch).

    Returns the rows of every step's positions as the ranks trained them (by position), and the bytes
    storage returned, the bytes trained and the requests, summed over ranks.
    """
    trained: dict[int, list[list[int]]] = {}
    fetched_bytes = trained_bytes = num_requests = 0
    for rank in range(world_size):
        with TokenLoader(
            uri=uri,
            seq_len=SEQ_LEN,
            seed=7,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            prefetch_steps=prefetch_steps,
            verify_checksums=False,
            **(order or {}),
        ) as loader:
            assert loader._shards is not None
            storage = loader._shards.storage = ByteCountingStorage(loader._shards.storage)
            for consumed, global_batch, micro in steps:
                accumulation = global_batch // (micro * world_size)
                batches = loader.micro_batches(
                    consumed_samples=consumed,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    gradient_accumulation_steps=accumulation,
                )
                micro_positions = rank_micro_batches(
                    consumed_samples=consumed,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    data_parallel_size=world_size,
                    data_parallel_rank=rank,
                )
                for batch, positions in zip(batches, micro_positions, strict=True):
                    for row, position in zip(batch.tolist(), positions, strict=True):
                        assert position not in trained, f"position {position} trained twice"
                        trained[position] = row
                        trained_bytes += len(row) * 2
        fetched_bytes += storage.num_bytes
        num_requests += storage.num_requests
    return trained, fetched_bytes, trained_bytes, num_requests


def test_read_runs_join_adjacent_samples_and_close_small_gaps_within_budget() -> None:
    samples = [0, 1, 2, 5, 7, 20, 21, 127, 128, 130]
    # No budget: adjacent samples of one block only (127 and 128 sit in different blocks).
    assert read_runs(samples, block_samples=128, gap_share=0.0) == [
        (0, 2),
        (5, 5),
        (7, 7),
        (20, 21),
        (127, 127),
        (128, 128),
        (130, 130),
    ]
    # 5 samples of budget: the gaps of 1 (6) and 2 (3, 4) close, the gap of 12 does not, the gap of 1
    # between 128 and 130 closes (1 + 2 + 1 = 4 <= 5); none across the block boundary at 128.
    assert read_runs(samples, block_samples=128, gap_share=0.5) == [
        (0, 7),
        (20, 21),
        (127, 127),
        (128, 130),
    ]


def test_rank_of_position_inverts_the_rank_split() -> None:
    for consumed, global_batch, micro, world in ((0, 24, 2, 4), (36, 24, 3, 2), (5, 12, 1, 3)):
        for rank in range(world):
            for step in range(3):
                for positions in rank_micro_batches(
                    consumed_samples=consumed + step * global_batch,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    data_parallel_size=world,
                    data_parallel_rank=rank,
                ):
                    for position in positions:
                        assert (
                            rank_of_position(
                                position,
                                consumed_samples=consumed,
                                global_batch_size=global_batch,
                                micro_batch_size=micro,
                                data_parallel_size=world,
                            )
                            == rank
                        )


def test_window_positions_hold_exactly_the_positions_of_their_window() -> None:
    cases = [(97, 5, 3, True), (100, 5, 4, True), (1000, 128, 8, True), (31, 4, 2, True), (97, 5, 3, False)]
    for num_samples, block, window, shuffle in cases:
        order = SampleOrder(
            num_samples=num_samples, seed=3, block_samples=block, window_blocks=window, shuffle=shuffle
        )
        for epoch in range(2):
            covered = []
            for index in range(order.num_windows):
                positions = order.window_positions(epoch=epoch, window=index)
                assert {order.window_of(p) for p in positions} == {(epoch, index)}
                blocks = set(order.window_blocks_of(epoch=epoch, window=index))
                assert {order.sample_at(p) // block for p in positions} == blocks
                covered += list(positions)
            assert covered == list(range(epoch * num_samples, (epoch + 1) * num_samples))


def test_a_rank_of_16_x_8_fetches_about_what_it_trains(corpus_uri: str) -> None:
    """128 ranks, micro batch 2, global batch 1024 (accumulation 4), default blocks and windows: every
    rank's samples of a window land in most of its 8 blocks, so whole blocks would be ~100x.

    Without prefetch: the steps a run prefetches past its last one are a constant (`prefetch_steps`
    steps), not a share of what it trains, and would dominate a run of four steps.
    """
    num_steps = 4
    steps = [(step * 1024, 1024, 2) for step in range(num_steps)]
    trained, fetched, trained_bytes, num_requests = run_world(
        corpus_uri, world_size=128, local_world_size=8, steps=steps, prefetch_steps=0
    )
    positions = range(num_steps * 1024)
    assert sorted(trained) == list(positions)
    with TokenLoader(uri=corpus_uri, seq_len=SEQ_LEN, seed=7, verify_checksums=False) as one:
        order = one.order
    assert [trained[p] for p in positions] == direct_rows(corpus_uri, order, positions)
    # What storage returned over every rank, per byte trained.
    assert fetched / trained_bytes <= 1.1, f"{fetched / trained_bytes:.3f} bytes fetched per byte trained"
    # About one request per sample trained, not one per block each rank touches (~8 per rank-step).
    assert num_requests <= 1.1 * len(positions)


def test_resume_mid_window_on_another_world_size_trains_every_sample_once(corpus_uri: str) -> None:
    """4 ranks train to the middle of a window, then 3 ranks (and a larger batch) train on to past
    the end of the epoch: every position exactly once, each the sample the order names."""
    small = {"shuffle_block_samples": 16, "shuffle_window_blocks": 4}  # windows of 64 samples
    with TokenLoader(uri=corpus_uri, seq_len=SEQ_LEN, seed=7, verify_checksums=False, **small) as one:
        order, num_samples = one.order, one.num_samples
    resume_at = 24 * 11  # 264: window 4 holds positions 256-319, so this is its middle
    assert order.window_of(resume_at - 1) == order.window_of(resume_at)
    before, _, _, _ = run_world(
        corpus_uri,
        world_size=4,
        local_world_size=2,
        steps=[(c, 24, 3) for c in range(0, resume_at, 24)],
        order=small,
    )
    end = num_samples + 120  # into the second epoch
    after_steps = [(c, 24, 2) for c in range(resume_at, resume_at + 240, 24)]
    after_steps += [(c, 36, 2) for c in range(resume_at + 240, end, 36)]
    after, _, _, _ = run_world(corpus_uri, world_size=3, local_world_size=3, steps=after_steps, order=small)
    assert not before.keys() & after.keys()
    trained = {**before, **after}
    last = after_steps[-1][0] + after_steps[-1][1]
    assert sorted(trained) == list(range(last))
    assert [trained[p] for p in range(last)] == direct_rows(corpus_uri, order, range(last))
    # The first epoch: every sample once.
    first_epoch = [order.sample_at(p) for p in range(num_samples)]
    assert Counter(first_epoch) == Counter(range(num_samples))


def test_a_step_the_window_plan_did_not_cover_is_read_with_the_step(corpus_uri: str) -> None:
    """A step earlier in a window than the step that planned it (same shape): its samples were not
    planned, and are read with the step."""
    small = {"shuffle_block_samples": 16, "shuffle_window_blocks": 4}
    with TokenLoader(
        uri=corpus_uri, seq_len=SEQ_LEN, seed=7, prefetch_steps=0, verify_checksums=False, **small
    ) as loader:
        window = loader.order.window_positions(epoch=0, window=2)
        for consumed in (window.start + 16, window.start):
            (batch,) = loader.micro_batches(
                consumed_samples=consumed,
                global_batch_size=8,
                micro_batch_size=8,
                gradient_accumulation_steps=1,
            )
            positions = range(consumed, consumed + 8)
            assert batch.tolist() == direct_rows(corpus_uri, loader.order, positions)
