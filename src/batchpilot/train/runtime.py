"""The runtime protocol: what the one training loop (loop.py) asks of the device side.

A runtime places the model on its devices and spreads it over them (`parallelize`), runs the forward and
backward passes of one optimizer step (`run_passes`), reads the step's numbers with one host
synchronisation (`read_step`), writes and restores checkpoints, and says who it is in the job. Two
implement it:

- `eager.EagerRuntime`: one process per device under torchrun; ddp, fsdp or hsdp (parallel.py); the
  passes and out-of-memory recovery of step.py; checkpoints written in the background.
- `xla_runtime.XlaRuntime`: one process per host driving every device of a TPU slice with SPMD
  (torch_xla); checkpoints written synchronously through the SPMD planner.

Everything else (stages, batch arithmetic, LR, sample order, checkpoint policy, validation schedule, noise
scale, adaptive ramp-up, metrics) is the loop's and is the same for both. A new parallelism (a 2-D data x
tensor mesh) is a new `parallelize` function of a runtime, not a new loop.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.models.deferred import Deferred
from batchpilot.train.checkpoint import Checkpoint, Checkpointer


@dataclass
class StepOutcome:
    """What happened in one attempt at an optimizer step (gradients are ready only if `completed`).

    The numbers are device scalars, read once per step by `Runtime.read_step`: `loss` is the mean
    micro-batch loss (this rank's under eager), `small_sq_norm` the squared norm of the small-batch
    gradient of `small_batch` samples (None: not measured), `coherence` the cosine between the first two
    passes' gradients (NaN when one is zero).
    """

    completed: bool
    loss: torch.Tensor | None = None
    small_sq_norm: torch.Tensor | None = None
    small_batch: int | None = None
    coherence: torch.Tensor | None = None
    out_of_memory: bool = False


@dataclass(frozen=True)
class StepValues:
    """One step's numbers on the host: the mean loss over the data-parallel ranks, the gradient norm, the
    small-batch gradient's squared norm (None: not measured) and the passes' gradient coherence (None: not
    measured)."""

    loss: float
    grad_norm: float
    small_sq_norm: float | None
    coherence: float | None


@dataclass(frozen=True)
class Place:
    """Where this process stands in the job.

    Attributes:
        rank: this process's index (a rank under eager, a host under XLA).
        is_main: the process that logs, writes metrics.jsonl and commits checkpoints.
        label: this process as a log line names it (`rank 3`, `host 1`).
        world_size: data-parallel ranks: processes over train.tensor_parallel_size (eager) or devices (XLA).
        world_label: the world as the progress line names it.
        reader: (rank, count, per node) of this process among the job's data readers: every eager rank
            reads its own samples; every XLA host reads its devices' samples.
        local_devices: devices this process drives (its rows per pass are `local_devices` micro batches).
        local_rank: the process's index on its node (the copy of `train.init_from` it reads).
    """

    rank: int
    is_main: bool
    label: str
    world_size: int
    world_label: str
    reader: tuple[int, int, int]
    unit: str
    """What a data-parallel rank is, plural: `processes`, `devices`."""
    counted: str
    """The same after a count that may be one: `process(es)`, `device(s)`."""
    job: str = "this job"
    """The job as a message names it (`this XLA job of 2 host process(es)`)."""
    local_devices: int = 1
    local_rank: int = 0
    tensor_parallel_size: int = 1
    """Processes that split each block and share one data-parallel rank's samples (eager only)."""

    @property
    def num_devices(self) -> int:
        """Devices of the job: the data-parallel ranks times their tensor-parallel groups."""
        return self.world_size * self.tensor_parallel_size

    def rows_per_pass(self, micro_batch_size: int) -> int:
        """Samples this process reads per accumulation pass (its devices' micro batches)."""
        return micro_batch_size * self.local_devices


@dataclass(frozen=True)
class Initialization:
    """How the meta-device model gets its values once a runtime has placed it.

    Attributes:
        fill: fills a placed model (each process's part given memory): the seed's weights, `train.init_from`'s,
            or on a resume the buffers alone (the checkpoint's values follow).
        seeded: the seed's recorded initialisation when `fill` makes the seed's weights (None otherwise), for a
            runtime that places whole tensors one at a time (`Deferred.stream`, seeded with `seed` first).
        seed: `train.seed`.
        resuming: a checkpoint's values follow, so nothing but the buffers needs values.
    """

    fill: Callable[[nn.Module], None]
    seeded: Deferred | None = None
    seed: int = 0
    resuming: bool = False

    def __call__(self, placed: nn.Module) -> None:
        self.fill(placed)


@dataclass(frozen=True)
class Passes:
    """How one step's passes run: the micro batch per device, whether the one pass runs as two halves to
    measure the noise scale (`split`), and what is measured."""

    micro_batch_size: int
    split: bool
    measure_noise: bool
    measure_coherence: bool


@dataclass(frozen=True)
class Save:
    """A checkpoint to write: the model and optimizer at `step` / `consumed_samples`, meta.json's extra
    entries, and `side` objects the main process writes before `latest` moves. `last`: no step trains while
    it is written (the launch's last step, a preemption's or an adaptive decision's save)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int
    consumed_samples: int
    extra: dict[str, Any]
    side: dict[str, bytes] | None
    last: bool = False


@dataclass(frozen=True)
class Evaluation:
    """How the validation samples run: `micro_batch_size` per device and pass, under `autocast`, and how
    many samples all processes hold together."""

    micro_batch_size: int
    autocast: Callable[[], contextlib.AbstractContextManager]
    num_samples: int


class Runtime(ABC):
    """The device side of the training loop; see the module docstring."""

    name: str
    place: Place
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    # -- who this process is -----------------------------------------------------------------------------

    @property
    @abstractmethod
    def noise_strategy(self) -> str:
        """The layout `planning.noise` decides by: the parallelism (eager) or `xla`."""

    @property
    def noise_shard_degree(self) -> int:
        """The data-parallel ranks one parameter is sharded over (`planning.noise.reads_local_gradients`)."""
        return 1

    def audit_ranks(self) -> Iterable[int]:
        """The data-parallel ranks whose trained positions this process records (`--audit`)."""
        return [self.place.rank]

    # -- set-up ------------------------------------------------------------------------------------------

    relaunch_fix: str
    """How to start a stage at its planned size (the fix of a world-size mismatch)."""

    @abstractmethod
    def parallelize(
        self,
        model: nn.Module,
        config: Config,
        *,
        strategy: str,
        initialize: Initialization,
        shard_nodes: int = 1,
    ) -> str:
        """Spreads the meta-device `model` over the devices as `strategy` says (hsdp: shard groups of
        `shard_nodes` nodes), gives this process's part memory and fills it (`initialize(model)`, in fp32);
        returns how, in words."""

    @abstractmethod
    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state laid out before the first step (XLA: sharded as its parameters)."""

    @abstractmethod
    def restore(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Loads a checkpoint (any runtime, any world size) into the placed model and its optimizer."""

    @abstractmethod
    def world_line(self, how: str) -> str:
        """This job's world as the line that starts training names it, with `how` the model is spread."""

    @abstractmethod
    def peak_flops(self, config: Config) -> float | None:
        """The bf16 peak FLOP/s of one device, for MFU (None: fp32 or unknown)."""

    # -- a step ------------------------------------------------------------------------------------------

    @abstractmethod
    def run_passes(self, model: nn.Module, batches: Sequence[torch.Tensor], passes: Passes) -> StepOutcome:
        """Forward and backward of every accumulation pass of one step (`batches`: this process's rows of
        each pass); with `passes.split`, the one pass runs as two halves to measure the noise scale."""

    @abstractmethod
    def read_step(
        self, outcome: StepOutcome, grad_norm: torch.Tensor, *, flags: list[bool]
    ) -> tuple[StepValues, list[bool]]:
        """The step's numbers with one host synchronisation, and for each of `flags` whether any process
        set it."""

    def step_extra(self) -> dict[str, Any]:
        """The runtime's own entries of a step's metrics record."""
        return {}

    @abstractmethod
    def after_out_of_memory(self) -> None:
        """After an agreed out-of-memory error, before the retry with half the micro batch."""

    @abstractmethod
    def peak_memory_bytes(self) -> int:
        """The peak memory of this process's device(s) so far."""

    # -- checkpoints -------------------------------------------------------------------------------------

    def checkpoint_extra(self) -> dict[str, Any]:
        """The runtime's own entries of a checkpoint's meta.json."""
        return {}

    @abstractmethod
    def write_checkpoint(self, checkpointer: Checkpointer, save: Save) -> tuple[str | None, bool]:
        """Writes (or starts writing) a checkpoint; returns (its URI on the main process, whether it is
        being written in the background)."""

    # -- validation --------------------------------------------------------------------------------------

    @abstractmethod
    def validation_loss(self, model: nn.Module, rows: torch.Tensor, evaluation: Evaluation) -> float:
        """The mean token loss over every process's validation `rows` (this process's: `[rows_per_pass(share),
        seq_len + 1]`, int32) in passes of `evaluation.micro_batch_size` per device."""

    @abstractmethod
    def close(self) -> None:
        """Training ended on this process: leave its process groups before the interpreter finalises."""
