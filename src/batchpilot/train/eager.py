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
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.models.factory import compile_model
from batchpilot.planning import Stage
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state
from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import Parallel, Strategy, wrap_model
from batchpilot.train.runtime import Runtime, StepOutcome, StepValues
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

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.parallel: Parallel | None = None
        self.precision = "fp32"

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def rank_label(self) -> str:
        return f"rank {self.ctx.rank}"

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def noise_strategy(self) -> str:
        assert self.parallel is not None, "parallelize first"
        return self.parallel.strategy

    @property
    def reader(self) -> tuple[int, int, int]:
        return self.ctx.rank, self.ctx.world_size, self.ctx.local_world_size

    def check_world(self, stages: Sequence[Stage], *, devices_per_node: int) -> None:
        wrong = next((s for s in stages if s.world_size != self.ctx.world_size), None)
        if wrong is not None:
            raise BatchpilotError(
                "--stage",
                f"{wrong.name} is planned for {wrong.num_nodes} node(s) x {devices_per_node} = "
                f"{wrong.world_size} processes, this job has {self.ctx.world_size}",
                "start it with `batchpilot launch` (or torchrun) at the planned size",
            )

    def first_start_rank(self) -> int:
        return self.ctx.local_rank

    def parallelize(self, model: nn.Module, config: Config, *, strategy: str) -> str:
        device = self.ctx.device
        model.to(device)
        if config.train.compile:
            compile_model(model)
        install_oom_injection(model, self.ctx)
        self.precision = config.train.precision
        bf16 = uses_bf16(device, self.precision)
        self.parallel = wrap_model(model, self.ctx, strategy=strategy_of(strategy), bf16=bf16)
        self.autocast = autocast_factory(device, self.precision, self.parallel)
        return self.parallel.describe()

    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: AdamW creates its state, on each parameter's device and shard, at its first step."""

    def restore(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        restore_training_state(checkpoint, model, optimizer)

    def resumed_line(self, checkpoint: Checkpoint, *, uri: str) -> str:
        saved = checkpoint.meta.get("parallelism", "ddp")
        return (
            f"resumed from step {checkpoint.step} ({checkpoint.consumed_samples:,} samples) of {uri} "
            f"(saved by {checkpoint.meta.get('world_size', '?')} process(es) under {saved})"
        )

    def training_line(self, stage_names: str, *, consumed: int, how: str) -> str:
        return (
            f"training {stage_names} on {self.ctx.world_size} process(es) ({self.ctx.device.type}, "
            f"{how}) from sample {consumed:,}"
        )

    def peak_flops(self, config: Config) -> float | None:
        return device_peak(config, self.ctx.device, bf16=uses_bf16(self.ctx.device, config.train.precision))

    def run_passes(
        self,
        model: nn.Module,
        batches: Sequence[torch.Tensor],
        *,
        micro_batch_size: int,
        split: bool,
        measure_noise: bool,
        measure_coherence: bool,
    ) -> StepOutcome:
        assert self.parallel is not None, "parallelize first"
        if split:
            # The same samples on this rank, as two passes of half the micro batch: the same gradient, and
            # the first half's, over all ranks, is the noise scale's small batch (planning/noise.py).
            batches = list(batches[0].chunk(2))
        return accumulate_gradients(
            model=model,
            parallel=self.parallel,
            micro_batches=batches,
            ctx=self.ctx,
            autocast=self.autocast,
            measure_noise=measure_noise,
            measure_coherence=measure_coherence,
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

    def write_checkpoint(
        self,
        checkpointer: Checkpointer,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        consumed_samples: int,
        extra: dict[str, Any],
        side: dict[str, bytes] | None,
    ) -> tuple[str | None, bool]:
        # Blocks while this rank's state is copied to CPU memory; the files are written in the background.
        where = checkpointer.start_save_sharded(
            step=step,
            consumed_samples=consumed_samples,
            state=training_state(model, optimizer),
            rng=capture_rng_state(),
            extra=extra,
            side_objects=side,
        )
        return where, True

    def validation_loss(
        self,
        model: nn.Module,
        rows: torch.Tensor,
        *,
        micro_batch_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
        num_samples: int,
    ) -> float:
        """This rank's share in passes of the micro batch (the last possibly smaller: every rank runs as many
        passes, which fsdp's gathers need), weighted by tokens, then the mean over the ranks."""
        device = self.ctx.device
        loss_tokens = torch.zeros((), dtype=torch.float64, device=device)
        for batch in torch.split(rows, micro_batch_size):
            loss = micro_batch_loss(model, batch.to(device, dtype=torch.long, non_blocking=True), autocast())
            loss_tokens += loss.double() * batch[:, 1:].numel()
        total, tokens = self.ctx.mean([loss_tokens.item(), float(rows[:, 1:].numel())])
        return total / tokens

    def close(self) -> None:
        self.ctx.close()


def strategy_of(name: str) -> Strategy:
    """A plan's parallelism as a strategy of parallel.py (the plan's checks allow only these)."""
    assert name in ("ddp", "fsdp", "hsdp"), name
    return name  # type: ignore[return-value]
