"""The process's place in the job (from torchrun's environment) and the few collectives the loop needs."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def processes_per_node_from_env() -> int:
    """LOCAL_WORLD_SIZE as torchrun sets it; a lone process is all of its world (WORLD_SIZE, else 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


@dataclass(frozen=True)
class DistContext:
    """Rank, world and device of this process. A plain `python` run is rank 0 of a world of 1."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, *, timeout_s: float = 600.0) -> DistContext:
        """Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE and joins the process group when world > 1.

        The device is CUDA when torch sees one, else the CPU (gloo): a process planned for GPUs checks
        that it has them before this (`batchpilot.train.accelerators`), so the CPU here is never a
        silent fallback on a GPU pool.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world_size = processes_per_node_from_env()
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(rank, world_size, local_rank, local_world_size, device)

    def any_true(self, *flags: bool) -> list[bool]:
        """For each flag, whether it is set on any rank (one small all-reduce; free on one rank)."""
        if not self.distributed:
            return list(flags)
        tensor = torch.tensor([float(flag) for flag in flags], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(value) for value in tensor.tolist()]

    def step_values(
        self, *, means: list[torch.Tensor], flags: list[bool], local: list[torch.Tensor]
    ) -> tuple[list[float], list[bool], list[float]]:
        """A step's numbers in one all-reduce and one host synchronisation: the mean over ranks of each of
        `means`, whether any rank set each of `flags`, and this rank's `local` values (all scalars on this
        process's device)."""
        # The flags are filled in on the device: a tensor built from a list would be copied from host memory,
        # and that copy waits for the device's queue.
        on_device = [torch.full((), float(flag), dtype=torch.float64, device=self.device) for flag in flags]
        reduced = torch.stack([*(value.to(torch.float64) for value in means), *on_device])
        if self.distributed:
            dist.all_reduce(reduced)
        kept = torch.stack([value.to(torch.float64) for value in local])
        values = torch.cat([reduced, kept]).tolist()
        count = len(means)
        return (
            [value / self.world_size for value in values[:count]],
            [value > 0 for value in values[count : count + len(flags)]],
            values[count + len(flags) :],
        )

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean of `values` over ranks."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return (tensor / self.world_size).tolist()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Leaves every process group of this process (the checkpoint's and the loader's too)."""
        if dist.is_initialized():
            dist.destroy_process_group()
