"""Sample order: a pure function of consumed_samples and the global batch, never of the world size."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchpilot.data.sampling import (
    SampleOrder,
    block_token_range,
    loading_group,
    num_samples,
    permuted_index,
    rank_micro_batches,
    sample_at,
    sample_token_range,
    step_positions,
)
from batchpilot.errors import BatchpilotError


@settings(max_examples=60, deadline=None)
@given(num_items=st.integers(1, 3000), seed=st.integers(-(2**70), 2**70), epoch=st.integers(0, 10**6))
def test_feistel_is_a_permutation_with_an_inverse(num_items: int, seed: int, epoch: int) -> None:
    order = [permuted_index(i, num_items=num_items, seed=seed, epoch=epoch) for i in range(num_items)]
    assert sorted(order) == list(range(num_items))
    back = [permuted_index(v, num_items=num_items, seed=seed, epoch=epoch, inverse=True) for v in order]
    assert back == list(range(num_items))


def epoch_order(order: SampleOrder, epoch: int) -> list[int]:
    return [order.sample_at(p) for p in range(epoch * order.num_samples, (epoch + 1) * order.num_samples)]


def check_epoch(order: SampleOrder, epoch: int) -> None:
    """One epoch is a permutation, and each window is a run of positions reading only its own blocks."""
    n, size = order.num_samples, order.block_samples
    samples = epoch_order(order, epoch)
    assert sorted(samples) == list(range(n))
    windows = [order.window_of(p) for p in range(epoch * n, (epoch + 1) * n)]
    assert {e for e, _ in windows} == {epoch}
    assert [w for _, w in windows] == sorted(w for _, w in windows)  # windows are runs of positions
    assert windows[-1][1] == order.num_windows - 1
    for (_, window), sample in zip(windows, samples, strict=True):
        assert sample // size in order.window_blocks_of(epoch=epoch, window=window)
    block_order = [order.block_at(slot, epoch=epoch) for slot in range(order.num_blocks)]
    assert sorted(block_order) == list(range(order.num_blocks))


def test_block_window_order_is_a_permutation_exhaustively() -> None:
    # Every size up to 30 with every block and window size up to 5 and 3: short last blocks (n % K) and
    # short last windows (blocks % W) in every combination, the short block in every window.
    for n in range(1, 31):
        for block_samples in range(1, 6):
            for window_blocks in range(1, 4):
                for seed, epoch in ((0, 0), (-7, 3)):
                    order = SampleOrder(
                        num_samples=n, seed=seed, block_samples=block_samples, window_blocks=window_blocks
                    )
                    check_epoch(order, epoch)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4000),
    block_samples=st.integers(1, 300),
    window_blocks=st.integers(1, 20),
    seed=st.integers(-(2**70), 2**70),
    epoch=st.integers(0, 10**6),
)
def test_block_window_order_is_a_permutation_at_larger_sizes(
    n: int, block_samples: int, window_blocks: int, seed: int, epoch: int
) -> None:
    order = SampleOrder(num_samples=n, seed=seed, block_samples=block_samples, window_blocks=window_blocks)
    check_epoch(order, epoch)


def test_order_is_pinned_so_resumed_runs_read_the_same_samples() -> None:
    # Literals: changing the permutation would silently change the data of resumed runs.
    order = SampleOrder(num_samples=10, seed=0, block_samples=3, window_blocks=2)
    # Blocks {0,1,2} {3,4,5} {6,7,8} {9}; epoch 0 takes them as 0 3 | 1 2, epoch 1 as 3 1 | 2 0.
    assert [order.block_at(slot, epoch=0) for slot in range(4)] == [0, 3, 1, 2]
    assert [order.block_at(slot, epoch=1) for slot in range(4)] == [3, 1, 2, 0]
    # Window 0 is samples {0, 1, 2, 9} (4 positions), window 1 the other six.
    assert epoch_order(order, 0) == [1, 2, 9, 0, 5, 8, 6, 3, 7, 4]
    assert epoch_order(order, 1) == [5, 9, 3, 4, 6, 1, 8, 7, 2, 0]
    assert [order.window_of(p) for p in range(10)] == [(0, 0)] * 4 + [(0, 1)] * 6
    # The defaults (128-sample blocks, 8-block windows): 7 samples are one short block in one window.
    assert [sample_at(p, num_samples=7, seed=0) for p in range(14)] == [
        4,
        2,
        5,
        3,
        1,
        6,
        0,
        6,
        5,
        1,
        4,
        0,
        2,
        3,
    ]


def test_epochs_and_seeds_reshuffle_and_blocks_mix() -> None:
    def order(seed: int) -> SampleOrder:
        return SampleOrder(num_samples=1000, seed=seed, block_samples=16, window_blocks=4)

    first, second, other_seed = epoch_order(order(1), 0), epoch_order(order(1), 1), epoch_order(order(2), 0)
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second and first != other_seed
    # Not just blocks in a new order: a window's samples interleave its blocks.
    assert len({sample // 16 for sample in first[:16]}) > 1
    unshuffled = SampleOrder(num_samples=5, seed=3, block_samples=2, window_blocks=2, shuffle=False)
    assert [unshuffled.sample_at(p) for p in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    assert [sample_at(p, num_samples=5, seed=3, shuffle=False) for p in range(7)] == [0, 1, 2, 3, 4, 0, 1]


@settings(max_examples=40, deadline=None)
@example(consumed=1772, global_batch=128)  # a step across the short window: three windows
@given(consumed=st.integers(0, 10**7), global_batch=st.integers(1, 600))
def test_a_step_reads_the_blocks_of_at_most_two_windows_when_it_fits_in_one(
    consumed: int, global_batch: int
) -> None:
    order = SampleOrder(num_samples=5003, seed=11, block_samples=32, window_blocks=4)
    positions = step_positions(consumed_samples=consumed, global_batch_size=global_batch)
    windows = {order.window_of(p) for p in positions}
    blocks = {order.sample_at(p) // 32 for p in positions}
    # A window holds 4 blocks of 32 samples, but the one holding the short last block (5003 = 156 x 32 + 11,
    # shuffled to any slot of the epoch) holds 21 fewer: a step of g spans at most ceil(g / 107) + 1 windows,
    # plus one when it crosses an epoch's end.
    shortest_window = 4 * 32 - (32 - 5003 % 32)
    crosses_epoch = consumed // 5003 != (consumed + global_batch - 1) // 5003
    assert len(windows) <= -(-global_batch // shortest_window) + 1 + crosses_epoch
    assert len(blocks) <= 4 * len(windows)


def test_block_and_window_sizes_must_be_positive() -> None:
    with pytest.raises(BatchpilotError, match=r"data\.shuffle_block_samples: must be a positive integer"):
        SampleOrder(num_samples=10, seed=0, block_samples=0)
    with pytest.raises(BatchpilotError, match=r"data\.shuffle_window_blocks"):
        SampleOrder(num_samples=10, seed=0, window_blocks=-1)


def test_samples_overlap_by_one_token() -> None:
    assert sample_token_range(0, seq_len=4) == (0, 5)
    assert sample_token_range(1, seq_len=4) == (4, 9)
    # A block of samples 3-5 is one contiguous range covering exactly their tokens.
    order = SampleOrder(num_samples=8, seed=0, block_samples=3)
    assert order.block_samples_range(1) == range(3, 6) and order.block_samples_range(2) == range(6, 8)
    assert block_token_range(range(3, 6), seq_len=4) == (12, 25) == (12, sample_token_range(5, seq_len=4)[1])
    assert num_samples(num_tokens=9, seq_len=4) == 2
    assert num_samples(num_tokens=8, seq_len=4) == 1
    assert num_samples(num_tokens=4, seq_len=4) == 0


@settings(max_examples=80, deadline=None)
@given(
    consumed=st.integers(0, 10**9),
    micro=st.integers(1, 8),
    data_parallel=st.integers(1, 16),
    accumulation=st.integers(1, 6),
)
def test_union_over_ranks_is_the_step(
    consumed: int, micro: int, data_parallel: int, accumulation: int
) -> None:
    global_batch = micro * data_parallel * accumulation
    per_rank = [
        rank_micro_batches(
            consumed_samples=consumed,
            global_batch_size=global_batch,
            micro_batch_size=micro,
            data_parallel_size=data_parallel,
            data_parallel_rank=rank,
        )
        for rank in range(data_parallel)
    ]
    union = sorted(p for ranges in per_rank for r in ranges for p in r)
    assert union == list(step_positions(consumed_samples=consumed, global_batch_size=global_batch))
    # Accumulation micro-step a of all ranks, in rank order, is the a-th contiguous run of the step.
    for a in range(accumulation):
        joined = [p for rank in range(data_parallel) for p in per_rank[rank][a]]
        start = consumed + a * micro * data_parallel
        assert joined == list(range(start, start + micro * data_parallel))


def test_rank_share_literal() -> None:
    # global 16 = micro 2 x dp 4 x accumulation 2; rank 1 takes positions 2-3 of each pass of 8.
    shares = rank_micro_batches(
        consumed_samples=32,
        global_batch_size=16,
        micro_batch_size=2,
        data_parallel_size=4,
        data_parallel_rank=1,
    )
    assert [list(r) for r in shares] == [[34, 35], [42, 43]]


def test_indivisible_batch_is_a_user_error() -> None:
    with pytest.raises(BatchpilotError, match="not divisible"):
        rank_micro_batches(
            consumed_samples=0,
            global_batch_size=10,
            micro_batch_size=4,
            data_parallel_size=1,
            data_parallel_rank=0,
        )


def test_loading_groups() -> None:
    groups = [
        loading_group(rank=r, world_size=8, local_world_size=2, expansion_factor=2).member_ranks
        for r in range(8)
    ]
    assert groups == [(0, 1, 2, 3)] * 4 + [(4, 5, 6, 7)] * 4
    assert loading_group(rank=5, world_size=8, local_world_size=2, expansion_factor=2).reader_rank == 4
    assert loading_group(rank=3, world_size=4, local_world_size=1, expansion_factor=1).member_ranks == (3,)
    assert loading_group(rank=3, world_size=4, local_world_size=1, expansion_factor=0.5).member_ranks == (3,)
    with pytest.raises(BatchpilotError, match="expansion_factor_real_data"):
        loading_group(rank=0, world_size=4, local_world_size=1, expansion_factor=3)
    with pytest.raises(BatchpilotError, match="whole number"):
        loading_group(rank=0, world_size=4, local_world_size=1, expansion_factor=1.5)
