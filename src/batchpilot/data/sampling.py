"""Which tokens each rank trains on: a pure function of consumed_samples, never of the world size.

Sample `i` of a split is tokens `[i * seq_len, i * seq_len + seq_len + 1)` of the concatenation of the
split's shards (consecutive samples share one token, as in Megatron: the last token of one is the first
target of the next). Position `p` of the consumed-sample counter, across epochs, reads sample
`permutation(seed, epoch)[p % num_samples]` with `epoch = p // num_samples`.

An optimizer step at `consumed_samples` with `global_batch_size` covers positions
`[consumed_samples, consumed_samples + global_batch_size)`. Accumulation micro-step `a` covers the
`micro_batch_size x data_parallel_size` positions after the first `a` of them, and data-parallel rank `r`
takes the `r`-th run of `micro_batch_size` positions in it. So the union over ranks of one step is that
step's global batch whatever the world size, and a run resumed on a different number of nodes reads on
without losing or repeating a sample.

The permutation is a keyed Feistel network with cycle walking: any position maps to its sample in
O(1) time and memory, and the order depends on nothing but (seed, epoch, num_samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import gradient_accumulation_steps, num_loading_hosts

_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 6


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a cheap bijective 64-bit hash."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def permuted_index(index: int, *, num_items: int, seed: int, epoch: int) -> int:
    """Element `index` of a pseudo-random permutation of `range(num_items)` keyed by (seed, epoch)."""
    if not 0 <= index < num_items:
        raise IndexError(f"index {index} outside range({num_items})")
    if num_items <= 2:
        return (index + (epoch + seed) % num_items) % num_items
    half_bits = ((num_items - 1).bit_length() + 1) // 2
    half_mask = (1 << half_bits) - 1
    key = _mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64))
    value = index
    while True:  # cycle walking: the domain is < 4 x num_items, so a few laps on average
        left, right = value >> half_bits, value & half_mask
        for round_index in range(_FEISTEL_ROUNDS):
            round_key = _mix64((right + key + round_index * 0x9E3779B97F4A7C15) & _MASK64)
            left, right = right, left ^ (round_key & half_mask)
        value = (left << half_bits) | right
        if value < num_items:
            return value


def num_samples(*, num_tokens: int, seq_len: int) -> int:
    """Whole samples of `seq_len + 1` tokens (overlapping by one) in a split of `num_tokens`."""
    return max(0, (num_tokens - 1) // seq_len)


def sample_at(position: int, *, num_samples: int, seed: int, shuffle: bool = True) -> int:
    """The sample read at consumed-sample position `position` (epochs repeat with a new order)."""
    epoch, index = divmod(position, num_samples)
    return permuted_index(index, num_items=num_samples, seed=seed, epoch=epoch) if shuffle else index


def sample_token_range(sample: int, *, seq_len: int) -> tuple[int, int]:
    """Split-wide token range `[start, end)` of `sample`: `seq_len + 1` tokens."""
    return sample * seq_len, sample * seq_len + seq_len + 1


def step_positions(*, consumed_samples: int, global_batch_size: int) -> range:
    """The positions of the optimizer step that starts at `consumed_samples`."""
    return range(consumed_samples, consumed_samples + global_batch_size)


def rank_micro_batches(
    *,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    data_parallel_rank: int,
) -> list[range]:
    """Positions of each accumulation micro-step of one data-parallel rank, for one optimizer step."""
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise IndexError(f"data_parallel_rank {data_parallel_rank} outside range({data_parallel_size})")
    accumulation_steps = gradient_accumulation_steps(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
    )
    per_pass = micro_batch_size * data_parallel_size
    starts = (
        consumed_samples + a * per_pass + data_parallel_rank * micro_batch_size
        for a in range(accumulation_steps)
    )
    return [range(start, start + micro_batch_size) for start in starts]


@dataclass(frozen=True)
class LoadingGroup:
    """One storage reader and the ranks it feeds (itself included), in rank order."""

    reader_rank: int
    member_ranks: tuple[int, ...]


def loading_group(
    *, rank: int, world_size: int, local_world_size: int, expansion_factor: float
) -> LoadingGroup:
    """The loading group of `rank`: hosts are `local_world_size` consecutive ranks.

    With factor f > 1 every f-th host is a loading host; its first rank reads for all ranks of that host
    and the next (f - 1) hosts. With f <= 1 every rank reads its own samples.

    Raises:
        BatchpilotError: when f > 1 is not a whole number dividing the number of hosts.
    """
    if world_size % local_world_size:
        raise BatchpilotError(
            "cluster.devices_per_node",
            f"world size {world_size} is not a multiple of {local_world_size} ranks per node",
        )
    if expansion_factor <= 1:
        return LoadingGroup(reader_rank=rank, member_ranks=(rank,))
    factor = Fraction(expansion_factor)
    if factor.denominator != 1:
        raise BatchpilotError(
            "data.expansion_factor_real_data",
            f"{expansion_factor} is not a whole number; a loading host serves a whole number of hosts",
            "use 1 or an integer that divides the node count",
        )
    num_hosts = world_size // local_world_size
    num_loading_hosts(num_hosts=num_hosts, expansion_factor=factor, samples_per_host_pass=local_world_size)
    ranks_per_group = int(factor) * local_world_size
    first = rank // ranks_per_group * ranks_per_group
    return LoadingGroup(reader_rank=first, member_ranks=tuple(range(first, first + ranks_per_group)))
