"""Validation loss over 2 gloo ranks equals the loss of the same samples in one process, under DDP and FSDP,
with every rank reading its own samples or one host reading for both (expansion factor 2)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpilot.models.gpt import build
from batchpilot.train.distributed import DistContext
from batchpilot.train.eager import EagerRuntime
from batchpilot.train.evaluate import Validator
from batchpilot.train.parallel import Strategy, wrap_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


MODEL_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 128, "vocab_size": 257}
SEQ_LEN = 128
MICRO = 3  # 20 samples per rank: 6 passes, the last of 2


def validation_loss(
    *, ctx: DistContext, data_uri: str, eval_samples: int, strategy: Strategy, expansion: float
) -> float:
    torch.manual_seed(0)
    model = build(**MODEL_ARGS)
    wrap_model(
        model, ctx, strategy=strategy, bf16=False, materialize=lambda _: None
    )  # fsdp shards `model` in place
    validator = Validator(
        uri=data_uri,
        seq_len=SEQ_LEN,
        eval_samples=eval_samples,
        eval_every_samples=0,
        runtime=EagerRuntime(ctx),
        expansion_factor=expansion,
    )
    return validator.evaluate(model, micro_batch_size=MICRO, autocast=contextlib.nullcontext)


def _worker(
    rank: int, port: int, out: str, data_uri: str, strategy: Strategy, per_node: int, expansion: float
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ctx = DistContext.from_env()
    # 41 does not split over 2 ranks: rounded down to 40, 20 each.
    loss = validation_loss(
        ctx=ctx, data_uri=data_uri, eval_samples=41, strategy=strategy, expansion=expansion
    )
    Path(f"{out}.rank{rank}").write_text(repr(loss))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "per_node", "expansion"),
    [("ddp", 2, 1.0), ("fsdp", 2, 1.0), ("ddp", 1, 2.0)],  # the last: rank 0's host reads for rank 1's
)
def test_two_ranks_report_the_one_rank_validation_loss(
    tmp_path, monkeypatch, demo_data_uri, strategy, per_node, expansion
):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    one = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    reference = validation_loss(
        ctx=one, data_uri=demo_data_uri, eval_samples=40, strategy="ddp", expansion=1.0
    )
    out = str(tmp_path / "loss")
    mp.spawn(
        _worker, args=(free_port(), out, demo_data_uri, strategy, per_node, expansion), nprocs=2, join=True
    )
    losses = [float(Path(f"{out}.rank{rank}").read_text()) for rank in range(2)]
    assert losses[0] == losses[1]  # every rank reports the same number
    assert losses[0] == pytest.approx(reference, rel=1e-5)
    assert 3.0 < reference < 7.0  # an untrained byte model: about ln(257) = 5.55
