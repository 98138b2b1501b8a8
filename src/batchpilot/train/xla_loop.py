"""The trainer on XLA (`train.runtime: xla`): one process per host, SPMD over every device of the stage.

The same stages, batches, sample order, LR schedule, clipping, checkpoints and metrics as the eager
trainer (trainer.py), which this module reuses wherever a piece does not touch the device. What differs:

- One process per host drives all of that host's devices; the world size is the slice's device count
  (`xr.global_runtime_device_count()`), one logical data-parallel rank per device.
- Every accumulation pass is one batch of `micro x devices` rows sharded along dim 0: device `d` holds
  rows `[d x micro, (d + 1) x micro)`, the positions rank `d` trains on a GPU job of the same world size
  (`rank_micro_batches`). A host reads only its devices' rows (its `TokenLoader` is rank `host` of
  `num_hosts` with `micro x local devices` samples per pass: hosts own consecutive devices of the mesh).
- Each pass ends with `torch_xla.sync()` (one compiled graph per pass, the same graph every pass); the
  loss and the norms stay on the device until the step ends.
- Checkpoints are the eager trainer's sharded DCP format, keyed by parameter name, written through the
  SPMD save planner (each host writes its own shards); they load on any device count and in the eager
  trainer.

Not implemented (refused with one line, see `xla.refuse_unsupported`): loading hosts, torch.compile, and
the halving of the micro batch after an out-of-memory error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchpilot import runstate
from batchpilot.config import Config
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import PREEMPTED_FILE
from batchpilot.models.factory import build_model, set_activation_checkpointing
from batchpilot.planning import Plan, Stage
from batchpilot.planning.adaptive import AdaptiveRun
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state, restore_rng_state
from batchpilot.train.init_from import start_from
from batchpilot.train.loop import LoopBase, prepare_outputs, run_loop
from batchpilot.train.noise import NoiseScaleEMA
from batchpilot.train.step import INJECT_OOM_ENV, micro_batch_loss
from batchpilot.train.steps import append_audit
from batchpilot.train.trainer import (
    check_resume_point,
    check_same_data_order,
    check_vocabulary,
    device_peak,
    make_optimizer,
    model_flops_per_token,
)
from batchpilot.train.xla import (
    XLA_RUNTIME,
    Layout,
    XlaHost,
    init_optimizer_state,
    make_layout,
    move_to_xla,
    refuse_unsupported,
    shard_blocks,
    shard_parameters,
    start_runtime,
    uses_bf16_on_xla,
)
from batchpilot.train.xla_state import (
    agree,
    peak_memory_bytes,
    restore_xla_state,
    save_xla_checkpoint,
    send_rows,
)
from batchpilot.train.xla_validate import XlaValidator

logger = logging.getLogger(__name__)


@dataclass
class PassResult:
    """One optimizer step's passes, as device tensors until the step ends (None: not measured)."""

    loss: torch.Tensor
    small_batch: int = 0
    """Samples of the small-batch gradient (the first pass over all devices)."""
    small_sq_norm: torch.Tensor | None = None
    coherence: torch.Tensor | None = None


def _sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach() for p in model.parameters() if p.grad is not None]


@dataclass(kw_only=True)
class XlaLoop(LoopBase):
    """The XLA loop for one invocation: one process per host, SPMD over every device of the stage."""

    host: XlaHost
    layout: Layout
    compiles_seen: int = 0

    @property
    def is_main(self) -> bool:
        return self.host.is_main

    @property
    def world_size(self) -> int:
        return self.host.num_devices

    @property
    def world_label(self) -> str:
        return f"{self.world_size} devices"

    @property
    def noise_strategy(self) -> str:
        return XLA_RUNTIME

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes()

    def run(self) -> int:
        end = self.stages[-1].end_sample
        while self.consumed < end:
            stage = self.plan.stage_at(self.consumed)
            micro, accumulation = self.batch_split(stage)
            lr = self.set_lr(stage)
            started = time.perf_counter()
            result = self._passes(stage, micro, accumulation)
            # As in the eager loop: the hosts agree once per step, at its end, on a SIGTERM on any host and on
            # host 0's clock saying a time checkpoint is due.
            stop, checkpoint_due = self._finish_step(stage, result, micro, accumulation, started, lr)
            code = self.after_step(stage, stop=stop, checkpoint_due=checkpoint_due)
            if code is not None:
                return code
        return 0

    def _passes(self, stage: Stage, micro: int, accumulation: int) -> PassResult:
        """Forward and backward of every pass (gradients accumulate in the parameters' layout)."""
        import torch_xla

        local_rows = micro * self.host.num_local_devices
        batches = self.loader.micro_batches(
            consumed_samples=self.consumed,
            global_batch_size=stage.global_batch_size,
            micro_batch_size=local_rows,
            gradient_accumulation_steps=accumulation,
        )
        if self.splits_for_noise(micro, accumulation):
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
        else:
            pass_rows = micro
        measure = accumulation > 1
        total: torch.Tensor | None = None
        result = PassResult(loss=torch.zeros(()), small_batch=pass_rows * self.world_size)
        first: list[torch.Tensor] | None = None
        for index, rows in enumerate(batches):
            batch = send_rows(rows, self.layout)
            loss = micro_batch_loss(self.model, batch, self.autocast())
            (loss / accumulation).backward()
            total = loss.detach() if total is None else total + loss.detach()
            if index == 0 and measure and self.config.train.measure_noise_scale:
                # The first pass's mean gradient over all devices: batch micro x devices (as under fsdp).
                result.small_sq_norm = _sq_norm(_gradients(self.model)) * accumulation**2
            if index == 0 and measure and self.config.train.measure_coherence:
                first = [g.clone() for g in _gradients(self.model)]
            if index == 1 and first is not None:
                second = [g - f for g, f in zip(_gradients(self.model), first, strict=True)]
                dot = torch.stack(
                    [(a.float() * b.float()).sum() for a, b in zip(first, second, strict=True)]
                ).sum()
                result.coherence = dot / (_sq_norm(first) * _sq_norm(second)).sqrt()
                first = None
            torch_xla.sync()
        assert total is not None
        result.loss = total / accumulation
        if self.audit_dir is not None and self.host.is_main:
            self._audit(stage, micro)
        return result

    def _finish_step(
        self, stage: Stage, result: PassResult, micro: int, accumulation: int, started: float, lr: float
    ) -> tuple[bool, bool]:
        """Clips, steps the optimizer, reads the step's numbers and writes its metrics; returns the agreed
        (stop, checkpoint due)."""
        import torch_xla
        import torch_xla.debug.metrics as met

        clip = self.config.train.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        values = [result.loss, grad_norm, result.small_sq_norm, result.coherence]
        loss, norm, small_sq, coherence = (None if v is None else float(v.item()) for v in values)
        stop, checkpoint_due = agree(self.stop_requested, self.time_checkpoint_due())
        step_time_s = time.perf_counter() - started
        before = self.consumed
        self.consumed += stage.global_batch_size
        self.step += 1
        val_loss = self.validation_loss(stage, before=before, micro=micro)
        assert loss is not None and norm is not None
        noise_scale = None
        if small_sq is not None:
            noise_scale = self.measure_noise(
                stage, small_batch=result.small_batch, small_sq_norm=small_sq, big_sq_norm=norm**2
            )
        self.record(
            stage, micro=micro, accumulation=accumulation, lr=lr, loss=loss, grad_norm=norm,
            step_time_s=step_time_s, noise_scale=noise_scale, coherence=coherence, val_loss=val_loss,
            extra={
                "runtime": XLA_RUNTIME,
                "xla_compiles": self._new_compiles(met),
                **(self.adaptive_record(stage) or {}),
            },
        )  # fmt: skip
        return stop, checkpoint_due

    def _new_compiles(self, met: Any) -> int:
        """Graphs XLA compiled since the last step's record: the first step's training graph, a stage's new
        batch shape, the first evaluation; any other is a recompilation that costs every step its time."""
        data = met.metric_data("CompileTime")
        total = int(data[0]) if data else 0
        new, self.compiles_seen = total - self.compiles_seen, total
        return new

    def _audit(self, stage: Stage, micro: int) -> None:
        """The positions every device (logical rank) trained, in the eager trainer's audit format."""
        assert self.audit_dir is not None
        append_audit(
            self.audit_dir, stage, consumed=self.consumed, micro=micro, world_size=self.world_size,
            ranks=range(self.world_size),
        )  # fmt: skip

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"runtime": XLA_RUNTIME, "num_hosts": self.host.num_hosts}

    def write_checkpoint(
        self, *, extra: dict[str, Any], side: dict[str, bytes] | None
    ) -> tuple[str | None, bool]:
        # Synchronous: each host writes its devices' shards through torch_xla's SPMD planner, which reads
        # them from the devices; there is no staged CPU copy to write in the background.
        where = save_xla_checkpoint(
            self.checkpointer,
            model=self.model,
            optimizer=self.optimizer,
            step=self.step,
            consumed_samples=self.consumed,
            rng=capture_rng_state(),
            extra=extra,
            side_objects=side,
        )
        return where, False


def check_device_count(*, stages: list[Stage], stage: str, host: XlaHost, devices_per_node: int) -> None:
    """A stage or a launch runs on its planned devices (`num_nodes x devices_per_node`), as under eager."""
    if stage == "all":
        return
    wrong = next((s for s in stages if s.world_size != host.num_devices), None)
    if wrong is not None:
        raise BatchpilotError(
            "--stage",
            f"{wrong.name} is planned for {wrong.num_nodes} node(s) x {devices_per_node} = {wrong.world_size} "
            f"devices, this XLA job has {host.num_devices} ({host.num_hosts} host process(es))",
            "start it at the planned size (locally: CPU_NUM_DEVICES set to the stage's devices, PJRT_DEVICE=CPU)",
        )


def _build_model(
    config: Config, layout: Layout, *, vocab_size: int, host: XlaHost, checkpoint: Checkpoint | None
) -> tuple[nn.Module, int]:
    """The model as the eager trainer builds it (same seed, on the CPU; `train.init_from`'s weights on a
    start without a checkpoint, each host reading its own node's copy), moved to XLA and sharded."""
    torch.manual_seed(config.train.seed)
    model = build_model(factory=config.model.factory, args=config.model.args)
    check_vocabulary(model, vocab_size=vocab_size)
    start_from(
        model,
        config=config,
        resuming_step=None if checkpoint is None else checkpoint.step,
        local_rank=0,  # one process per host
        say=lambda message: logger.info(message) if host.is_main else None,
        say_every_rank=lambda message: logger.info(f"[host {host.host}] {message}"),
    )
    set_activation_checkpointing(model, config.train.activation_checkpointing)
    move_to_xla(model)
    sharded = shard_parameters(model, layout)
    shard_blocks(model, layout)
    return model, sharded


def _refuse(config: Config) -> None:
    refuse_unsupported(config)
    if os.environ.get(INJECT_OOM_ENV):
        raise BatchpilotError(
            INJECT_OOM_ENV, "halving the micro batch after out of memory is not implemented for runtime xla"
        )


def _train_loader(config: Config, host: XlaHost) -> TokenLoader:
    """This host's loader: rank `host` of `hosts`, whose samples per pass are its devices' rows."""
    return TokenLoader(
        uri=config.data.uri,
        seq_len=config.data.seq_len,
        seed=config.train.seed,
        rank=host.host,
        world_size=host.num_hosts,
        local_world_size=1,
        split=config.data.split,
        shuffle=config.data.shuffle,
        prefetch_steps=config.data.prefetch_steps,
        verify_checksums=config.data.verify_checksums,
        shuffle_block_samples=config.data.shuffle_block_samples,
        shuffle_window_blocks=config.data.shuffle_window_blocks,
    )


def _restore(
    checkpoint: Checkpoint | None,
    *,
    host: XlaHost,
    uri: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: Layout,
) -> dict[str, Any]:
    """Loads the checkpoint (any runtime, any device count); returns the loop's restored fields."""
    if checkpoint is None:
        return {}
    restore_xla_state(checkpoint, model=model, optimizer=optimizer, layout=layout)
    restore_rng_state(checkpoint.rng)
    noise = NoiseScaleEMA()
    if "noise_scale_ema" in checkpoint.meta:
        noise.load_state_dict(checkpoint.meta["noise_scale_ema"])
    if host.is_main:
        logger.info(
            "resumed from step %d (%s samples) of %s (saved by %s device(s) under %s, runtime %s)",
            checkpoint.step, f"{checkpoint.consumed_samples:,}", uri, checkpoint.meta.get("world_size", "?"),
            checkpoint.meta.get("parallelism", "ddp"), checkpoint.meta.get("runtime", "eager"),
        )  # fmt: skip
    return {"noise": noise, "saved_step": checkpoint.step}


def train_xla(
    *,
    config: Config,
    plan: Plan,
    stage: str,
    output_dir: Path,
    audit: bool = False,
    adaptive: AdaptiveRun | None = None,
) -> int:
    """Trains the selected stage(s) of `plan` on this host's XLA devices (one process per host).

    Args:
        adaptive: an adaptive ramp-up's rule and decisions so far: the open stage ends where it fires.
    """
    _refuse(config)
    stages = list(plan.select(stage, allow_all=True))
    host = start_runtime()
    check_device_count(stages=stages, stage=stage, host=host, devices_per_node=plan.devices_per_node)
    checkpointer = Checkpointer(uri=config.train.checkpoint_uri, keep_last=config.train.keep_checkpoints)
    checkpoint = checkpointer.load()
    consumed = check_resume_point(stages=stages, checkpoint=checkpoint, uri=config.train.checkpoint_uri)
    check_same_data_order(config, checkpoint)
    if consumed == stages[-1].end_sample:
        if host.is_main:
            logger.info(
                "%s is already complete (%s samples): nothing to do", stages[-1].name, f"{consumed:,}"
            )
        return 0
    loader = _train_loader(config, host)
    layout = make_layout(
        strategy=plan.parallelism, num_devices=host.num_devices, devices_per_node=plan.devices_per_node
    )
    validator = XlaValidator.from_config(config, host, layout)  # a missing validation split fails here
    model, num_sharded = _build_model(
        config, layout, vocab_size=loader.vocab_size, host=host, checkpoint=checkpoint
    )
    optimizer = make_optimizer(model, weight_decay=config.train.weight_decay)
    init_optimizer_state(model, optimizer, layout)  # the first step compiles the graph every step runs
    restored = _restore(
        checkpoint,
        host=host,
        uri=config.train.checkpoint_uri,
        model=model,
        optimizer=optimizer,
        layout=layout,
    )
    metrics, audit_dir = prepare_outputs(
        output_dir, is_main=host.is_main, checkpointer=checkpointer, consumed=consumed, audit=audit
    )
    bf16 = uses_bf16_on_xla(config.train.precision)
    loop = XlaLoop(
        host=host,
        config=config,
        plan=plan,
        stages=stages,
        model=model,
        layout=layout,
        optimizer=optimizer,
        loader=loader,
        checkpointer=checkpointer,
        metrics=metrics,
        lr=plan.lr_schedule,
        consumed=consumed,
        step=checkpoint.step if checkpoint else 0,
        audit_dir=audit_dir,
        autocast=_autocast(bf16),
        validator=validator if validator.enabled else None,
        flops_per_token=model_flops_per_token(config),
        peak_flops=device_peak(config, torch.device("xla"), bf16=bf16),
        micro_override=runstate.read_micro_batch_overrides(checkpointer.storage),
        preempted_file=output_dir / PREEMPTED_FILE,
        adaptive=adaptive,
        **restored,
    )
    if checkpoint is not None:
        loop.restore_trace(checkpoint.meta)
    loop.log(
        f"training {', '.join(s.name for s in stages)} on {host.num_devices} XLA device(s) of "
        f"{host.num_hosts} host(s) (runtime xla, SPMD; {_describe(layout, num_sharded)}) from sample {consumed:,}"
    )
    return run_loop(loop, closing=[loader.close])


def _autocast(bf16: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """`train.precision: bf16`: autocast to bf16 over fp32 weights on the XLA device; else fp32."""
    if bf16:
        return lambda: torch.autocast(device_type="xla", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _describe(layout: Layout, num_sharded: int) -> str:
    if layout.param_axis is None:
        return "parameters replicated (ddp)"
    return (
        f"all {num_sharded} parameters sharded {layout.shard_degree} ways on their largest dimension over mesh "
        f"axis {layout.param_axis!r}"
    )
