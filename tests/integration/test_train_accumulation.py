"""Loss normalisation: world 1 x accumulation 4 == world 2 x accumulation 2 == one micro batch 4x as big,
under DDP, FSDP and HSDP alike (the sharded gradients gathered back into whole tensors)."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from batchpilot.models.gpt import build
from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import wrap_model
from batchpilot.train.step import accumulate_gradients

GLOBAL_BATCH = 16
MODEL_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (GLOBAL_BATCH, 17), generator=generator)


def gradients(*, rank: int, world_size: int, micro: int, strategy: str = "ddp") -> dict[str, torch.Tensor]:
    """The accumulated gradient after one step of this rank's share of the global batch."""
    ctx = DistContext.from_env()
    torch.manual_seed(0)
    model = build(**MODEL_ARGS)
    parallel = wrap_model(model, ctx, strategy=strategy, bf16=False, materialize=lambda _: None)
    batch = global_batch()
    per_pass = micro * world_size
    micro_batches = [
        batch[a * per_pass + rank * micro : a * per_pass + (rank + 1) * micro]
        for a in range(GLOBAL_BATCH // per_pass)
    ]
    outcome = accumulate_gradients(
        model=model,
        parallel=parallel,
        micro_batches=micro_batches,
        ctx=ctx,
        autocast=contextlib.nullcontext,
        measure_noise=True,
        measure_coherence=True,
    )
    assert outcome.completed
    if len(micro_batches) > 2:  # every strategy measures the noise scale and coherence from its passes
        assert outcome.small_sq_norm is not None and outcome.coherence is not None
    return {name: full(p.grad) for name, p in model.named_parameters()}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def _worker(rank: int, world_size: int, port: int, out: str, strategy: str, per_node: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    grads = gradients(rank=rank, world_size=world_size, micro=2, strategy=strategy)
    torch.save(grads, f"{out}.rank{rank}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "per_node"),
    [("ddp", 2), ("fsdp", 2), ("hsdp", 1)],  # hsdp on 2 nodes of 1: replicated across, sharded within
)
def test_accumulated_gradient_is_the_global_batch_mean(tmp_path, monkeypatch, strategy, per_node):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    one_big = gradients(rank=0, world_size=1, micro=GLOBAL_BATCH)
    accumulated = gradients(rank=0, world_size=1, micro=4)
    out = str(tmp_path / "grads")
    mp.spawn(_worker, args=(2, free_port(), out, strategy, per_node), nprocs=2, join=True)
    distributed = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for name, reference in one_big.items():
        assert torch.allclose(accumulated[name], reference, rtol=1e-4, atol=1e-6), name
        for rank in range(2):
            assert torch.allclose(distributed[rank][name], reference, rtol=1e-4, atol=1e-6), (name, rank)
