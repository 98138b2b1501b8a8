"""Benchmark: the token loader against a raw download of the same shards, from the same GCS server.

Starts fake-gcs-server on loopback (the helper of tests/integration), prepares the demo corpus (the
Python standard library's source) into it, then measures in one run:

1. baseline: a sequential whole-object download of every train shard with google-cloud-storage;
2. the loader reading shuffled samples with no overlap (bytes of samples per second), as a ratio to 1,
   and what it fetched from storage for them (blocks, bytes);
3. a simulated trainer (torch matmuls for `--step-time-s` per step) with prefetch: the fraction of
   step time spent waiting for data (target < 2%);
4. multi-rank: every rank of each simulated `--worlds` world (nodes x devices per node; default 16 x 8
   and 2 x 8, micro batch 2, global batch 1024, expansion factor 1), one rank after another in this
   process, each with its own loader: bytes fetched from storage per byte trained (target <= 1.1 at
   16 x 8), storage requests, and the time per rank-step.

The loader uses its default block-window shuffle (`--block-samples`, `--window-blocks`): with 64 samples
per step and 1024-sample windows, one step in 16 starts a window and fetches its 8 blocks; the default
48 steps cross three windows.

Usage: .venv/bin/python bench/data_loader.py [--seq-len 1024] [--global-batch-size 64] [--steps 48]
       [--rows single,multi] [--worlds 16x8,2x8] [--multi-steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchpilot.data.loader import LoaderStats, TokenLoader
from batchpilot.data.prepare import demo_inputs, prepare
from batchpilot.data.sampling import DEFAULT_BLOCK_SAMPLES, DEFAULT_WINDOW_BLOCKS
from batchpilot.data.shards import read_manifest
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.storage import Storage, open_storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from gcs_server import gcs_server_running

THREADS = int(os.environ.get("BENCH_THREADS", "8"))  # concurrent requests of the loader
TARGET_WAIT_FRACTION = 0.02
TARGET_FETCHED_PER_TRAINED = 1.1


def raw_download_bytes_per_s(uri: str, names: list[str]) -> tuple[int, float]:
    """Bytes and seconds of downloading `names` one after the other, whole objects."""
    from google.cloud import storage as gcs

    bucket_name, _, prefix = uri.removeprefix("gs://").partition("/")
    bucket = gcs.Client().bucket(bucket_name)
    started = time.perf_counter()
    num_bytes = sum(len(bucket.blob(f"{prefix}/{name}").download_as_bytes()) for name in names)
    return num_bytes, time.perf_counter() - started


def loader_throughput(
    uri: str, *, seq_len: int, global_batch_size: int, num_steps: int, order: dict[str, int]
) -> tuple[LoaderStats, float]:
    """Loader statistics and seconds for `num_steps` steps read back to back (no prefetch, no compute)."""
    with TokenLoader(
        uri=uri, seq_len=seq_len, seed=0, prefetch_steps=0, num_read_threads=THREADS, **order
    ) as loader:
        started = time.perf_counter()
        for step in range(num_steps):
            loader.micro_batches(
                consumed_samples=step * global_batch_size,
                global_batch_size=global_batch_size,
                micro_batch_size=global_batch_size // 8,
                gradient_accumulation_steps=8,
            )
        return loader.stats, time.perf_counter() - started


@dataclass
class MultiRankResult:
    """What every rank of a simulated world fetched from storage for what it trained."""

    fetched_bytes: int
    trained_bytes: int
    num_requests: int
    step_s: float  # seconds of `micro_batches` summed over ranks and steps


class CountingStorage:
    """Counts the bytes and requests the storage layer returns to one rank's loader."""

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


def multi_rank(
    uri: str,
    *,
    seq_len: int,
    num_nodes: int,
    devices_per_node: int,
    micro_batch_size: int,
    global_batch_size: int,
    num_steps: int,
    order: dict[str, int],
) -> MultiRankResult:
    """Each rank's loader in turn reads `num_steps` steps; storage reads after opening are counted."""
    world_size = num_nodes * devices_per_node
    accumulation = global_batch_size // (micro_batch_size * world_size)
    result = MultiRankResult(0, 0, 0, 0.0)
    for rank in range(world_size):
        with TokenLoader(
            uri=uri,
            seq_len=seq_len,
            seed=0,
            rank=rank,
            world_size=world_size,
            local_world_size=devices_per_node,
            prefetch_steps=0,
            num_read_threads=THREADS,
            **order,
        ) as loader:
            assert loader._shards is not None
            storage = loader._shards.storage = CountingStorage(loader._shards.storage)
            started = time.perf_counter()
            for step in range(num_steps):
                loader.micro_batches(
                    consumed_samples=step * global_batch_size,
                    global_batch_size=global_batch_size,
                    micro_batch_size=micro_batch_size,
                    gradient_accumulation_steps=accumulation,
                )
            result.step_s += time.perf_counter() - started
            result.fetched_bytes += storage.num_bytes
            result.num_requests += storage.num_requests
            result.trained_bytes += loader.stats.num_bytes_read
    return result


def compute_for(seconds: float, matrix: torch.Tensor) -> None:
    """Stands in for forward/backward: real CPU work (the loader thread competes with it) for `seconds`."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        matrix @ matrix


def wait_fraction(
    uri: str,
    *,
    seq_len: int,
    global_batch_size: int,
    num_steps: int,
    step_time_s: float,
    order: dict[str, int],
) -> float:
    """Share of a simulated trainer's wall time spent blocked on `micro_batches` (after warm-up)."""
    matrix = torch.randn(256, 256)
    with TokenLoader(
        uri=uri, seq_len=seq_len, seed=1, prefetch_steps=2, num_read_threads=THREADS, **order
    ) as loader:
        first = dict(consumed_samples=0, global_batch_size=global_batch_size)
        loader.micro_batches(**first, micro_batch_size=global_batch_size // 8, gradient_accumulation_steps=8)
        loader.stats.wait_s = 0.0
        started = time.perf_counter()
        for step in range(1, num_steps + 1):
            loader.micro_batches(
                consumed_samples=step * global_batch_size,
                global_batch_size=global_batch_size,
                micro_batch_size=global_batch_size // 8,
                gradient_accumulation_steps=8,
            )
            compute_for(step_time_s, matrix)
        return loader.stats.wait_s / (time.perf_counter() - started)


def single_rank_rows(uri: str, args: argparse.Namespace, order: dict[str, int], raw_rate: float) -> None:
    """Rows 2 and 3: one rank reading the whole global batch, then the simulated trainer's wait."""
    stats, loader_s = loader_throughput(
        uri,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch_size,
        num_steps=args.steps,
        order=order,
    )
    loader_rate = stats.num_bytes_read / loader_s
    print(
        f"loader    shuffled samples (seq_len {args.seq_len}, {args.global_batch_size}/step, no overlap, "
        f"blocks of {args.block_samples} samples, windows of {args.window_blocks} blocks): "
        f"{stats.num_bytes_read / 1e6:.1f} MB in {loader_s:.2f} s = {loader_rate / 1e6:.0f} MB/s = "
        f"{loader_rate / raw_rate:.3f}x raw; {loader_s / args.steps * 1e3:.1f} ms per step"
    )
    print(
        f"storage   fetched {stats.num_storage_bytes_read / 1e6:.1f} MB "
        f"for {stats.num_samples_read} samples over {args.steps} steps"
    )
    for step_time_s in (float(value) for value in args.step_time_s.split(",")):
        fraction = wait_fraction(
            uri,
            seq_len=args.seq_len,
            global_batch_size=args.global_batch_size,
            num_steps=args.steps,
            step_time_s=step_time_s,
            order=order,
        )
        verdict = "PASS" if fraction < TARGET_WAIT_FRACTION else "ABOVE TARGET"
        print(
            f"trainer   {step_time_s * 1e3:.0f} ms compute/step, prefetch 2: waited {fraction:.2%} of "
            f"step time for data (target < 2%: {verdict})"
        )


def multi_rank_row(
    uri: str,
    args: argparse.Namespace,
    order: dict[str, int],
    raw_rate: float,
    *,
    num_nodes: int,
    devices_per_node: int,
) -> None:
    """Row 4: bytes fetched per byte trained over every rank of a simulated world."""
    result = multi_rank(
        uri,
        seq_len=args.seq_len,
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.multi_global_batch_size,
        num_steps=args.multi_steps,
        order=order,
    )
    ratio = result.fetched_bytes / result.trained_bytes
    num_rank_steps = num_nodes * devices_per_node * args.multi_steps
    trained_rate = result.trained_bytes / result.step_s
    verdict = "PASS" if ratio <= TARGET_FETCHED_PER_TRAINED else "ABOVE TARGET"
    print(
        f"multi     {num_nodes} x {devices_per_node} ranks, micro batch {args.micro_batch_size}, "
        f"global batch {args.multi_global_batch_size}, {args.multi_steps} steps: fetched "
        f"{result.fetched_bytes / 1e6:.1f} MB in {result.num_requests} requests for "
        f"{result.trained_bytes / 1e6:.1f} MB trained = {ratio:.3f} bytes fetched per byte trained "
        f"(target <= {TARGET_FETCHED_PER_TRAINED}: {verdict}); {result.step_s / num_rank_steps * 1e3:.1f} "
        f"ms per rank-step, {trained_rate / 1e6:.1f} MB/s trained = {trained_rate / raw_rate:.3f}x raw"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="single,multi", help="single, multi or both, comma-separated")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--block-samples", type=int, default=DEFAULT_BLOCK_SAMPLES)
    parser.add_argument("--window-blocks", type=int, default=DEFAULT_WINDOW_BLOCKS)
    parser.add_argument(
        "--step-time-s",
        default="0.1,0.5",
        help="simulated compute per optimizer step, comma-separated values",
    )
    parser.add_argument("--worlds", default="16x8,2x8", help="NODESxDEVICES_PER_NODE, comma-separated")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--multi-global-batch-size", type=int, default=1024)
    parser.add_argument("--multi-steps", type=int, default=4)
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    torch.set_num_threads(1)
    order = {"shuffle_block_samples": args.block_samples, "shuffle_window_blocks": args.window_blocks}
    with tempfile.TemporaryDirectory() as tmp, gcs_server_running(log_path=Path(tmp) / "gcs.log") as server:
        os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
        from google.cloud import storage as gcs

        gcs.Client().create_bucket("bench")
        uri = "gs://bench/demo"
        prepare(
            inputs=demo_inputs(),
            out_uri=uri,
            tokenizer=ByteTokenizer(),
            shard_size_tokens=2_000_000,
            validation_fraction=0.0,
            show_progress=False,
        )
        manifest = read_manifest(open_storage(uri))
        names = [shard.name for shard in manifest.splits["train"]]
        raw_bytes, raw_s = raw_download_bytes_per_s(uri, names)
        raw_rate = raw_bytes / raw_s
        print(
            f"data loader benchmark: demo corpus, {manifest.num_tokens('train') / 1e6:.1f}M tokens in "
            f"{len(names)} shards, fake-gcs-server on {server.endpoint}"
        )
        print(
            f"baseline  raw sequential download: {raw_bytes / 1e6:.1f} MB in {raw_s:.2f} s = "
            f"{raw_rate / 1e6:.0f} MB/s"
        )
        if "single" in rows:
            single_rank_rows(uri, args, order, raw_rate)
        if "multi" in rows:
            for world in args.worlds.split(","):
                num_nodes, devices_per_node = (int(value) for value in world.split("x"))
                multi_rank_row(
                    uri, args, order, raw_rate, num_nodes=num_nodes, devices_per_node=devices_per_node
                )


if __name__ == "__main__":
    main()
