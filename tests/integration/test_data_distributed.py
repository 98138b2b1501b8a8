"""Loading hosts in real processes (gloo): readers forward each rank exactly the samples it would read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpilot.data.loader import TokenLoader
from batchpilot.data.prepare import prepare
from batchpilot.data.sampling import SampleOrder, sample_token_range, step_positions
from batchpilot.data.shards import ShardSet
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.errors import BatchpilotError

SEQ_LEN = 24
SEED = 3
# (consumed_samples, global_batch_size, micro_batch_size, gradient_accumulation_steps) for 4 ranks; the
# batch changes half-way, as at a ramp-up stage boundary, so prefetched guesses are thrown away.
STEPS = [(0, 16, 2, 2), (16, 16, 2, 2), (32, 16, 2, 2), (48, 8, 2, 1), (56, 8, 2, 1), (64, 16, 4, 1)]
# Small blocks and windows (12 samples): the steps cross windows, so readers refill their block caches.
BLOCK_SAMPLES, WINDOW_BLOCKS = 4, 3
ORDER = {"shuffle_block_samples": BLOCK_SAMPLES, "shuffle_window_blocks": WINDOW_BLOCKS}


def _rank_main(rank: int, world_size: int, local_world_size: int, factor: float, uri: str, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
    loader = TokenLoader(
        uri=uri,
        seq_len=SEQ_LEN,
        seed=SEED,
        rank=rank,
        world_size=world_size,
        local_world_size=local_world_size,
        expansion_factor=factor,
        prefetch_steps=2,
        **ORDER,
    )
    # Reads its own samples: the reference for what the reader forwards.
    own = TokenLoader(uri=uri, seq_len=SEQ_LEN, seed=SEED, rank=rank, world_size=world_size, **ORDER)
    received, reference = [], []
    for consumed, global_batch, micro, accumulation in STEPS:
        shape = {
            "consumed_samples": consumed,
            "global_batch_size": global_batch,
            "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation,
        }
        received.append(loader.micro_batches(**shape))
        reference.append(own.micro_batches(**shape))
        # The trainer's own collective on the default group, while the loader forwards in the background.
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == world_size
    errors = []
    try:
        TokenLoader(
            uri=f"{uri}-missing",
            seq_len=SEQ_LEN,
            seed=SEED,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            expansion_factor=factor,
        )
    except BatchpilotError as error:
        errors.append(str(error))
    torch.save(
        {
            "received": received,
            "reference": reference,
            "read_storage": loader.is_reader,
            "num_samples_read": loader.stats.num_samples_read,
            "errors": errors,
        },
        f"{tmp}/rank{rank}.pt",
    )
    loader.close()
    own.close()
    dist.destroy_process_group()


def _global_batch(uri: str, consumed: int, global_batch: int) -> list[list[int]]:
    shards = ShardSet.open(uri=uri)
    order = SampleOrder(
        num_samples=(shards.num_tokens - 1) // SEQ_LEN,
        seed=SEED,
        block_samples=BLOCK_SAMPLES,
        window_blocks=WINDOW_BLOCKS,
    )
    ranges = [
        sample_token_range(order.sample_at(p), seq_len=SEQ_LEN)
        for p in step_positions(consumed_samples=consumed, global_batch_size=global_batch)
    ]
    return sorted(tokens.astype(np.int64).tolist() for tokens in shards.read_tokens(ranges))


def _run(uri: str, tmp_path: Path, *, world_size: int, local_world_size: int, factor: float) -> list[dict]:
    mp.spawn(_rank_main, args=(world_size, local_world_size, factor, uri, str(tmp_path)), nprocs=world_size)
    outputs = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    for step, (consumed, global_batch, _micro, _accumulation) in enumerate(STEPS):
        rows = []
        for output in outputs:
            for got, want in zip(output["received"][step], output["reference"][step], strict=True):
                assert got.dtype == torch.int64 and torch.equal(got, want)  # byte-for-byte its own samples
                rows += got.tolist()
        assert sorted(rows) == _global_batch(uri, consumed, global_batch)  # the union is the global batch
    for output in outputs:
        assert len(output["errors"]) == 1 and "manifest.json: does not exist" in output["errors"][0]
    return outputs


@pytest.fixture
def local_uri(tmp_path: Path) -> str:
    return _prepare(f"file://{tmp_path}/shards", tmp_path)


def _prepare(uri: str, tmp_path: Path) -> str:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    rng = np.random.default_rng(5)
    for index in range(12):
        (corpus / f"{index:02d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 400 + 31 * index, dtype=np.uint8))
        )
    prepare(
        inputs=sorted(corpus.iterdir()),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=900,
        validation_fraction=0.0,
        show_progress=False,
    )
    return uri


@pytest.mark.slow
def test_two_loading_hosts_feed_four_single_rank_nodes(local_uri: str, tmp_path: Path) -> None:
    outputs = _run(local_uri, tmp_path, world_size=4, local_world_size=1, factor=2)
    assert [o["read_storage"] for o in outputs] == [True, False, True, False]
    # Readers read their group's half of every step (plus prefetched guesses); the others read nothing.
    reads = [o["num_samples_read"] for o in outputs]
    assert reads[1] == reads[3] == 0 and min(reads[0], reads[2]) >= sum(step[1] for step in STEPS) // 2


@pytest.mark.slow
def test_one_loading_host_feeds_two_nodes_of_two_ranks_from_gcs(gcs_bucket: str, tmp_path: Path) -> None:
    uri = _prepare(f"gs://{gcs_bucket}/dist", tmp_path)
    outputs = _run(uri, tmp_path, world_size=4, local_world_size=2, factor=2)
    assert [o["read_storage"] for o in outputs] == [True, False, False, False]
