"""Local gloo ranks for the benches that spawn their own processes (no torchrun): a free loopback port and a
rank's join."""

from __future__ import annotations

import os
import socket

import torch

from batchpilot.train.distributed import DistContext


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(rank: int, world_size: int, port: int) -> DistContext:
    """Rank `rank` of `world_size` one-node processes on the loopback, one torch thread each."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    return DistContext.from_env()
