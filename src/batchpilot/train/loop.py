"""The training loop, one for every runtime: it steps from the run's position to the last stage's end sample.

Read `TrainingLoop.run` top to bottom: each step takes its stage, batch split and LR from
`consumed_samples`, asks the runtime (runtime.py: eager or XLA) for the passes, clips and steps the
optimizer, reads the step's numbers with one host synchronisation, then evaluates, measures the noise
scale, records metrics, and applies the checkpoint policy (stage end, every N steps or seconds), the
adaptive ramp-up's decision and a SIGTERM's stop. An out-of-memory error the ranks agree on halves the
micro batch and retries the same global batch (only the eager runtime reports one).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from batchpilot import runstate
from batchpilot.config import Config
from batchpilot.config.identity import run_record
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_FILE, PREEMPTED_LOG_MARKER
from batchpilot.planning import LRSchedule, Plan, Stage
from batchpilot.planning.adaptive import AdaptiveRun, NoisePoint, StageDecision, decide
from batchpilot.planning.noise import noise_measurement, splits_step
from batchpilot.runstate import METRICS_OBJECT, MetricsLog, restore_metrics, write_decisions
from batchpilot.train.checkpoint import Checkpoint, Checkpointer
from batchpilot.train.evaluate import Validator
from batchpilot.train.noise import NoiseScaleEMA, noise_terms
from batchpilot.train.progress import ProgressWriter
from batchpilot.train.runtime import Passes, Runtime, Save, StepOutcome
from batchpilot.train.setup import data_order
from batchpilot.train.step import UnagreedOutOfMemory
from batchpilot.train.steps import append_audit, progress_line, stage_done_line, step_record

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainingLoop:
    """The state of one invocation's training, and the loop that advances it."""

    runtime: Runtime
    config: Config
    plan: Plan
    stages: list[Stage]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    checkpointer: Checkpointer
    metrics: MetricsLog | None
    lr: LRSchedule
    consumed: int
    step: int
    audit_dir: Path | None
    resumed_from: int | None = None
    """The checkpoint step this process started from (None: from scratch). In each save's meta it tells one
    process's saves from another's: the rehearsal checks a restarted trainer resumed from the last save of
    the one it replaced."""
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    noise: NoiseScaleEMA = field(default_factory=NoiseScaleEMA)
    micro_override: dict[int, int] = field(default_factory=dict)
    stop_requested: bool = False
    saved_step: int = -1
    last_log_s: float = 0.0
    last_save_s: float = field(default_factory=time.monotonic)
    preempted_file: Path | None = None
    validator: Validator | None = None
    adaptive: AdaptiveRun | None = None
    trace: list[NoisePoint] = field(default_factory=list)
    """An adaptive ramp-up's noise measurements so far (every step that measured one), in checkpoints."""
    decided: StageDecision | None = None
    """The decision that ended the open stage in this process, if it fired."""
    first_step_s: float | None = None
    """When this process's first step began (unix seconds; the goodput ledger's end of start-up)."""
    last_step_s: float | None = None
    """When its last finished step ended."""
    checkpoint_blocked_s: float = 0.0
    """Seconds its steps were blocked by checkpoints."""
    evaluation_s: float = 0.0
    """Seconds spent computing the validation loss."""
    progress: ProgressWriter | None = None
    """The main process's progress record (train/progress.py), for the next launch's nodes."""

    @property
    def is_main(self) -> bool:
        return self.runtime.place.is_main

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: processes (eager) or devices (XLA)."""
        return self.runtime.place.world_size

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> int:
        """Steps until the last stage's end sample; returns the exit code."""
        end = self.stages[-1].end_sample
        while self.consumed < end:
            stage = self.plan.stage_at(self.consumed)
            if self.first_step_s is None:
                self.first_step_s = time.time()
            try:
                outcome, micro, accumulation, started, lr = self._attempt(stage)
            except UnagreedOutOfMemory as error:
                self._end_after_unagreed_oom(stage, error.micro_batch_size)
            if outcome.out_of_memory:
                self._halve_micro_batch(stage, micro)
                continue
            # The step's one host synchronisation also agrees on a SIGTERM on any process and on the main
            # process's clock saying a time checkpoint is due (every process must enter the save together).
            stop, checkpoint_due = self._finish_step(stage, outcome, micro, accumulation, started, lr)
            self.last_step_s = time.time()
            code = self.after_step(stage, stop=stop, checkpoint_due=checkpoint_due)
            if code is not None:
                return code
            if (rest := self.config.train.min_step_s - (time.perf_counter() - started)) > 0:
                time.sleep(rest)  # train.min_step_s: paced, e.g. for a rehearsal
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
            micro_batch_size=self.runtime.place.rows_per_pass(micro),
            gradient_accumulation_steps=accumulation,
        )
        passes = Passes(
            micro_batch_size=micro,
            split=self.splits_for_noise(micro, accumulation),
            measure_noise=self.config.train.measure_noise_scale,
            measure_coherence=self.config.train.measure_coherence,
        )
        outcome = self.runtime.run_passes(self.model, batches, passes)
        if outcome.completed and self.audit_dir is not None:
            append_audit(
                self.audit_dir, stage, consumed=self.consumed, micro=micro, world_size=self.world_size,
                ranks=self.runtime.audit_ranks(),
            )  # fmt: skip
        return outcome, micro, accumulation, started, lr

    def _finish_step(
        self, stage: Stage, outcome: StepOutcome, micro: int, accumulation: int, started: float, lr: float
    ) -> tuple[bool, bool]:
        """Clips, steps the optimizer, reads the step's numbers and writes its metrics; returns the agreed
        (stop, checkpoint due)."""
        clip = self.config.train.grad_clip or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        values, (stop, checkpoint_due) = self.runtime.read_step(
            outcome, norm, flags=[self.stop_requested, self.time_checkpoint_due()]
        )
        step_time_s = time.perf_counter() - started
        before = self.consumed
        self.consumed += stage.global_batch_size
        self.step += 1
        val_loss = self.validation_loss(stage, before=before, micro=micro)
        measured = values.small_sq_norm is not None
        noise_scale = self.measure_noise(
            stage, small_batch=outcome.small_batch if measured else None,
            small_sq_norm=values.small_sq_norm or 0.0, big_sq_norm=values.grad_norm**2,
        )  # fmt: skip
        extra = self.runtime.step_extra() | (self.adaptive_record(stage) or {})
        self.record(
            stage, micro=micro, accumulation=accumulation, lr=lr, loss=values.loss, grad_norm=values.grad_norm,
            step_time_s=step_time_s, noise_scale=noise_scale, coherence=values.coherence, val_loss=val_loss,
            extra=extra,
        )  # fmt: skip
        return stop, checkpoint_due

    # -- out of memory (eager) ---------------------------------------------------------------------------

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
        self.runtime.after_out_of_memory()
        if self.is_main:
            runstate.write_micro_batch_overrides(self.checkpointer.storage, self.micro_override)
        self.log(
            f"out of memory at micro_batch_size={micro} (agreed by all ranks): retrying the same global batch "
            f"{stage.global_batch_size} with micro_batch_size={micro // 2}, "
            f"gradient_accumulation_steps={stage.global_batch_size // (micro // 2 * self.world_size)}",
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
            self.runtime.place.rank, micro, stage.name, self.runtime.noise_strategy, micro // 2,
            runstate.micro_batch_uri(self.checkpointer.storage),
        )  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    # -- shared ----------------------------------------------------------------------------------------

    def log(self, message: str) -> None:
        """Progress and summaries at INFO, on the main process only (the others would repeat it)."""
        if self.is_main:
            logger.info(message)

    def time_checkpoint_due(self) -> bool:
        """The main process: `train.checkpoint_every_s` has passed since the last checkpoint (or the start)."""
        every_s = self.config.train.checkpoint_every_s
        return bool(self.is_main and every_s and time.monotonic() - self.last_save_s >= every_s)

    def batch_split(self, stage: Stage) -> tuple[int, int]:
        """(micro batch, gradient accumulation steps) of a step of `stage` on this world."""
        micro = self.micro_override.get(stage.index, stage.micro_batch_size)
        per_pass = micro * self.world_size
        if stage.global_batch_size % per_pass:
            raise BatchpilotError(
                f"{stage.name}",
                f"global_batch_size {stage.global_batch_size} does not split over micro {micro} x world "
                f"{self.world_size}",
                "launch the stage with the plan's node count",
            )
        return micro, stage.global_batch_size // per_pass

    def splits_for_noise(self, micro: int, accumulation: int) -> bool:
        """Whether this step runs its one micro-batch as two halves to measure the noise scale
        (`planning.noise`: accumulation 1, every `train.measure_noise_every_steps` steps)."""
        train = self.config.train
        if not train.measure_noise_scale:
            return False
        measurement = noise_measurement(
            strategy=self.runtime.noise_strategy,
            world_size=self.world_size,
            micro_batch_size=micro,
            accumulation=accumulation,
            split_every_steps=train.measure_noise_every_steps,
            shard_degree=self.runtime.noise_shard_degree,
        )
        return splits_step(measurement, step=self.step + 1, split_every_steps=train.measure_noise_every_steps)

    def set_lr(self, stage: Stage) -> float:
        """The schedule's LR at this step, set on every parameter group."""
        lr = self.lr.at(consumed_samples=self.consumed, global_batch_size=stage.global_batch_size)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def after_step(self, stage: Stage, *, stop: bool, checkpoint_due: bool) -> int | None:
        """What follows a step, given the agreed (SIGTERM on any process, time checkpoint due): the adaptive
        decision that ends the launch, the checkpoint policy, the preemption stop; the exit code when this
        launch ends here, else None."""
        if self.ended_by_decision(stage):
            return 0
        self.checkpoint_after_step(stage)
        if stop and self.consumed < self.stages[-1].end_sample:
            return self.preempted()
        if checkpoint_due:
            self.save_for_time()
        return None

    def checkpoint_after_step(self, stage: Stage) -> None:
        """The checkpoint policy after a step: at the stage's end (then its summary), or every
        `train.checkpoint_every_steps`."""
        if self.consumed == stage.end_sample:
            self.save()
            self.log(stage_done_line(self.plan, stage, step=self.step))
        elif (
            self.config.train.checkpoint_every_steps
            and self.step % self.config.train.checkpoint_every_steps == 0
        ):
            self.save()

    def validation_loss(self, stage: Stage, *, before: int, micro: int) -> float | None:
        """The validation loss when the step that started at sample `before` ends with an evaluation (every
        process calls it: an evaluation is a collective), else None."""
        if self.validator is None or not self.validator.due(
            before, self.consumed, stage_end=self.consumed == stage.end_sample
        ):
            return None
        started = time.perf_counter()
        loss = self.validator.evaluate(self.model, micro_batch_size=micro, autocast=self.runtime.autocast)
        self.evaluation_s += time.perf_counter() - started
        return loss

    def measure_noise(
        self, stage: Stage, *, small_batch: int | None, small_sq_norm: float, big_sq_norm: float
    ) -> float | None:
        """The step's noise-scale terms into the running average (and an adaptive ramp-up's trace); returns
        the smoothed noise scale, None when the step did not measure (`planning/noise.py`)."""
        if small_batch is None or small_batch >= stage.global_batch_size:
            return None
        g2, s = noise_terms(
            small_sq_norm=small_sq_norm,
            big_sq_norm=big_sq_norm,
            b_small=small_batch,
            b_big=stage.global_batch_size,
        )
        if self.adaptive is not None:
            self.trace.append(NoisePoint(consumed_samples=self.consumed, g2=g2, s=s))
        return self.noise.add(g2=g2, s=s)

    def adaptive_record(self, stage: Stage) -> dict[str, Any] | None:
        """An adaptive ramp-up's entries of the step's metrics record: the rule's inputs and its outcome, so
        that the decisions can be replayed from metrics.jsonl."""
        if self.adaptive is None:
            return None
        last = self.trace[-1] if self.trace and self.trace[-1].consumed_samples == self.consumed else None
        return {
            "noise_g2": last.g2 if last else None,
            "noise_s": last.s if last else None,
            "adaptive_decision": self._adaptive_decision(stage),
        }

    def _adaptive_decision(self, stage: Stage) -> dict[str, Any] | None:
        """The adaptive rule after this step, on the open stage only: when it fires, the decision goes to
        `adaptive.json` (before the checkpoint that ends the stage: a replay from an earlier checkpoint
        reaches the same decision at the same sample)."""
        assert self.adaptive is not None
        if stage.is_final or stage.index != self.adaptive.open_stage():
            return None
        decision = decide(
            self.trace,
            rule=self.adaptive.rule,
            current=stage.global_batch_size,
            stage_start=stage.start_sample,
            accepted=self.adaptive.accepted,
            last_ramp_stage=stage.index >= self.adaptive.max_stages - 2,
        )
        if not decision.fired:
            return None
        assert decision.next_batch is not None
        self.decided = StageDecision(
            stage=stage.index, end_sample=self.consumed, next_batch=decision.next_batch, decision=decision
        )
        if self.is_main:
            write_decisions(self.config.train.checkpoint_uri, [*self.adaptive.decisions, self.decided])
        return self.decided.to_dict()

    def ended_by_decision(self, stage: Stage) -> bool:
        """After a step: when the adaptive rule ended the open stage here, its checkpoint is committed and
        this launch ends (the next stage is another launch, on its own node count)."""
        if self.decided is None:
            return False
        self.save(wait=True)
        self.log(f"{stage.name} ends (adaptive ramp-up): {self.decided.decision.describe()}")
        return True

    def resume_from(self, checkpoint: Checkpoint | None) -> None:
        """The loop's own state from the checkpoint it resumes from: its step counts as saved, the noise
        scale's running average and an adaptive ramp-up's trace continue from its meta.json."""
        if checkpoint is None:
            return
        meta = checkpoint.meta
        self.saved_step = checkpoint.step
        if "noise_scale_ema" in meta:
            self.noise.load_state_dict(meta["noise_scale_ema"])
        if self.adaptive is not None:
            self.trace = [
                NoisePoint(int(c), float(g2), float(s)) for c, g2, s in meta.get("adaptive_trace", [])
            ]

    def save_for_time(self) -> None:
        self.save(
            why=f" ({self.config.train.checkpoint_every_s:g} s since the last: train.checkpoint_every_s)"
        )

    def record(
        self,
        stage: Stage,
        *,
        micro: int,
        accumulation: int,
        lr: float,
        loss: float,
        grad_norm: float,
        step_time_s: float,
        noise_scale: float | None,
        coherence: float | None,
        val_loss: float | None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The step's metrics record, appended to metrics.jsonl (main process) and shown as progress."""
        record = (
            step_record(
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
                peak_memory_bytes=self.runtime.peak_memory_bytes(),
                noise_scale=noise_scale,
                coherence=coherence,
                val_loss=val_loss,
            )
            | {"time": time.time()}
            | (extra or {})
        )
        if self.metrics is not None:
            self.metrics.append(record)
        if self.progress is not None:
            self.progress.note(consumed=self.consumed, at_s=record["time"])
        now = time.monotonic()
        if (
            now - self.last_log_s >= 2.0
            or self.consumed == stage.end_sample
            or record["val_loss"] is not None
        ):
            self.last_log_s = now
            self.log(progress_line(stage, record, world=self.runtime.place.world_label))
        return record

    def save(self, why: str = "", *, wait: bool = False) -> None:
        """A checkpoint of this step (at most one in flight: the previous one is waited for first);
        `wait`: also wait until it is committed."""
        if self.saved_step == self.step:
            if wait:
                self.wait_for_checkpoint()
            return
        self.wait_for_checkpoint()  # a failed one ends the job here
        # metrics.jsonl as of this step, written before `latest` moves: the copy always covers the
        # checkpoint's steps (a resume truncates the steps after it), even when the process dies between.
        side = {METRICS_OBJECT: self.metrics.text().encode()} if self.metrics is not None else None
        extra = {
            "world_size": self.world_size,
            "parallelism": self.plan.parallelism,
            **(
                {"tensor_parallel_size": self.plan.tensor_parallel_size}
                if self.plan.tensor_parallel_size > 1
                else {}
            ),
            "stage": self.plan.stage_at(self.consumed - 1).index,
            "resumed_from_step": self.resumed_from,
            "data_order": data_order(self.config),
            "run": run_record(self.config),
            "noise_scale_ema": self.noise.state_dict(),
            **(
                {"adaptive_trace": [[p.consumed_samples, p.g2, p.s] for p in self.trace]}
                if self.adaptive is not None
                else {}
            ),
            **self.runtime.checkpoint_extra(),
        }
        started = time.perf_counter()
        # the launch's last step, or a save the launch ends with (a preemption's, an adaptive decision's)
        last = wait or self.consumed == self.stages[-1].end_sample
        save = Save(self.model, self.optimizer, self.step, self.consumed, extra, side, last=last)
        where, background = self.runtime.write_checkpoint(self.checkpointer, save)
        blocked_s = time.perf_counter() - started
        self.checkpoint_blocked_s += blocked_s
        how = "writing in the background" if background else "committed"
        if background and last:
            how += " (the launch's last: by the writer process only if one already runs)"
        self.log(
            f"checkpoint step {self.step} ({self.consumed:,} samples) -> {where}{why}: training blocked "
            f"{blocked_s:.2f} s, {how}"
        )
        self.saved_step = self.step
        self.last_save_s = time.monotonic()
        if wait:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Waits (bounded) for the checkpoint in flight, if any; raises its failure."""
        step = self.checkpointer.save_in_flight
        took_s = self.checkpointer.wait()
        if took_s is not None and step is not None:
            self.log(f"checkpoint step {step} committed ({took_s:.1f} s after it started)")

    def preempted(self) -> int:
        """SIGTERM (agreed by every process) at the end of a step: this step's checkpoint is committed, the
        marker file and log line tell the pod's command and the launcher, and the exit code says so."""
        self.optimizer.zero_grad(set_to_none=True)
        self.log(f"SIGTERM: stopping at the end of a step, {self.consumed:,} samples consumed")
        self.save(wait=True)  # a save in flight finishes first, then this step's is committed
        if self.preempted_file is not None:  # every process: each pod's command looks in its own folder
            self.preempted_file.write_text(f"{self.consumed}\n")  # for the pod's command: see PREEMPTED_FILE
        self.log(f"{PREEMPTED_LOG_MARKER}; run the same stage again to resume exactly here")
        return EXIT_PREEMPTED


def prepare_outputs(
    output_dir: Path, *, is_main: bool, checkpointer: Checkpointer, consumed: int, audit: bool
) -> tuple[MetricsLog | None, Path | None]:
    """The output folder: no previous run's preemption marker, metrics.jsonl (main process, restored up to
    `consumed`) and, with `audit`, the folder of the trained sample positions."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / PREEMPTED_FILE).unlink(missing_ok=True)  # a previous run's marker is not this run's
    metrics = MetricsLog(output_dir / "metrics.jsonl") if is_main else None
    if metrics is not None:
        restore_metrics(metrics, checkpointer.storage, consumed=consumed)
    audit_dir = output_dir / "audit" if audit else None
    if audit_dir is not None:
        audit_dir.mkdir(parents=True, exist_ok=True)
    return metrics, audit_dir


def run_loop(loop: TrainingLoop, *, closing: list[Callable[[], None]]) -> int:
    """Runs `loop` with SIGTERM asking it to stop at the end of a step; then, also when it failed, ends the
    checkpoint in flight and calls each of `closing` (loaders)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stop_requested", True))
    try:
        return loop.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        loop.checkpointer.close()
        for close in closing:
            close()
        sys.stdout.flush()
