"""Benchmark: the token loader against a raw download of the same shards, from the same GCS server.

Starts fake-gcs-server on loopback (the helper of tests/integration), prepares the demo corpus (the
Python standard library's source) into it, then measures in one run:

1. baseline: a sequential whole-object download of every train shard with google-cloud-storage;
2. the loader reading shuffled samples with no overlap (bytes of samples per second), as a ratio to 1,
   and what it fetched from storage for them (blocks, bytes);
3. a simulated trainer (torch matmuls for `--step-time-s` per step) with prefetch: the fraction of
   step time spent waiting for data (target < 2%).

The loader uses its default block-window shuffle (`--block-samples`, `--window-blocks`): with 64 samples
per step and 1024-sample windows, one step in 16 starts a window and fetches its 8 blocks; the default
48 steps cross three windows.

Usage: .venv/bin/python bench/data_loader.py [--seq-len 1024] [--global-batch-size 64] [--steps 48]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from batchpilot.data.loader import LoaderStats, TokenLoader
from batchpilot.data.prepare import demo_inputs, prepare
from batchpilot.data.sampling import DEFAULT_BLOCK_SAMPLES, DEFAULT_WINDOW_BLOCKS
from batchpilot.data.shards import read_manifest
from batchpilot.data.storage import open_storage
from batchpilot.data.tokenizers import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from gcs_server import gcs_server_running

THREADS = int(os.environ.get("BENCH_THREADS", "8"))  # concurrent requests of the loader
TARGET_WAIT_FRACTION = 0.02


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    args = parser.parse_args()
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
            f"storage   fetched {stats.num_blocks_read} blocks, {stats.num_storage_bytes_read / 1e6:.1f} MB "
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


if __name__ == "__main__":
    main()
