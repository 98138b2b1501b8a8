"""What a loader's reader fetches (`data.loader`), the rules a one-line slip would break unseen:

- a step that first touches a window plans the window's samples from ITS position on: a reader resuming in
  the middle of a window fetches what it will train from there, not the window's first half it trained
  before the resume;
- the read-coalescing budget is spent: the gaps closed between runs of one block add, together, at most
  `gap_share x len(samples)` samples (smallest gaps first), so a reader fetches at most READ_GAP_SHARE more
  samples than it needs.

A real shard set (`data prepare` of a small random corpus) read through a real TokenLoader of one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_data_loader_reads import SEQ_LEN, prepare_corpus

from batchpilot.data.loader import READ_GAP_SHARE, TokenLoader, read_runs

SMALL_WINDOWS = {"shuffle_block_samples": 16, "shuffle_window_blocks": 4}  # windows of 64 samples
TOKEN_BYTES = 2  # the byte tokenizer's uint16 shards
SAMPLE_BYTES = (SEQ_LEN + 1) * TOKEN_BYTES  # a run of one sample reads seq_len + 1 tokens


@pytest.fixture(scope="module")
def corpus_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """About 11K tokens: some 700 samples of 16 tokens, 11 windows of 64."""
    tmp: Path = tmp_path_factory.mktemp("audit-loader")
    return prepare_corpus(f"file://{tmp}/shards", tmp / "corpus", num_files=10)


def step_bytes(loader: TokenLoader, consumed: int, *, batch: int = 8, world_size: int = 1) -> int:
    """Bytes storage returned for one step of `batch` samples at `consumed` (no accumulation)."""
    before = loader.stats.num_storage_bytes_read
    loader.micro_batches(
        consumed_samples=consumed, global_batch_size=batch, micro_batch_size=batch // world_size,
        gradient_accumulation_steps=1,
    )  # fmt: skip
    return loader.stats.num_storage_bytes_read - before


def test_a_reader_resuming_mid_window_fetches_the_window_from_its_position_on(corpus_uri: str):
    with TokenLoader(
        uri=corpus_uri, seq_len=SEQ_LEN, seed=7, prefetch_steps=0, verify_checksums=False, **SMALL_WINDOWS
    ) as loader:
        window = loader.order.window_positions(epoch=0, window=3)
        resume_at = window.start + len(window) // 2
        fetched = step_bytes(loader, resume_at)
    remaining = window.stop - resume_at  # one rank trains every one of them from the resume on
    # At least those samples, at most the budget's share more (each run also reads one token past its end).
    assert remaining * SEQ_LEN * TOKEN_BYTES <= fetched <= (1 + READ_GAP_SHARE) * remaining * SAMPLE_BYTES
    # ... and the first half of the window, trained before the resume, is not fetched again.
    assert fetched < len(window) * SEQ_LEN * TOKEN_BYTES


def test_closing_gaps_spends_the_budget_smallest_first():
    samples = [0, 2, 4, 6, 8, 10, 13, 16, 17]  # gaps of 1, 1, 1, 1, 1, 2, 2 samples in one block
    budget = int(0.25 * len(samples))  # 2 samples
    runs = read_runs(samples, block_samples=64, gap_share=0.25)
    added = sum(last - first + 1 for first, last in runs) - len(samples)
    assert added <= budget
    # Two gaps of 1 close (the first two of the equal ones), every other gap stays open.
    assert runs == [(0, 4), (6, 6), (8, 8), (10, 10), (13, 13), (16, 17)]


def test_a_single_reader_fetches_at_most_the_budget_more_than_it_trains(corpus_uri: str):
    """One of two ranks reads for itself: its samples are scattered over the window's blocks, with gaps of a
    few samples that the budget may close, but only up to READ_GAP_SHARE of what it trains."""
    with TokenLoader(
        uri=corpus_uri, seq_len=SEQ_LEN, seed=7, prefetch_steps=0, verify_checksums=False, world_size=2,
        **SMALL_WINDOWS,
    ) as loader:  # fmt: skip
        window = loader.order.window_positions(epoch=0, window=0)
        fetched = step_bytes(loader, 0, batch=16, world_size=2)
    trained_in_window = len(window) // 2  # rank 0 of 2 trains half of every batch
    assert fetched <= (1 + READ_GAP_SHARE) * trained_in_window * SAMPLE_BYTES
