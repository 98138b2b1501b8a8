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
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_FILE, PREEMPTED_LOG_MARKER
from batchpilot.models.factory import build_model, set_activation_checkpointing
from batchpilot.planning import LRSchedule, Plan, Stage
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state, restore_rng_state
from batchpilot.train.metrics import METRICS_OBJECT, MetricsLog
from batchpilot.train.noise import NoiseScaleEMA
from batchpilot.train.step import INJECT_OOM_ENV, micro_batch_loss
from batchpilot.train.steps import append_audit, progress_line, stage_done_line, step_record
from batchpilot.train.trainer import (
    check_resume_point,
    check_same_data_order,
    check_vocabulary,
    data_order,
    device_peak,
    make_optimizer,
    model_flops_per_token,
    read_micro_batch_overrides,
    restore_metrics,
)
from batchpilot.train.xla import (
    XLA_RUNTIME,
    Layout,
    XlaHost,
    make_layout,
    move_to_xla,
    refuse_unsupported,
    shard_optimizer_state,
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
    small_sq_norm: torch.Tensor | None = None
    coherence: torch.Tensor | None = None


def _sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach() for p in model.parameters() if p.grad is not None]


@dataclass
class XlaLoop:
    """State of the XLA training loop for one invocation (the counterpart of trainer._Loop)."""

    host: XlaHost
    config: Config
    plan: Plan
    stages: list[Stage]
    model: nn.Module
    layout: Layout
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    checkpointer: Checkpointer
    metrics: MetricsLog | None
    lr: LRSchedule
    consumed: int
    step: int
    audit_dir: Path | None
    autocast: Callable[[], contextlib.AbstractContextManager]
    validator: XlaValidator | None = None
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    noise: NoiseScaleEMA = field(default_factory=NoiseScaleEMA)
    micro_override: dict[int, int] = field(default_factory=dict)
    optimizer_sharded: bool = False
    stop_requested: bool = False
    saved_step: int = -1
    last_log_s: float = 0.0
    last_save_s: float = field(default_factory=time.monotonic)
    preempted_file: Path | None = None

    @property
    def world_size(self) -> int:
        return self.host.num_devices

    def log(self, message: str) -> None:
        if self.host.is_main:
            logger.info(message)

    def run(self) -> int:
        end = self.stages[-1].end_sample
        while self.consumed < end:
            stop, checkpoint_due = agree(self.stop_requested, self._time_checkpoint_due())
            if stop:
                return self._preempted()
            if checkpoint_due:
                self._save(
                    why=f" ({self.config.train.checkpoint_every_s:g} s since the last: train.checkpoint_every_s)"
                )
            stage = self.plan.stage_at(self.consumed)
            micro = self.micro_override.get(stage.index, stage.micro_batch_size)
            accumulation = self._accumulation(stage, micro)
            lr = self.lr.at(consumed_samples=self.consumed, global_batch_size=stage.global_batch_size)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            started = time.perf_counter()
            result = self._passes(stage, micro, accumulation)
            if result is None:
                return self._preempted()
            self._finish_step(stage, result, micro, accumulation, started, lr)
            if self.consumed == stage.end_sample:
                self._save()
                self._stage_done(stage)
            elif (
                self.config.train.checkpoint_every_steps
                and self.step % self.config.train.checkpoint_every_steps == 0
            ):
                self._save()
        return 0

    def _time_checkpoint_due(self) -> bool:
        every_s = self.config.train.checkpoint_every_s
        return bool(self.host.is_main and every_s and time.monotonic() - self.last_save_s >= every_s)

    def _accumulation(self, stage: Stage, micro: int) -> int:
        per_pass = micro * self.world_size
        if stage.global_batch_size % per_pass:
            raise BatchpilotError(
                f"{stage.name}",
                f"global_batch_size {stage.global_batch_size} does not split over micro {micro} x "
                f"{self.world_size} XLA devices",
                "launch the stage with the plan's node count",
            )
        return stage.global_batch_size // per_pass

    def _passes(self, stage: Stage, micro: int, accumulation: int) -> PassResult | None:
        """Forward and backward of every pass (gradients accumulate in the parameters' layout); None when
        a stop was agreed between passes (the partial gradients are dropped)."""
        import torch_xla

        local_rows = micro * self.host.num_local_devices
        batches = self.loader.micro_batches(
            consumed_samples=self.consumed,
            global_batch_size=stage.global_batch_size,
            micro_batch_size=local_rows,
            gradient_accumulation_steps=accumulation,
        )
        measure = accumulation > 1
        total: torch.Tensor | None = None
        result = PassResult(loss=torch.zeros(()))
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
            if index < accumulation - 1 and agree(self.stop_requested)[0]:
                self.optimizer.zero_grad(set_to_none=True)
                return None
        assert total is not None
        result.loss = total / accumulation
        if self.audit_dir is not None and self.host.is_main:
            self._audit(stage, micro)
        return result

    def _finish_step(
        self, stage: Stage, result: PassResult, micro: int, accumulation: int, started: float, lr: float
    ) -> None:
        import torch_xla

        clip = self.config.train.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not self.optimizer_sharded:  # AdamW's moments exist from the first step on: lay them out once
            shard_optimizer_state(self.model, self.optimizer, self.layout)
            self.optimizer_sharded = True
        torch_xla.sync()
        values = [result.loss, grad_norm, result.small_sq_norm, result.coherence]
        loss, norm, small_sq, coherence = (None if v is None else float(v.item()) for v in values)
        step_time_s = time.perf_counter() - started
        before = self.consumed
        self.consumed += stage.global_batch_size
        self.step += 1
        val_loss = None
        if self.validator is not None and self.validator.due(
            before, self.consumed, stage_end=self.consumed == stage.end_sample
        ):
            val_loss = self.validator.evaluate(self.model, micro_batch_size=micro, autocast=self.autocast)
        assert loss is not None and norm is not None
        noise_scale = None
        if small_sq is not None:
            noise_scale = self.noise.update(
                small_sq_norm=small_sq,
                big_sq_norm=norm**2,
                b_small=micro * self.world_size,
                b_big=stage.global_batch_size,
            )
        self._record(
            stage, micro, accumulation, lr, loss, norm, step_time_s, noise_scale, coherence, val_loss
        )

    def _record(
        self,
        stage: Stage,
        micro: int,
        accumulation: int,
        lr: float,
        loss: float,
        grad_norm: float,
        step_time_s: float,
        noise_scale: float | None,
        coherence: float | None,
        val_loss: float | None,
    ) -> None:
        record = step_record(
            step=self.step,
            consumed=self.consumed,
            stage=stage,
            micro=micro,
            accumulation=accumulation,
            world_size=self.world_size,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=step_time_s,
            seq_len=self.config.data.seq_len,
            flops_per_token=self.flops_per_token,
            peak_flops=self.peak_flops,
            peak_memory_bytes=peak_memory_bytes(),
            noise_scale=noise_scale,
            coherence=coherence,
            val_loss=val_loss,
        ) | {"runtime": XLA_RUNTIME}
        if self.metrics is not None:
            self.metrics.append(record)
        self._progress(stage, record)

    def _progress(self, stage: Stage, record: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self.last_log_s < 2.0 and self.consumed != stage.end_sample and record["val_loss"] is None:
            return
        self.last_log_s = now
        self.log(progress_line(stage, record, world=f"{self.world_size} devices"))

    def _audit(self, stage: Stage, micro: int) -> None:
        """The positions every device (logical rank) trained, in the eager trainer's audit format."""
        assert self.audit_dir is not None
        append_audit(
            self.audit_dir, stage, consumed=self.consumed, micro=micro, world_size=self.world_size,
            ranks=range(self.world_size),
        )  # fmt: skip

    def _save(self, why: str = "") -> None:
        if self.saved_step == self.step:
            return
        if self.metrics is not None:
            self.checkpointer.storage.write(METRICS_OBJECT, self.metrics.text().encode())
        where = save_xla_checkpoint(
            self.checkpointer,
            model=self.model,
            optimizer=self.optimizer,
            step=self.step,
            consumed_samples=self.consumed,
            rng=capture_rng_state(),
            extra={
                "world_size": self.world_size,
                "parallelism": self.plan.parallelism,
                "runtime": XLA_RUNTIME,
                "num_hosts": self.host.num_hosts,
                "stage": self.plan.stage_at(self.consumed - 1).index,
                "data_order": data_order(self.config),
                "noise_scale_ema": self.noise.state_dict(),
            },
        )
        self.log(f"checkpoint step {self.step} ({self.consumed:,} samples) -> {where}{why}")
        self.saved_step = self.step
        self.last_save_s = time.monotonic()

    def _stage_done(self, stage: Stage) -> None:
        self.log(stage_done_line(self.plan, stage, step=self.step))

    def _preempted(self) -> int:
        self.optimizer.zero_grad(set_to_none=True)
        self.log(f"SIGTERM: stopping at a micro-batch boundary, {self.consumed:,} samples consumed")
        self._save()
        if self.preempted_file is not None and self.host.is_main:
            self.preempted_file.write_text(f"{self.consumed}\n")
        self.log(f"{PREEMPTED_LOG_MARKER}; run the same stage again to resume exactly here")
        return EXIT_PREEMPTED


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


def _build_model(config: Config, layout: Layout, *, vocab_size: int) -> tuple[nn.Module, int]:
    """The model as the eager trainer builds it (same seed, on the CPU), moved to XLA and sharded."""
    torch.manual_seed(config.train.seed)
    model = build_model(factory=config.model.factory, args=config.model.args)
    check_vocabulary(model, vocab_size=vocab_size)
    set_activation_checkpointing(model, config.train.activation_checkpointing)
    move_to_xla(model)
    return model, shard_parameters(model, layout)


def _refuse(config: Config, *, adaptive: bool) -> None:
    refuse_unsupported(config)
    if adaptive:
        raise BatchpilotError(
            "batch.rampup",
            "an adaptive ramp-up is not implemented for runtime xla",
            "give the ramp-up's stages",
        )
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
    return {"optimizer_sharded": True, "noise": noise, "saved_step": checkpoint.step}


def _outputs(
    output_dir: Path, *, host: XlaHost, checkpointer: Checkpointer, consumed: int, audit: bool
) -> tuple[MetricsLog | None, Path | None]:
    """metrics.jsonl (host 0, restored up to `consumed`) and the audit folder, as the eager trainer keeps them."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / PREEMPTED_FILE).unlink(missing_ok=True)  # a previous run's marker is not this run's
    metrics = MetricsLog(output_dir / "metrics.jsonl") if host.is_main else None
    if metrics is not None:
        restore_metrics(metrics, checkpointer, consumed=consumed)
    audit_dir = output_dir / "audit" if audit else None
    if audit_dir is not None:
        audit_dir.mkdir(parents=True, exist_ok=True)
    return metrics, audit_dir


def train_xla(
    *, config: Config, plan: Plan, stage: str, output_dir: Path, audit: bool = False, adaptive: bool = False
) -> int:
    """Trains the selected stage(s) of `plan` on this host's XLA devices (one process per host).

    Args:
        adaptive: the ramp-up is adaptive (stages decided while training), which runtime xla refuses.
    """
    _refuse(config, adaptive=adaptive)
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
    model, num_sharded = _build_model(config, layout, vocab_size=loader.vocab_size)
    optimizer = make_optimizer(model, weight_decay=config.train.weight_decay)
    restored = _restore(
        checkpoint,
        host=host,
        uri=config.train.checkpoint_uri,
        model=model,
        optimizer=optimizer,
        layout=layout,
    )
    metrics, audit_dir = _outputs(
        output_dir, host=host, checkpointer=checkpointer, consumed=consumed, audit=audit
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
        micro_override=read_micro_batch_overrides(checkpointer),
        preempted_file=output_dir / PREEMPTED_FILE,
        **restored,
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stop_requested", True))
    loop.log(
        f"training {', '.join(s.name for s in stages)} on {host.num_devices} XLA device(s) of "
        f"{host.num_hosts} host(s) (runtime xla, SPMD; {_describe(layout, num_sharded)}) from sample {consumed:,}"
    )
    try:
        return loop.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        loader.close()
        sys.stdout.flush()


def _autocast(bf16: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """`train.precision: bf16`: autocast to bf16 over fp32 weights on the XLA device; else fp32."""
    if bf16:
        return lambda: torch.autocast(device_type="xla", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _describe(layout: Layout, num_sharded: int) -> str:
    if layout.param_axis is None:
        return "parameters replicated (ddp)"
    return f"{num_sharded} parameter(s) sharded {layout.shard_degree} ways on dim 0 over mesh axis {layout.param_axis!r}"
