"""The XLA runtime (`train.runtime: xla`): one process per host, SPMD over every device of the stage.

The same loop, stages, batches, sample order, LR schedule, clipping, checkpoints and metrics as the eager
runtime; what differs is here:

- One process per host drives all of that host's devices; the world size is the slice's device count
  (`xr.global_runtime_device_count()`), one logical data-parallel rank per device.
- Every accumulation pass is one batch of `micro x devices` rows sharded along dim 0: device `d` holds
  rows `[d x micro, (d + 1) x micro)`, the positions rank `d` trains on a GPU job of the same world size
  (`rank_micro_batches`). A host reads only its devices' rows (its loader is rank `host` of `num_hosts`
  with `micro x local devices` samples per pass: hosts own consecutive devices of the mesh).
- Each pass ends with `torch_xla.sync()` (one compiled graph per pass, the same graph every pass); the
  loss and the norms stay on the device until the step ends.
- Checkpoints are the eager runtime's sharded DCP format, keyed by parameter name, written through the
  SPMD save planner (each host writes its own shards); they load on any device count and in the eager
  runtime.

Not implemented (refused with one line, see `xla.refuse_unsupported` and `refuse`): loading hosts,
torch.compile, and the halving of the micro batch after an out-of-memory error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.models.deferred import to_empty
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state
from batchpilot.train.init_from import start_from
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
from batchpilot.train.step import INJECT_OOM_ENV, micro_batch_loss
from batchpilot.train.xla import (
    XLA_RUNTIME,
    Layout,
    XlaHost,
    init_optimizer_state,
    make_layout,
    place_buffers,
    place_streamed,
    refuse_unsupported,
    shard_blocks,
    shard_parameters,
    start_runtime,
    uses_bf16_on_xla,
    xla_device,
)
from batchpilot.train.xla_state import (
    agree,
    peak_memory_bytes,
    restore_xla_state,
    send_rows,
    start_xla_checkpoint,
)

logger = logging.getLogger(__name__)


def _sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach() for p in model.parameters() if p.grad is not None]


def refuse(config: Config) -> None:
    """What the XLA runtime does not implement, refused before anything starts."""
    refuse_unsupported(config)
    if os.environ.get(INJECT_OOM_ENV):
        raise BatchpilotError(
            INJECT_OOM_ENV, "halving the micro batch after out of memory is not implemented for runtime xla"
        )


class XlaRuntime(Runtime):
    """One process per host; `host` is its place in the slice, `layout` the mesh of the plan's parallelism."""

    name = XLA_RUNTIME
    relaunch_fix = (
        "start it at the planned size (locally: CPU_NUM_DEVICES set to the stage's devices, PJRT_DEVICE=CPU)"
    )

    def __init__(self, host: XlaHost, layout: Layout) -> None:
        self.host, self.layout = host, layout
        self.place = Place(
            rank=host.host,
            is_main=host.is_main,
            label=f"host {host.host}",
            world_size=host.num_devices,
            world_label=f"{host.num_devices} devices",
            reader=(host.host, host.num_hosts, 1),
            unit="devices",
            counted="device(s)",
            job=f"this XLA job ({host.num_hosts} host process(es))",
            local_devices=host.num_local_devices,
        )
        self.compiles_seen = 0

    @classmethod
    def start(cls, config: Config, *, strategy: str, devices_per_node: int) -> XlaRuntime:
        """Refuses what is not implemented, then starts the XLA runtime (SPMD) and lays out its mesh."""
        refuse(config)
        host = start_runtime()
        layout = make_layout(
            strategy=strategy, num_devices=host.num_devices, devices_per_node=devices_per_node
        )
        return cls(host, layout)

    @property
    def noise_strategy(self) -> str:
        return XLA_RUNTIME

    def audit_ranks(self) -> Iterable[int]:
        """The positions every device (logical rank) trained, recorded by host 0."""
        return range(self.host.num_devices) if self.host.is_main else []

    def parallelize(
        self,
        model: nn.Module,
        config: Config,
        *,
        strategy: str,
        initialize: Initialization,
        shard_nodes: int = 1,
    ) -> str:
        assert shard_nodes == 1, "hsdp shard groups are refused under xla at plan time"
        if initialize.seeded is not None:
            # The seed's weights one whole tensor at a time (the eager runtime's values): each is uploaded and
            # sharded before the next is made, so the host never holds the model (`place_streamed`).
            torch.manual_seed(initialize.seed)
            sharded = place_streamed(model, self.layout, initialize.seeded.stream)
        elif initialize.resuming:
            # A checkpoint's values follow (restore): the parameters get device memory only; the buffers are
            # the CPU's values (`place_buffers`, after `initialize`, which only says what a resume skips).
            to_empty(model, device=xla_device())
            initialize(model)
            place_buffers(model)
            sharded = shard_parameters(model, self.layout)
        else:
            # train.init_from's weights, one whole tensor at a time (local, or gs:// by byte ranges): no copy on
            # the node, and the host holds one tensor of the model at a time.
            say = self._say

            def produce(deliver: Callable[[str, torch.Tensor], None]) -> None:
                start_from(
                    model, config=config, resuming_step=None, local_rank=0, say=say, say_every_rank=say,
                    deliver=deliver,
                )  # fmt: skip

            sharded = place_streamed(model, self.layout, produce)
        shard_blocks(model, self.layout)
        if uses_bf16_on_xla(config.train.precision):
            self.autocast = lambda: torch.autocast(device_type="xla", dtype=torch.bfloat16)
        if self.layout.param_axis is None:
            return "parameters replicated (ddp)"
        return (
            f"all {sharded} parameters sharded {self.layout.shard_degree} ways on their largest dimension over "
            f"mesh axis {self.layout.param_axis!r}"
        )

    def _say(self, message: str) -> None:
        """A line of the main host's log."""
        if self.place.is_main:
            logger.info(message)

    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        init_optimizer_state(
            model, optimizer, self.layout
        )  # the first step compiles the graph every step runs

    def restore(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        restore_xla_state(checkpoint, model=model, optimizer=optimizer, layout=self.layout)

    def world_line(self, how: str) -> str:
        host = self.host
        return f"{host.num_devices} XLA device(s) of {host.num_hosts} host(s) (runtime xla, SPMD; {how})"

    def peak_flops(self, config: Config) -> float | None:
        return device_peak(config, torch.device("xla"), bf16=uses_bf16_on_xla(config.train.precision))

    def run_passes(self, model: nn.Module, batches: Sequence[torch.Tensor], passes: Passes) -> StepOutcome:
        """Forward and backward of every pass (gradients accumulate in the parameters' layout)."""
        import torch_xla

        micro = pass_rows = passes.micro_batch_size
        accumulation = len(batches)
        if passes.split:
            # Each device's rows as two halves (device d keeps its samples): two passes of micro / 2 rows per
            # device, the same gradient; the first half over all devices is the noise scale's small batch.
            (rows,) = batches
            per_device = rows.reshape(self.host.num_local_devices, micro, -1)
            half = micro // 2
            batches = [
                per_device[:, :half].reshape(-1, rows.shape[-1]),
                per_device[:, half:].reshape(-1, rows.shape[-1]),
            ]
            accumulation, pass_rows = 2, half
        measure = accumulation > 1
        total: torch.Tensor | None = None
        outcome = StepOutcome(completed=True)
        first: list[torch.Tensor] | None = None
        for index, rows in enumerate(batches):
            batch = send_rows(rows, self.layout)
            loss = micro_batch_loss(model, batch, self.autocast())
            (loss / accumulation).backward()
            total = loss.detach() if total is None else total + loss.detach()
            if index == 0 and measure and passes.measure_noise:
                # The first pass's mean gradient over all devices: batch micro x devices (as under fsdp).
                outcome.small_sq_norm = _sq_norm(_gradients(model)) * accumulation**2
                outcome.small_batch = pass_rows * self.host.num_devices
            if index == 0 and measure and passes.measure_coherence:
                first = [g.clone() for g in _gradients(model)]
            if index == 1 and first is not None:
                second = [g - f for g, f in zip(_gradients(model), first, strict=True)]
                dot = torch.stack(
                    [(a.float() * b.float()).sum() for a, b in zip(first, second, strict=True)]
                ).sum()
                outcome.coherence = dot / (_sq_norm(first) * _sq_norm(second)).sqrt()
                first = None
            torch_xla.sync()
        assert total is not None
        outcome.loss = total / accumulation
        return outcome

    def read_step(
        self, outcome: StepOutcome, grad_norm: torch.Tensor, *, flags: list[bool]
    ) -> tuple[StepValues, list[bool]]:
        """The step's graph runs; its numbers come to the host; the hosts agree on the flags."""
        import torch_xla

        torch_xla.sync()
        values = [outcome.loss, grad_norm, outcome.small_sq_norm, outcome.coherence]
        loss, norm, small_sq, coherence = (None if v is None else float(v.item()) for v in values)
        assert loss is not None and norm is not None
        return StepValues(loss=loss, grad_norm=norm, small_sq_norm=small_sq, coherence=coherence), agree(
            *flags
        )

    def step_extra(self) -> dict[str, Any]:
        return {"runtime": XLA_RUNTIME, "xla_compiles": self._new_compiles()}

    def _new_compiles(self) -> int:
        """Graphs XLA compiled since the last step's record: the first step's training graph, a stage's new
        batch shape, the first evaluation; any other is a recompilation that costs every step its time."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        total = int(data[0]) if data else 0
        new, self.compiles_seen = total - self.compiles_seen, total
        return new

    def after_out_of_memory(self) -> None:
        raise AssertionError("the XLA runtime reports no out-of-memory error to recover from (see `refuse`)")

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes()

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"runtime": XLA_RUNTIME, "num_hosts": self.host.num_hosts}

    def write_checkpoint(self, checkpointer: Checkpointer, save: Save) -> tuple[str | None, bool]:
        # Blocks while each host copies its devices' shards to host memory; written in the background.
        where = start_xla_checkpoint(
            checkpointer,
            model=save.model,
            optimizer=save.optimizer,
            step=save.step,
            consumed_samples=save.consumed_samples,
            rng=capture_rng_state(),
            extra=save.extra,
            side_objects=save.side,
            last=save.last,
        )
        return where, True

    def close(self) -> None:
        """Nothing to leave: the hosts' CPU group (DCP's) lives as long as the process."""

    def validation_loss(self, model: nn.Module, rows: torch.Tensor, evaluation: Evaluation) -> float:
        """This host's devices' rows (device d's samples are rank d's), `micro_batch_size` of each device's
        per pass, split along the batch over the mesh; the mean is one transfer to the host."""
        import torch_xla

        local = self.host.num_local_devices
        mine = rows.reshape(local, rows.shape[0] // local, -1)
        share, seq = mine.shape[1], mine.shape[2] - 1
        total = torch.zeros((), device=torch_xla.device())
        for start in range(0, share, evaluation.micro_batch_size):
            part = mine[:, start : start + evaluation.micro_batch_size]
            batch = send_rows(part.reshape(-1, part.shape[-1]).long(), self.layout)
            # Each pass's loss is the mean over all devices' rows of this pass: weighted by its tokens.
            loss = micro_batch_loss(model, batch, evaluation.autocast())
            total = total + loss.float() * (part.shape[1] * self.host.num_devices * seq)
            torch_xla.sync()
        return float(total.cpu()) / (evaluation.num_samples * seq)
