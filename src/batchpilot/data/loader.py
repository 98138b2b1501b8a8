"""The trainer's data loader: per optimizer step, exactly this rank's micro-batches.

With `expansion_factor` f > 1 only the first rank of every f-th host (a "loading host", as in MaxText)
reads from storage: it reads the samples of all ranks of its host and of the next f - 1 hosts and sends
each rank its own over a dedicated gloo process group. With f <= 1 every rank reads its own samples.

A reader fetches only the samples its ranks train (`SampleCache`): the sample order (`SampleOrder`, a
block-window shuffle) makes every step draw from the few blocks of one or two windows, and when a step
first touches a window the reader fetches every sample of it that its ranks will train, one ranged read
per run of adjacent samples. One rank reading for itself alone thus reads whole blocks (each once per
epoch), and one rank of 128 about one sample per block: storage returns about the bytes it trains at
any world size (whole blocks for every rank cost ~85x at 16 x 8, bench/data_loader.py).

A background thread prepares the next `prefetch_steps` steps, guessing that the next step starts where
this one ends with the same batch shape. The guesses depend only on the calls the trainer makes, which
are the same on every rank, so readers and receivers always work through the same sequence of steps; a
wrong guess (a batch-size change) costs at most `prefetch_steps` wasted reads.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from batchpilot.data.sampling import (
    DEFAULT_BLOCK_SAMPLES,
    DEFAULT_WINDOW_BLOCKS,
    LoadingGroup,
    SampleOrder,
    check_block_window,
    loading_group,
    num_samples,
    rank_micro_batches,
    rank_of_position,
)
from batchpilot.data.shards import ShardSet
from batchpilot.errors import BatchpilotError

_OK, _FAILED = 1, 0


@dataclass(frozen=True)
class StepKey:
    """What identifies one optimizer step's data."""

    consumed_samples: int
    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    def next(self) -> StepKey:
        return StepKey(
            self.consumed_samples + self.global_batch_size,
            self.global_batch_size,
            self.micro_batch_size,
            self.gradient_accumulation_steps,
        )


@dataclass
class LoaderStats:
    """Where the trainer's time went: `wait_s` blocked on data over `num_steps` steps.

    `num_samples_read` and `num_bytes_read` count the samples a reader produced (for its whole group);
    `num_storage_requests` and `num_storage_bytes_read` what storage returned to produce them.
    """

    num_steps: int = 0
    wait_s: float = 0.0
    num_samples_read: int = 0
    num_bytes_read: int = 0
    num_storage_requests: int = 0
    num_storage_bytes_read: int = 0


# A reader merges two runs of samples of one block when the samples between them, summed over the merges
# of one read, stay within this share of the samples it needs: fewer requests for at most 5% more bytes.
READ_GAP_SHARE = 0.05


class SampleCache:
    """The samples a reader's ranks train from the windows one step touches, fetched a window at a time.

    When a step first touches a window, the reader fetches every sample of that window its ranks will
    train from that step on if the batch shape stays the same: the windows' positions are shuffled
    within the window, so a rank among many trains a few samples scattered over the window's blocks, and
    fetching whole blocks would read `world size / ranks read for` times what it trains. Adjacent samples
    of one block are one ranged read; runs a few samples apart are merged within `READ_GAP_SHARE`. A
    reader that trains whole windows (one rank, or a loading host feeding every rank) so reads each block
    whole once, and a rank of 128 reads only its own samples, about one per block.

    A step with another batch shape plans the windows it touches again; a sample a step needs that no
    plan covered is read with the step, so the plan decides what is fetched, never what is trained.
    Before each step the samples outside the step's windows are dropped: the cache holds at most the
    reader's share of `ceil(step / window) + 1` windows.
    """

    def __init__(
        self, *, shards: ShardSet, order: SampleOrder, seq_len: int, world_size: int, stats: LoaderStats
    ) -> None:
        self._shards, self._order, self._seq_len, self._stats = shards, order, seq_len, stats
        self._world_size = world_size
        self._samples: dict[int, np.ndarray] = {}
        # (epoch, window) -> the batch shape its plan assumed: (global batch, micro batch, grid offset).
        self._planned: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._lock = threading.Lock()

    @property
    def num_cached_samples(self) -> int:
        return len(self._samples)

    def samples(self, positions: list[int], *, key: StepKey, ranks: tuple[int, ...]) -> np.ndarray:
        """int32 tokens `[len(positions), seq_len + 1]` of the samples at `positions`, which `ranks`
        train in the step `key`."""
        order, seq_len = self._order, self._seq_len
        samples = [order.sample_at(position) for position in positions]
        windows = {order.window_of(position) for position in positions}
        keep = {
            block for epoch, window in windows for block in order.window_blocks_of(epoch=epoch, window=window)
        }
        shape = (key.global_batch_size, key.micro_batch_size, key.consumed_samples % key.global_batch_size)
        with self._lock:
            self._samples = {s: t for s, t in self._samples.items() if s // order.block_samples in keep}
            self._planned = {w: planned for w, planned in self._planned.items() if w in windows}
            wanted = set(samples)
            for window in sorted(w for w in windows if self._planned.get(w) != shape):
                wanted.update(self._window_samples(window, key=key, ranks=ranks))
                self._planned[window] = shape
            self._fetch(sorted(wanted - self._samples.keys()))
            out = np.empty((len(samples), seq_len + 1), dtype=np.int32)
            for row, sample in enumerate(samples):
                out[row] = self._samples[sample]
        return out

    def _window_samples(self, window: tuple[int, int], *, key: StepKey, ranks: tuple[int, ...]) -> list[int]:
        """The samples of `window` that `ranks` train from `key`'s step on, if every step has its shape."""
        epoch, index = window
        positions = self._order.window_positions(epoch=epoch, window=index)
        members = set(ranks)
        return [
            self._order.sample_at(position)
            for position in range(max(positions.start, key.consumed_samples), positions.stop)
            if rank_of_position(
                position,
                consumed_samples=key.consumed_samples,
                global_batch_size=key.global_batch_size,
                micro_batch_size=key.micro_batch_size,
                data_parallel_size=self._world_size,
            )
            in members
        ]

    def _fetch(self, samples: list[int]) -> None:
        """Reads the sorted, distinct `samples` into the cache, one ranged read per run."""
        if not samples:
            return
        seq_len = self._seq_len
        runs = read_runs(samples, block_samples=self._order.block_samples, gap_share=READ_GAP_SHARE)
        ranges = [(first * seq_len, last * seq_len + seq_len + 1) for first, last in runs]
        wanted = iter(samples)
        sample = next(wanted, None)
        for (first, last), tokens in zip(
            runs, self._shards.read_tokens(ranges, coalesce_gap_bytes=0), strict=True
        ):
            while sample is not None and sample <= last:
                offset = (sample - first) * seq_len
                self._samples[sample] = tokens[offset : offset + seq_len + 1]
                sample = next(wanted, None)
        self._stats.num_storage_requests = self._shards.num_requests
        self._stats.num_storage_bytes_read = self._shards.num_bytes_fetched


def read_runs(samples: list[int], *, block_samples: int, gap_share: float) -> list[tuple[int, int]]:
    """Sorted, distinct `samples` as runs `(first, last)` to read, each within one block.

    Adjacent samples share a run; then the smallest gaps between runs of one block are closed while the
    samples they add stay within `gap_share x len(samples)`.
    """
    runs: list[tuple[int, int]] = []
    for sample in samples:
        if runs and sample == runs[-1][1] + 1 and sample // block_samples == runs[-1][0] // block_samples:
            runs[-1] = (runs[-1][0], sample)
        else:
            runs.append((sample, sample))
    gaps = sorted(
        (runs[i + 1][0] - runs[i][1] - 1, i)
        for i in range(len(runs) - 1)
        if runs[i][0] // block_samples == runs[i + 1][0] // block_samples
    )
    allowance, closed = int(gap_share * len(samples)), set()
    for size, i in gaps:
        if size > allowance:
            break
        allowance -= size
        closed.add(i)
    merged: list[tuple[int, int]] = []
    for i, run in enumerate(runs):
        if i - 1 in closed:
            merged[-1] = (merged[-1][0], run[1])
        else:
            merged.append(run)
    return merged


class TokenLoader:
    """Fixed-length token samples for one rank, deterministic in `consumed_samples` and resumable.

    Every rank of the job constructs one, at the same point of the program (with f > 1 the constructor
    creates a process group, a collective call), after `torch.distributed.init_process_group`.
    """

    def __init__(
        self,
        *,
        uri: str,
        seq_len: int,
        seed: int,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        local_world_size: int = 1,
        expansion_factor: float = 1.0,
        prefetch_steps: int = 2,
        shuffle: bool = True,
        verify_checksums: bool = True,
        num_read_threads: int = 8,
        shuffle_block_samples: int = DEFAULT_BLOCK_SAMPLES,
        shuffle_window_blocks: int = DEFAULT_WINDOW_BLOCKS,
    ) -> None:
        """Opens the shard set (loading ranks only) and starts the prefetch thread.

        Args:
            uri: shard set root, `file://...` or `gs://...`.
            seq_len: tokens the model sees per sample; each sample holds `seq_len + 1`.
            seed: shuffling seed (the run's seed).
            split: `train` or `validation`.
            rank, world_size: this process in the job; data-parallel rank and size (no tensor or
                pipeline parallelism yet).
            local_world_size: ranks per host (node).
            expansion_factor: `expansion_factor_real_data`; f > 1 means one reader per f hosts.
            prefetch_steps: optimizer steps prepared ahead; memory is bounded by this many steps.
            shuffle: a new seeded order each epoch (False: samples in file order, e.g. for evaluation).
            verify_checksums: check every shard against the manifest when opening.
            num_read_threads: concurrent storage requests of a loading rank.
            shuffle_block_samples: K, contiguous samples per block: a reader's samples of one block are
                read in runs, a whole block with one ranged read when its ranks train all of it.
            shuffle_window_blocks: W, blocks per shuffling window: samples mix freely within a window.
                A reader holds its ranks' samples of at most the windows of one step, two when a step is
                at most W x K samples (a reader of every rank at K 128, W 8, seq_len 1024, uint16: about
                4 MB; a rank of 128 about 1/128 of that).
        """
        if seq_len <= 0 or prefetch_steps < 0:
            raise BatchpilotError(
                "data.seq_len",
                f"seq_len must be positive and prefetch_steps >= 0 ({seq_len}, {prefetch_steps})",
            )
        check_block_window(block_samples=shuffle_block_samples, window_blocks=shuffle_window_blocks)
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.group: LoadingGroup = loading_group(
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            expansion_factor=expansion_factor,
        )
        self.is_reader = rank == self.group.reader_rank
        self._process_group = self._new_process_group(expansion_factor=expansion_factor)
        self._shards: ShardSet | None = None
        self.stats = LoaderStats()
        self._open(uri=uri, split=split, verify_checksums=verify_checksums, num_threads=num_read_threads)
        self.order = SampleOrder(
            num_samples=self.num_samples,
            seed=seed,
            block_samples=shuffle_block_samples,
            window_blocks=shuffle_window_blocks,
            shuffle=shuffle,
        )
        self._cache = (
            None
            if self._shards is None
            else SampleCache(
                shards=self._shards,
                order=self.order,
                seq_len=seq_len,
                world_size=world_size,
                stats=self.stats,
            )
        )
        self._prefetch_steps = prefetch_steps
        self._issued: collections.deque[StepKey] = collections.deque()
        self._discard: set[StepKey] = set()
        self._results: dict[StepKey, list[torch.Tensor] | BaseException] = {}
        self._commands: collections.deque[StepKey | None] = collections.deque()
        self._condition = threading.Condition()
        self._worker = threading.Thread(target=self._work, name=f"token-loader-{rank}", daemon=True)
        self._worker.start()

    def _new_process_group(self, *, expansion_factor: float) -> dist.ProcessGroup | None:
        if expansion_factor <= 1 or self.world_size == 1:
            return None
        if not dist.is_initialized():
            raise BatchpilotError(
                "data.expansion_factor_real_data",
                f"{expansion_factor} needs torch.distributed to forward data, and it is not initialised",
                "call torch.distributed.init_process_group first, or use 1",
            )
        # A group of its own: the prefetch thread's sends must not interleave with the trainer's collectives.
        group: dist.ProcessGroup | None = dist.new_group(backend="gloo")
        return group

    def _open(self, *, uri: str, split: str, verify_checksums: bool, num_threads: int) -> None:
        """Readers open the shard set and tell their members its size, or that it failed."""
        members = [r for r in self.group.member_ranks if r != self.rank]
        if not self.is_reader:
            header = self._receive(what="open the shard set", shape=(3,), dtype=torch.int64)
            self.vocab_size, self.eos_token_id, self.num_tokens = (int(v) for v in header)
        else:
            try:
                self._shards = ShardSet.open(
                    uri=uri, split=split, verify_checksums=verify_checksums, num_threads=num_threads
                )
            except BaseException as error:
                for member in members:
                    self._send_failure(member, error)
                raise
            manifest = self._shards.manifest
            self.vocab_size, self.eos_token_id = manifest.vocab_size, manifest.eos_token_id
            self.num_tokens = self._shards.num_tokens
            for member in members:
                self._send_ok(member, torch.tensor([self.vocab_size, self.eos_token_id, self.num_tokens]))
        self.num_samples = num_samples(num_tokens=self.num_tokens, seq_len=self.seq_len)
        if self.num_samples == 0:
            raise BatchpilotError(
                f"{uri} ({split})",
                f"has {self.num_tokens} tokens, less than one sample of {self.seq_len + 1}",
            )

    # -- messages between a reader and its members: a header [status, payload size], then the payload ----

    def _send_ok(self, dst: int, payload: torch.Tensor) -> None:
        dist.send(torch.tensor([_OK, payload.numel()]), dst, group=self._process_group)
        dist.send(payload.contiguous(), dst, group=self._process_group)

    def _send_failure(self, dst: int, error: BaseException) -> None:
        message = torch.frombuffer(bytearray(str(error).encode() or b"?"), dtype=torch.uint8)
        dist.send(torch.tensor([_FAILED, message.numel()]), dst, group=self._process_group)
        dist.send(message, dst, group=self._process_group)

    def _receive(self, *, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        reader = self.group.reader_rank
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, reader, group=self._process_group)
        status, size = (int(v) for v in header)
        if status == _OK:
            payload = torch.empty(shape, dtype=dtype)
            dist.recv(payload, reader, group=self._process_group)
            return payload
        message = torch.empty(size, dtype=torch.uint8)
        dist.recv(message, reader, group=self._process_group)
        raise BatchpilotError(
            f"loading rank {reader}", f"could not {what}: {bytes(message.tolist()).decode()}"
        )

    # -- the trainer's side ---------------------------------------------------------------------------

    def micro_batches(
        self,
        *,
        consumed_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
    ) -> list[torch.Tensor]:
        """This rank's micro-batches of the optimizer step starting at `consumed_samples`.

        Returns:
            `gradient_accumulation_steps` int64 tensors of shape `[micro_batch_size, seq_len + 1]`;
            inputs are `[:, :-1]` and targets `[:, 1:]`.

        Raises:
            BatchpilotError: when the batch arithmetic does not hold for this world size, or reading
                failed (the message names the object).
        """
        per_step = micro_batch_size * self.world_size * gradient_accumulation_steps
        if per_step != global_batch_size or consumed_samples < 0:
            raise BatchpilotError(
                "batch.global_batch_size",
                f"{global_batch_size} != micro_batch_size {micro_batch_size} x world size {self.world_size} x "
                f"gradient_accumulation_steps {gradient_accumulation_steps} = {per_step}",
            )
        key = StepKey(consumed_samples, global_batch_size, micro_batch_size, gradient_accumulation_steps)
        started = time.perf_counter()
        with self._condition:
            if key not in self._issued:
                self._issue(key)
            # Steps issued before this one were guesses that did not come true.
            while self._issued[0] != key:
                stale = self._issued.popleft()
                if self._results.pop(stale, None) is None:
                    self._discard.add(stale)
            ahead = self._issued[-1]
            while len(self._issued) <= self._prefetch_steps:
                ahead = ahead.next()
                self._issue(ahead)
            while key not in self._results:
                self._condition.wait()
            self._issued.popleft()
            result = self._results.pop(key)
        self.stats.wait_s += time.perf_counter() - started
        self.stats.num_steps += 1
        if isinstance(result, BaseException):
            raise result
        return result

    def _issue(self, key: StepKey) -> None:
        self._issued.append(key)
        self._commands.append(key)
        self._condition.notify_all()

    def close(self) -> None:
        """Stops the prefetch thread (after its current step) and releases the shard set."""
        with self._condition:
            self._commands.append(None)
            self._condition.notify_all()
        self._worker.join(timeout=60)
        if self._shards is not None:
            self._shards.close()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the prefetch thread --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._commands:
                    self._condition.wait()
                key = self._commands.popleft()
            if key is None:
                return
            result: list[torch.Tensor] | BaseException
            try:
                result = self._read_step(key) if self.is_reader else self._receive_step(key)
            except BaseException as error:  # handed to the trainer's thread, raised there
                result = error
            with self._condition:
                if key in self._discard:
                    self._discard.remove(key)
                else:
                    self._results[key] = result
                self._condition.notify_all()

    def _receive_step(self, key: StepKey) -> list[torch.Tensor]:
        shape = (key.gradient_accumulation_steps, key.micro_batch_size, self.seq_len + 1)
        tokens = self._receive(
            what=f"read the step at consumed_samples {key.consumed_samples}", shape=shape, dtype=torch.int32
        )
        return _int64_micro_batches(tokens)

    def _read_step(self, key: StepKey) -> list[torch.Tensor]:
        """Reads the step for every member of the group, sends theirs and returns this rank's."""
        assert self._shards is not None
        members = self.group.member_ranks
        try:
            per_member = self.read_samples(key, ranks=members)
        except BaseException as error:
            for member in members:
                if member != self.rank:
                    self._send_failure(member, error)
            raise
        own: list[torch.Tensor] = []
        for member, tokens in zip(members, per_member, strict=True):
            if member == self.rank:
                own = _int64_micro_batches(tokens)
            else:
                self._send_ok(member, tokens)
        return own

    def read_samples(self, key: StepKey, *, ranks: tuple[int, ...]) -> list[torch.Tensor]:
        """Reads, from storage, the int32 tokens `[accumulation, micro, seq_len + 1]` of `ranks` for one step."""
        assert self._shards is not None, "only loading ranks read from storage"
        positions = [
            position
            for rank in ranks
            for micro in rank_micro_batches(
                consumed_samples=key.consumed_samples,
                global_batch_size=key.global_batch_size,
                micro_batch_size=key.micro_batch_size,
                data_parallel_size=self.world_size,
                data_parallel_rank=rank,
            )
            for position in micro
        ]
        assert self._cache is not None
        tokens = self._cache.samples(positions, key=key, ranks=ranks)
        self.stats.num_samples_read += len(positions)
        self.stats.num_bytes_read += len(positions) * (self.seq_len + 1) * self._shards.dtype.itemsize
        shape = (len(ranks), key.gradient_accumulation_steps, key.micro_batch_size, self.seq_len + 1)
        return list(torch.from_numpy(tokens.reshape(shape)).unbind(0))


def _int64_micro_batches(tokens: torch.Tensor) -> list[torch.Tensor]:
    """int32 `[accumulation, micro, seq_len + 1]` as int64 micro-batches; numpy converts without
    starting torch's intra-op threads, which are slow to wake on small tensors and compete with training."""
    return list(torch.from_numpy(tokens.numpy().astype(np.int64)).unbind(0))
