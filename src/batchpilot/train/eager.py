"""The eager runtime: one process per device under torchrun, ddp, fsdp or hsdp over them (parallel.py).

A step's passes are step.py's (gradient accumulation, the noise-scale and coherence measurements, the
agreement on an out-of-memory error under ddp); its numbers come back in one all-reduce and one host
synchronisation (`DistContext.step_values`); checkpoints are copied to CPU memory and written in the
background (train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import math
import resource
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batchpilot.config import Config
from batchpilot.models.deferred import to_empty
from batchpilot.models.factory import compile_model
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state
from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import Parallel, Strategy, wrap_model
from batchpilot.train.runtime import (
    Evaluation,
    Initialization,
    Passes,
    Place,
    Runtime,
    Save,
    StepOutcome,
    StepValues,
)
from batchpilot.train.setup import device_peak
from batchpilot.train.state import restore_training_state, training_state
from batchpilot.train.step import accumulate_gradients, install_oom_injection, micro_batch_loss


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def uses_bf16(device: torch.device, precision: str) -> bool:
    """`train.precision`: auto is bf16 on CUDA and fp32 elsewhere."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast_factory(
    device: torch.device, precision: str, parallel: Parallel | None = None
) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast over fp32 weights (bare model and DDP); FSDP's mixed-precision policy casts itself."""
    if uses_bf16(device, precision) and not (parallel is not None and parallel.mixed_precision):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class EagerRuntime(Runtime):
    """One process per device; `ctx` is its place in the torchrun job."""

    name = "eager"
    relaunch_fix = "start it with `batchpilot launch` (or torchrun) at the planned size"

    def __init__(self, ctx: DistContext, *, tensor_parallel_size: int = 1) -> None:
        self.ctx = ctx
        self.tensor_parallel_size = tp = tensor_parallel_size
        # Ranks are node-major with a tensor-parallel group's t ranks consecutive: every rank of a group
        # reads the data-parallel rank's samples (rank // t), and a node holds local_world_size / t readers.
        data_parallel = ctx.world_size // tp
        self.place = Place(
            rank=ctx.rank,
            is_main=ctx.is_main,
            label=f"rank {ctx.rank}",
            world_size=data_parallel,
            world_label=str(data_parallel),
            reader=(ctx.rank // tp, data_parallel, max(ctx.local_world_size // tp, 1)),
            unit="processes",
            counted="process(es)",
            local_rank=ctx.local_rank,
            tensor_parallel_size=tp,
        )
        self.parallel: Parallel | None = None

    def audit_ranks(self) -> list[int]:
        """This process's data-parallel rank, recorded by the first rank of its tensor-parallel group (the
        group's ranks train the same samples)."""
        return [self.place.reader[0]] if self.ctx.rank % self.tensor_parallel_size == 0 else []

    @property
    def noise_strategy(self) -> str:
        assert self.parallel is not None, "parallelize first"
        return self.parallel.strategy

    @property
    def noise_shard_degree(self) -> int:
        assert self.parallel is not None, "parallelize first"
        return self.parallel.shard_degree

    def parallelize(
        self,
        model: nn.Module,
        config: Config,
        *,
        strategy: str,
        initialize: Initialization,
        shard_nodes: int = 1,
    ) -> str:
        device = self.ctx.device

        def materialize(placed: nn.Module) -> None:  # this rank's shard (or replica) only, on its device
            to_empty(placed, device=device)
            initialize(placed)

        if config.train.compile:
            compile_model(model)
        install_oom_injection(model, self.ctx)
        bf16 = uses_bf16(device, config.train.precision)
        self.parallel = wrap_model(
            model,
            self.ctx,
            strategy=strategy_of(strategy),
            bf16=bf16,
            materialize=materialize,
            shard_nodes=shard_nodes,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        self.autocast = autocast_factory(device, config.train.precision, self.parallel)
        return self.parallel.describe()

    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: AdamW creates its state, on each parameter's device and shard, at its first step."""

    def restore(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        restore_training_state(checkpoint, model, optimizer)

    def world_line(self, how: str) -> str:
        return f"{self.ctx.world_size} process(es) ({self.ctx.device.type}, {how})"

    def peak_flops(self, config: Config) -> float | None:
        return device_peak(config, self.ctx.device, bf16=uses_bf16(self.ctx.device, config.train.precision))

    def run_passes(self, model: nn.Module, batches: Sequence[torch.Tensor], passes: Passes) -> StepOutcome:
        assert self.parallel is not None, "parallelize first"
        if passes.split:
            # The same samples on this rank, as two passes of half the micro batch: the same gradient, and
            # the first half's, over all ranks, is the noise scale's small batch (planning/noise.py).
            batches = list(batches[0].chunk(2))
        return accumulate_gradients(
            model=model,
            parallel=self.parallel,
            micro_batches=batches,
            ctx=self.ctx,
            autocast=self.autocast,
            measure_noise=passes.measure_noise,
            measure_coherence=passes.measure_coherence,
        )

    def read_step(
        self, outcome: StepOutcome, grad_norm: torch.Tensor, *, flags: list[bool]
    ) -> tuple[StepValues, list[bool]]:
        """One small all-reduce: [mean loss, mean small-batch squared norm] and the flags, with this rank's
        [gradient norm, coherence or NaN], read in one host synchronisation."""
        assert outcome.loss is not None
        device = self.ctx.device
        zero, nan = torch.zeros((), device=device), torch.full((), math.nan, device=device)
        small_sq = outcome.small_sq_norm if outcome.small_sq_norm is not None else zero
        coherence = outcome.coherence if outcome.coherence is not None else nan
        full_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        (loss, small_sq_norm), agreed, (norm, cosine) = self.ctx.step_values(
            means=[outcome.loss, small_sq], flags=flags, local=[full_norm, coherence]
        )
        values = StepValues(
            loss=loss,
            grad_norm=norm,
            small_sq_norm=small_sq_norm,
            coherence=None if math.isnan(cosine) else cosine,
        )
        return values, agreed

    def after_out_of_memory(self) -> None:
        if self.ctx.device.type == "cuda":  # peak_memory_bytes reports the attempts that fit, not this one
            torch.cuda.reset_peak_memory_stats(self.ctx.device)

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes(self.ctx.device)

    def write_checkpoint(self, checkpointer: Checkpointer, save: Save) -> tuple[str | None, bool]:
        # Blocks while this rank's state is copied to CPU memory; the files are written in the background.
        where = checkpointer.start_save_sharded(
            step=save.step,
            consumed_samples=save.consumed_samples,
            state=training_state(save.model, save.optimizer),
            rng=capture_rng_state(),
            extra=save.extra,
            side_objects=save.side,
            last=save.last,
        )
        return where, True

    def validation_loss(self, model: nn.Module, rows: torch.Tensor, evaluation: Evaluation) -> float:
        """This rank's share in passes of the micro batch (the last possibly smaller: every rank runs as many
        passes, which fsdp's gathers need), weighted by tokens, then the mean over the ranks."""
        device = self.ctx.device
        loss_tokens = torch.zeros((), dtype=torch.float64, device=device)
        for batch in torch.split(rows, evaluation.micro_batch_size):
            loss = micro_batch_loss(
                model, batch.to(device, dtype=torch.long, non_blocking=True), evaluation.autocast()
            )
            loss_tokens += loss.double() * batch[:, 1:].numel()
        total, tokens = self.ctx.mean([loss_tokens.item(), float(rows[:, 1:].numel())])
        return total / tokens

    def close(self) -> None:
        self.ctx.close()


def strategy_of(name: str) -> Strategy:
    """A plan's parallelism as a strategy of parallel.py (the plan's checks allow only these)."""
    assert name in ("ddp", "fsdp", "hsdp"), name
    return name  # type: ignore[return-value]
