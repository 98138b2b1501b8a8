"""Which tokens each rank trains on: a pure function of consumed_samples, never of the world size.

Sample `i` of a split is tokens `[i * seq_len, i * seq_len + seq_len + 1)` of the concatenation of the
split's shards (consecutive samples share one token, as in Megatron: the last token of one is the first
target of the next). Position `p` of the consumed-sample counter, across epochs, reads sample
`SampleOrder.sample_at(p)`: within epoch `p // num_samples`, a seeded permutation of the epoch's samples.

The permutation is a block-window shuffle, so that a loader can read a few large contiguous ranges
instead of one small range per sample:

1. the samples are grouped into contiguous blocks of `block_samples` (the last block may be short);
2. the block order is permuted with (seed, epoch);
3. the permuted blocks are taken in windows of `window_blocks` (the last window may be short);
4. within each window, the window's samples are permuted with (seed, epoch, window).

Each step is a bijection (keyed Feistel networks with cycle walking: O(1) time and memory per position,
no table), the windows partition both the blocks and the positions, so the composition is a permutation
of the epoch's samples. The positions of one window read only that window's blocks.

An optimizer step at `consumed_samples` with `global_batch_size` covers positions
`[consumed_samples, consumed_samples + global_batch_size)`. Accumulation micro-step `a` covers the
`micro_batch_size x data_parallel_size` positions after the first `a` of them, and data-parallel rank `r`
takes the `r`-th run of `micro_batch_size` positions in it. So the union over ranks of one step is that
step's global batch whatever the world size, and a run resumed on a different number of nodes reads on
without losing or repeating a sample.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import gradient_accumulation_steps, num_loading_hosts

_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 6
_WINDOW_TAG = 0x57494E444F57  # separates the within-window keys from the block-order key

DEFAULT_BLOCK_SAMPLES = 128
DEFAULT_WINDOW_BLOCKS = 8


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a cheap bijective 64-bit hash."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def _key(*parts: int) -> int:
    """A 64-bit key hashed from integers of any size or sign."""
    key = 0
    for part in parts:
        key = _mix64(key ^ (part & _MASK64))
    return key


def _feistel(value: int, *, num_items: int, key: int, inverse: bool = False) -> int:
    """A keyed permutation of `range(num_items)` (or its inverse): Feistel rounds with cycle walking."""
    if num_items <= 2:
        shift = key % num_items
        return (value + (num_items - shift if inverse else shift)) % num_items
    half_bits = ((num_items - 1).bit_length() + 1) // 2
    half_mask = (1 << half_bits) - 1
    rounds = range(_FEISTEL_ROUNDS - 1, -1, -1) if inverse else range(_FEISTEL_ROUNDS)
    while True:  # cycle walking: the domain is < 4 x num_items, so a few laps on average
        left, right = value >> half_bits, value & half_mask
        for round_index in rounds:
            if inverse:
                round_key = _mix64((left + key + round_index * 0x9E3779B97F4A7C15) & _MASK64)
                left, right = right ^ (round_key & half_mask), left
            else:
                round_key = _mix64((right + key + round_index * 0x9E3779B97F4A7C15) & _MASK64)
                left, right = right, left ^ (round_key & half_mask)
        value = (left << half_bits) | right
        if value < num_items:
            return value


def permuted_index(index: int, *, num_items: int, seed: int, epoch: int, inverse: bool = False) -> int:
    """Element `index` of a pseudo-random permutation of `range(num_items)` keyed by (seed, epoch).

    With `inverse=True`, the index at which the permutation holds `index`.
    """
    if not 0 <= index < num_items:
        raise IndexError(f"index {index} outside range({num_items})")
    return _feistel(index, num_items=num_items, key=_key(seed, epoch), inverse=inverse)


@functools.lru_cache(maxsize=4096)
def _block_at(slot: int, *, num_blocks: int, seed: int, epoch: int) -> int:
    """The block order, cached: the positions of a window ask for the same few slots again and again."""
    return permuted_index(slot, num_items=num_blocks, seed=seed, epoch=epoch)


@functools.lru_cache(maxsize=64)
def _slot_of_block(block: int, *, num_blocks: int, seed: int, epoch: int) -> int:
    """Inverse of the block order, cached: every position of an epoch needs it for the short block."""
    return permuted_index(block, num_items=num_blocks, seed=seed, epoch=epoch, inverse=True)


def num_samples(*, num_tokens: int, seq_len: int) -> int:
    """Whole samples of `seq_len + 1` tokens (overlapping by one) in a split of `num_tokens`."""
    return max(0, (num_tokens - 1) // seq_len)


def check_block_window(*, block_samples: int, window_blocks: int) -> None:
    """Raises BatchpilotError naming the setting when a block or window size is not positive."""
    for field, value in (
        ("data.shuffle_block_samples", block_samples),
        ("data.shuffle_window_blocks", window_blocks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BatchpilotError(field, f"must be a positive integer, got {value!r}", "use e.g. 128 and 8")


@dataclass(frozen=True)
class SampleOrder:
    """The sample read at every consumed-sample position: a block-window shuffle per epoch.

    Attributes:
        num_samples: samples in the split (one epoch).
        seed: the run's seed.
        block_samples: K, contiguous samples per block (the last block holds the remainder).
        window_blocks: W, blocks per window; samples are shuffled freely within a window.
        shuffle: False reads samples in file order (blocks and windows then follow file order too).
    """

    num_samples: int
    seed: int
    block_samples: int = DEFAULT_BLOCK_SAMPLES
    window_blocks: int = DEFAULT_WINDOW_BLOCKS
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {self.num_samples}")
        check_block_window(block_samples=self.block_samples, window_blocks=self.window_blocks)

    @functools.cached_property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.block_samples)

    @functools.cached_property
    def num_windows(self) -> int:
        return -(-self.num_blocks // self.window_blocks)

    @functools.cached_property
    def _deficit(self) -> int:
        """How many samples the last block lacks (0 when it is full)."""
        return self.num_blocks * self.block_samples - self.num_samples

    def block_samples_range(self, block: int) -> range:
        """The samples of `block`: a contiguous range, so a contiguous range of tokens."""
        start = block * self.block_samples
        return range(start, min(start + self.block_samples, self.num_samples))

    def block_at(self, slot: int, *, epoch: int) -> int:
        """The block at place `slot` of epoch `epoch`'s block order."""
        if not self.shuffle:
            return slot
        return _block_at(slot, num_blocks=self.num_blocks, seed=self.seed, epoch=epoch)

    def window_blocks_of(self, *, epoch: int, window: int) -> list[int]:
        """The blocks of one window, in block-order slots."""
        first = window * self.window_blocks
        last = min(first + self.window_blocks, self.num_blocks)
        return [self.block_at(slot, epoch=epoch) for slot in range(first, last)]

    def window_of(self, position: int) -> tuple[int, int]:
        """(epoch, window) of a position: its sample is one of that window's blocks' samples."""
        epoch, index = divmod(position, self.num_samples)
        return epoch, self._locate(epoch, index)[0]

    def sample_at(self, position: int) -> int:
        """The sample read at consumed-sample position `position` (epochs repeat with a new order)."""
        if position < 0:
            raise IndexError(f"position {position} is negative")
        epoch, index = divmod(position, self.num_samples)
        if not self.shuffle:
            return index
        window, offset, short_slot = self._locate(epoch, index)
        num_slots = min(self.window_blocks, self.num_blocks - window * self.window_blocks)
        size = num_slots * self.block_samples - (self._deficit if short_slot is not None else 0)
        offset = _feistel(offset, num_items=size, key=_key(self.seed, epoch, _WINDOW_TAG, window))
        slot, within = self._split(offset, short_slot=short_slot)
        block = self.block_at(window * self.window_blocks + slot, epoch=epoch)
        return block * self.block_samples + within

    def _short_block_slot(self, epoch: int) -> int | None:
        """Where the short last block sits in epoch `epoch`'s block order (None: it is full)."""
        if self._deficit == 0:
            return None
        last = self.num_blocks - 1
        if not self.shuffle:
            return last
        return _slot_of_block(last, num_blocks=self.num_blocks, seed=self.seed, epoch=epoch)

    def window_positions(self, *, epoch: int, window: int) -> range:
        """The consumed-sample positions (across epochs) whose samples window `window` of `epoch` holds."""
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} outside range({self.num_windows})")
        short = self._short_block_slot(epoch)
        start = epoch * self.num_samples + self._window_start(window, short=short)
        end = (
            (epoch + 1) * self.num_samples
            if window + 1 == self.num_windows
            else epoch * self.num_samples + self._window_start(window + 1, short=short)
        )
        return range(start, end)

    def _window_start(self, window: int, *, short: int | None) -> int:
        """Window `w` starts at `w x W x K` positions, less the short block's deficit if that block sits in
        an earlier window (`short` is its slot in the epoch's block order, None when it is full)."""
        earlier = short is not None and short < window * self.window_blocks
        return window * self.window_blocks * self.block_samples - (self._deficit if earlier else 0)

    def _locate(self, epoch: int, index: int) -> tuple[int, int, int | None]:
        """(window, offset in the window, slot of the short block within the window or None).

        Window `index // (W x K)` or the next one holds `index` (see `_window_start`).
        """
        per_window = self.window_blocks * self.block_samples
        short = self._short_block_slot(epoch)

        def start(window: int) -> int:
            return self._window_start(window, short=short)

        window = index // per_window
        if window + 1 < self.num_windows and start(window + 1) <= index:
            window += 1
        first_slot = window * self.window_blocks
        in_window = short is not None and first_slot <= short < first_slot + self.window_blocks
        return (
            window,
            index - start(window),
            (short - first_slot if in_window and short is not None else None),
        )

    def _split(self, offset: int, *, short_slot: int | None) -> tuple[int, int]:
        """(slot within the window, sample within that block) of a window offset; blocks in slot order."""
        size = self.block_samples
        if short_slot is None or offset < short_slot * size:
            return divmod(offset, size)
        short_size = size - self._deficit
        if offset < short_slot * size + short_size:
            return short_slot, offset - short_slot * size
        slot, within = divmod(offset - short_slot * size - short_size, size)
        return short_slot + 1 + slot, within


def sample_at(
    position: int,
    *,
    num_samples: int,
    seed: int,
    shuffle: bool = True,
    block_samples: int = DEFAULT_BLOCK_SAMPLES,
    window_blocks: int = DEFAULT_WINDOW_BLOCKS,
) -> int:
    """The sample read at consumed-sample position `position`; see `SampleOrder`."""
    order = SampleOrder(
        num_samples=num_samples,
        seed=seed,
        block_samples=block_samples,
        window_blocks=window_blocks,
        shuffle=shuffle,
    )
    return order.sample_at(position)


def sample_token_range(sample: int, *, seq_len: int) -> tuple[int, int]:
    """Split-wide token range `[start, end)` of `sample`: `seq_len + 1` tokens."""
    return sample * seq_len, sample * seq_len + seq_len + 1


def block_token_range(samples: range, *, seq_len: int) -> tuple[int, int]:
    """Split-wide token range `[start, end)` of a block of contiguous samples."""
    return samples.start * seq_len, samples.stop * seq_len + 1


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


def rank_of_position(
    position: int,
    *,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> int:
    """The data-parallel rank that trains `position` when the steps from `consumed_samples` on all have
    this batch shape (the inverse of `rank_micro_batches` over those steps)."""
    offset = (position - consumed_samples) % global_batch_size
    return offset % (micro_batch_size * data_parallel_size) // micro_batch_size


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
