"""The trainer: runs stages of a plan from `latest`, checkpoints at the stage's end sample, and stops.

Read it top to bottom: `train()` sets up (process group, model, optimizer, resume, loader), then
`_Loop.run()` steps until the last requested stage's `end_sample`. Everything that varies over
training (stage, batch, accumulation, LR, data order) is a function of `consumed_samples`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batchpilot import runstate
from batchpilot.config import Config, resolved_runtime
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import PREEMPTED_FILE
from batchpilot.models.factory import build_model, compile_model, set_activation_checkpointing
from batchpilot.planning import Plan, Stage
from batchpilot.planning.adaptive import AdaptiveRun
from batchpilot.planning.devices import device_peak_flops
from batchpilot.planning.flops import flops_per_token, peak_bf16_flops
from batchpilot.train.checkpoint import Checkpoint, Checkpointer, capture_rng_state, restore_rng_state
from batchpilot.train.distributed import DistContext
from batchpilot.train.evaluate import Validator
from batchpilot.train.init_from import start_from
from batchpilot.train.loop import LoopBase, data_order, prepare_outputs, run_loop
from batchpilot.train.parallel import Parallel, Strategy, wrap_model
from batchpilot.train.shape import model_shape
from batchpilot.train.state import restore_training_state, training_state
from batchpilot.train.step import (
    StepOutcome,
    UnagreedOutOfMemory,
    accumulate_gradients,
    install_oom_injection,
)
from batchpilot.train.steps import append_audit
from batchpilot.train.xla import XLA_RUNTIME

logger = logging.getLogger(__name__)


def log(ctx: DistContext, message: str) -> None:
    """Logs the live progress and the stage's summary at INFO, on rank 0 only (the other ranks would
    repeat it)."""
    if ctx.is_main:
        logger.info(message)


def make_optimizer(model: nn.Module, *, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and embeddings' 1-D parameters. Fused (one kernel for every
    parameter's update) when the parameters are on CUDA; elsewhere PyTorch's default implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


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


def device_peak(config: Config, device: torch.device, *, bf16: bool) -> float | None:
    """The bf16 peak FLOP/s of one device (`cluster.device_peak_flops`, else the device table by the pool's
    accelerator type or the CUDA device's name); None for fp32 training or an unknown device."""
    if config.cluster.device_peak_flops is not None:
        return config.cluster.device_peak_flops
    if not bf16:
        return None
    if device.type == "cuda":
        return peak_bf16_flops(torch.cuda.get_device_name(device))
    return device_peak_flops(config.cluster.accelerator_type)


def model_flops_per_token(config: Config) -> float:
    """Training FLOPs per token of the config's model (6N plus attention, planning/flops.py)."""
    shape = model_shape(factory=config.model.factory, args=config.model.args)
    return flops_per_token(
        num_params=shape.num_params,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        seq_len=config.data.seq_len,
    )


def check_same_data_order(config: Config, checkpoint: Checkpoint | None) -> None:
    """Refuses to resume with a different sample order (samples would be repeated or skipped)."""
    saved = checkpoint.meta.get("data_order") if checkpoint else None
    if saved is None:
        return
    for key, value in data_order(config).items():
        if saved.get(key) != value:
            raise BatchpilotError(
                f"data.{key}" if key != "seed" else "train.seed",
                f"is {value!r} but the checkpoint was trained with {saved.get(key)!r}; resuming would repeat or "
                "skip samples",
                "restore the setting, or start a new run with a new checkpoint_uri",
            )


def check_vocabulary(model: nn.Module, *, vocab_size: int) -> None:
    """The model's first embedding must cover every token id of the dataset."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None and embedding.num_embeddings < vocab_size:
        raise BatchpilotError(
            "model.args.vocab_size",
            f"the model embeds {embedding.num_embeddings} token ids but the dataset's vocabulary has {vocab_size}",
            f"set vocab_size to at least {vocab_size}",
        )


def start_from_init_from(
    model: nn.Module, *, config: Config, checkpoint: Checkpoint | None, ctx: DistContext
) -> None:
    """`train.init_from` on this rank (see `batchpilot.train.init_from.start_from`)."""
    start_from(
        model,
        config=config,
        resuming_step=None if checkpoint is None else checkpoint.step,
        local_rank=ctx.local_rank,
        say=lambda message: log(ctx, message),
        say_every_rank=lambda message: logger.info(f"[rank {ctx.rank}] {message}"),
    )


def check_resume_point(*, stages: list[Stage], checkpoint: Checkpoint | None, uri: str) -> int:
    """The consumed_samples to start from; raises when the checkpoint does not belong to these stages."""
    first, last = stages[0], stages[-1]
    consumed = checkpoint.consumed_samples if checkpoint else 0
    if checkpoint is None and first.start_sample > 0:
        raise BatchpilotError(
            "train.checkpoint_uri",
            f"{first.name} starts at sample {first.start_sample:,} but {uri} holds no checkpoint",
            "run the earlier stages first (or point checkpoint_uri at their checkpoints)",
        )
    if consumed < first.start_sample:
        raise BatchpilotError(
            "--stage",
            f"the latest checkpoint is at sample {consumed:,}, before {first.name} starts ({first.start_sample:,})",
            "run the stage that contains that sample first",
        )
    if consumed > last.end_sample:
        raise BatchpilotError(
            "--stage",
            f"the latest checkpoint ({consumed:,} samples) is past the end of {last.name} ({last.end_sample:,})",
            "run a later stage",
        )
    return consumed


@dataclass(kw_only=True)
class _Loop(LoopBase):
    """The eager loop for one invocation: one process per device (torchrun), DDP or FSDP2 over them."""

    ctx: DistContext
    parallel: Parallel

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes(self.ctx.device)

    def run(self) -> int:
        end = self.stages[-1].end_sample
        while self.consumed < end:
            stage = self.plan.stage_at(self.consumed)
            try:
                outcome, micro, accumulation, started, lr = self._attempt(stage)
            except UnagreedOutOfMemory as error:
                self._end_after_unagreed_oom(stage, error.micro_batch_size)
            if outcome.out_of_memory:
                self._halve_micro_batch(stage, micro)
                continue
            # The step's one host synchronisation also agrees on a SIGTERM on any rank and on rank 0's clock
            # saying a time checkpoint is due (every rank must enter the save's barrier together).
            stop, checkpoint_due = self._finish_step(stage, outcome, micro, accumulation, started, lr)
            code = self.after_step(stage, stop=stop, checkpoint_due=checkpoint_due)
            if code is not None:
                return code
        self.wait_for_checkpoint()  # the last stage's checkpoint is committed before the process exits
        return 0

    def _attempt(self, stage: Stage) -> tuple[StepOutcome, int, int, float, float]:
        """Runs the passes of one step: (outcome, micro batch, accumulation, perf_counter at the start, lr)."""
        micro, accumulation = self.batch_split(stage)
        lr = self.set_lr(stage)
        started = time.perf_counter()
        batches = self.loader.micro_batches(
            consumed_samples=self.consumed,
            global_batch_size=stage.global_batch_size,
            micro_batch_size=micro,
            gradient_accumulation_steps=accumulation,
        )
        if self.splits_for_noise(micro, accumulation):
            # The same samples on this rank, as two passes of half the micro batch: the same gradient, and
            # the first half's, over all ranks, is the noise scale's small batch (planning/noise.py).
            batches = list(batches[0].chunk(2))
        outcome = accumulate_gradients(
            model=self.model,
            parallel=self.parallel,
            micro_batches=batches,
            ctx=self.ctx,
            autocast=self.autocast,
            measure_noise=self.config.train.measure_noise_scale,
            measure_coherence=self.config.train.measure_coherence,
        )
        if outcome.completed and self.audit_dir is not None:
            self._audit(stage, micro)
        return outcome, micro, accumulation, started, lr

    def _halved(self, stage: Stage, micro: int) -> int:
        if micro % 2:
            raise BatchpilotError(
                "batch.micro_batch_size",
                f"out of memory at micro batch {micro} in {stage.name}, which cannot be halved evenly",
                "use a smaller micro batch (batchpilot explore finds one that fits)",
            )
        return micro // 2

    def _halve_micro_batch(self, stage: Stage, micro: int) -> None:
        self.micro_override[stage.index] = self._halved(stage, micro)
        if self.ctx.device.type == "cuda":  # peak_memory_bytes reports the attempts that fit, not this one
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        if self.ctx.is_main:
            runstate.write_micro_batch_overrides(self.checkpointer.storage, self.micro_override)
        log(
            self.ctx,
            f"out of memory at micro_batch_size={micro} (agreed by all ranks): retrying the same global batch "
            f"{stage.global_batch_size} with micro_batch_size={micro // 2}, "
            f"gradient_accumulation_steps={stage.global_batch_size // (micro // 2 * self.ctx.world_size)}",
        )

    def _end_after_unagreed_oom(self, stage: Stage, micro: int) -> NoReturn:
        """An OOM inside collectives the other ranks wait in (any pass under FSDP, the last micro-batch's
        backward under DDP): record the halved size where the retry reads it, and end this process at once
        (torchrun, or the pod's exit, stops the others)."""
        self.micro_override[stage.index] = self._halved(stage, micro)
        runstate.write_micro_batch_overrides(self.checkpointer.storage, self.micro_override)
        logger.error(
            "rank %d ran out of memory at micro_batch_size=%d in %s under %s, inside collectives where the "
            "ranks cannot agree to retry: recorded micro_batch_size=%d in %s; the stage's retry resumes from "
            "the last checkpoint with it",
            self.ctx.rank, micro, stage.name, self.parallel.strategy, micro // 2,
            runstate.micro_batch_uri(self.checkpointer.storage),
        )  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def _read_step(self, outcome: StepOutcome, grad_norm: torch.Tensor) -> tuple[list[float], list[bool]]:
        """The step's one host synchronisation (one small all-reduce): [mean loss, mean small-batch squared
        norm, gradient norm, coherence or NaN] and [SIGTERM on any rank, a time checkpoint due]."""
        assert outcome.loss is not None
        device = self.ctx.device
        zero, nan = torch.zeros((), device=device), torch.full((), math.nan, device=device)
        small_sq = outcome.small_sq_norm if outcome.small_sq_norm is not None else zero
        coherence = outcome.coherence if outcome.coherence is not None else nan
        full_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        means, flags, local = self.ctx.step_values(
            means=[outcome.loss, small_sq],
            flags=[self.stop_requested, self.time_checkpoint_due()],
            local=[full_norm, coherence],
        )
        return [*means, *local], flags

    def _finish_step(
        self, stage: Stage, outcome: StepOutcome, micro: int, accumulation: int, started: float, lr: float
    ) -> tuple[bool, bool]:
        """Clips, steps the optimizer, reads the step's numbers and writes its metrics; returns the agreed
        (stop, checkpoint due)."""
        clip = self.config.train.grad_clip or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        (loss, small_sq, grad_norm, coherence), (stop, checkpoint_due) = self._read_step(outcome, norm)
        step_time_s = time.perf_counter() - started
        before = self.consumed
        self.consumed += stage.global_batch_size
        self.step += 1
        val_loss = self.validation_loss(stage, before=before, micro=micro)
        noise_scale = self.measure_noise(
            stage, small_batch=outcome.small_batch, small_sq_norm=small_sq, big_sq_norm=grad_norm**2
        )
        extra = self.adaptive_record(stage)
        self.record(
            stage, micro=micro, accumulation=accumulation, lr=lr, loss=loss, grad_norm=grad_norm,
            step_time_s=step_time_s, noise_scale=noise_scale, coherence=None if math.isnan(coherence) else coherence,
            val_loss=val_loss, extra=extra,
        )  # fmt: skip
        return stop, checkpoint_due

    def _audit(self, stage: Stage, micro: int) -> None:
        assert self.audit_dir is not None
        append_audit(
            self.audit_dir, stage, consumed=self.consumed, micro=micro, world_size=self.ctx.world_size,
            ranks=[self.ctx.rank],
        )  # fmt: skip

    def write_checkpoint(
        self, *, extra: dict[str, Any], side: dict[str, bytes] | None
    ) -> tuple[str | None, bool]:
        # Blocks while this rank's state is copied to CPU memory; the files are written in the background.
        where = self.checkpointer.start_save_sharded(
            step=self.step,
            consumed_samples=self.consumed,
            state=training_state(self.model, self.optimizer),
            rng=capture_rng_state(),
            extra=extra,
            side_objects=side,
        )
        return where, True


def train(
    *,
    config: Config,
    plan: Plan,
    stage: str,
    output_dir: Path,
    audit: bool = False,
    adaptive: AdaptiveRun | None = None,
) -> int:
    """Trains the selected stage(s) of `plan` in this process (one rank of a torchrun job); returns the exit code.
    With `adaptive` (an adaptive ramp-up) the open stage ends where the rule fires (`_adaptive_decision`)."""
    if resolved_runtime(config) == XLA_RUNTIME:  # torch_xla, one process per host: train/xla_loop.py
        from batchpilot.train.xla_loop import train_xla

        return train_xla(
            config=config,
            plan=plan,
            stage=stage,
            output_dir=output_dir,
            audit=audit,
            adaptive=adaptive,
        )
    stages = list(plan.select(stage, allow_all=True))
    ctx = DistContext.from_env()
    # `all` trains every stage on whatever world divides them (tests, one-machine runs); a stage or a range
    # of stages (one launch) runs at its planned size.
    wrong = next((s for s in stages if s.world_size != ctx.world_size), None) if stage != "all" else None
    if wrong is not None:
        raise BatchpilotError(
            "--stage",
            f"{wrong.name} is planned for {wrong.num_nodes} node(s) x {plan.devices_per_node} = "
            f"{wrong.world_size} processes, this job has {ctx.world_size}",
            "start it with `batchpilot launch` (or torchrun) at the planned size",
        )
    checkpointer = Checkpointer(uri=config.train.checkpoint_uri, keep_last=config.train.keep_checkpoints)
    checkpoint = checkpointer.load()
    consumed = check_resume_point(stages=stages, checkpoint=checkpoint, uri=config.train.checkpoint_uri)
    check_same_data_order(config, checkpoint)
    if consumed == stages[-1].end_sample:
        log(ctx, f"{stages[-1].name} is already complete ({consumed:,} samples): nothing to do")
        return 0
    loader = TokenLoader(
        uri=config.data.uri,
        seq_len=config.data.seq_len,
        seed=config.train.seed,
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_world_size=ctx.local_world_size,
        expansion_factor=config.data.expansion_factor_real_data,
        split=config.data.split,
        shuffle=config.data.shuffle,
        prefetch_steps=config.data.prefetch_steps,
        verify_checksums=config.data.verify_checksums,
        shuffle_block_samples=config.data.shuffle_block_samples,
        shuffle_window_blocks=config.data.shuffle_window_blocks,
    )
    validator = Validator.from_config(config, ctx)  # a missing validation split fails here, before training
    torch.manual_seed(config.train.seed)
    model = build_model(factory=config.model.factory, args=config.model.args)
    check_vocabulary(model, vocab_size=loader.vocab_size)
    start_from_init_from(model, config=config, checkpoint=checkpoint, ctx=ctx)  # before it moves or shards
    set_activation_checkpointing(model, config.train.activation_checkpointing)
    model.to(ctx.device)
    if config.train.compile:
        compile_model(model)
    install_oom_injection(model, ctx)
    strategy: Strategy = plan.parallelism  # type: ignore[assignment]
    parallel = wrap_model(model, ctx, strategy=strategy, bf16=uses_bf16(ctx.device, config.train.precision))
    optimizer = make_optimizer(model, weight_decay=config.train.weight_decay)  # after sharding: on the shards
    if checkpoint is not None:
        restore_training_state(checkpoint, model, optimizer)
        restore_rng_state(checkpoint.rng)
        saved = checkpoint.meta.get("parallelism", "ddp")
        log(
            ctx,
            f"resumed from step {checkpoint.step} ({consumed:,} samples) of {config.train.checkpoint_uri} "
            f"(saved by {checkpoint.meta.get('world_size', '?')} process(es) under {saved})",
        )
    metrics, audit_dir = prepare_outputs(
        output_dir, is_main=ctx.is_main, checkpointer=checkpointer, consumed=consumed, audit=audit
    )
    loop = _Loop(
        ctx=ctx,
        config=config,
        plan=plan,
        stages=stages,
        model=model,
        parallel=parallel,
        optimizer=optimizer,
        loader=loader,
        checkpointer=checkpointer,
        metrics=metrics,
        lr=plan.lr_schedule,
        consumed=consumed,
        step=checkpoint.step if checkpoint else 0,
        audit_dir=audit_dir,
        autocast=autocast_factory(ctx.device, config.train.precision, parallel),
        validator=validator if validator.enabled else None,
        flops_per_token=model_flops_per_token(config),
        peak_flops=device_peak(config, ctx.device, bf16=uses_bf16(ctx.device, config.train.precision)),
        preempted_file=output_dir / PREEMPTED_FILE,
        adaptive=adaptive,
    )
    if checkpoint is not None:
        loop.restore_trace(checkpoint.meta)
    loop.saved_step = loop.step if checkpoint else -1
    loop.micro_override = runstate.read_micro_batch_overrides(checkpointer.storage)
    if checkpoint is not None and "noise_scale_ema" in checkpoint.meta:
        loop.noise.load_state_dict(checkpoint.meta["noise_scale_ema"])
    log(
        ctx,
        f"training {', '.join(s.name for s in stages)} on {ctx.world_size} process(es) ({ctx.device.type}, "
        f"{parallel.describe()}) from sample {consumed:,}",
    )
    code = run_loop(loop, closing=[loader.close, validator.close])
    ctx.close()  # training ended on every rank: the process groups go before the interpreter finalises
    return code
