"""Sample order: a pure function of consumed_samples and the global batch, never of the world size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.data.sampling import (
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
def test_each_epoch_is_a_permutation(num_items: int, seed: int, epoch: int) -> None:
    order = [permuted_index(i, num_items=num_items, seed=seed, epoch=epoch) for i in range(num_items)]
    assert sorted(order) == list(range(num_items))


def test_order_is_pinned_so_resumed_runs_read_the_same_samples() -> None:
    # A literal: changing the permutation would silently change the data of resumed runs.
    assert [sample_at(p, num_samples=7, seed=0) for p in range(14)] == [
        5,
        0,
        6,
        1,
        3,
        4,
        2,
        3,
        2,
        5,
        4,
        6,
        0,
        1,
    ]


def test_epochs_and_seeds_reshuffle() -> None:
    first = [sample_at(p, num_samples=1000, seed=1) for p in range(1000)]
    second = [sample_at(p, num_samples=1000, seed=1) for p in range(1000, 2000)]
    other_seed = [sample_at(p, num_samples=1000, seed=2) for p in range(1000)]
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second and first != other_seed
    assert [sample_at(p, num_samples=5, seed=3, shuffle=False) for p in range(7)] == [0, 1, 2, 3, 4, 0, 1]


def test_samples_overlap_by_one_token() -> None:
    assert sample_token_range(0, seq_len=4) == (0, 5)
    assert sample_token_range(1, seq_len=4) == (4, 9)
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
