"""The trainer: runs stages of a plan from `latest`, checkpoints at the stage's end sample, and stops.

Read `train()` top to bottom: the runtime (eager: one process per device; XLA: one per host) and its place
in the job, the checks before anything is built (world size, resume point, sample order), the loader and
validation samples, the model on the meta device, the runtime's parallelism (which gives each rank's shard
memory and fills it: the seed's weights, `train.init_from`'s, or a resume's buffers), the optimizer, the resume, then `TrainingLoop.run()` steps until the last requested stage's
`end_sample`. Everything that varies over training (stage, batch, accumulation, LR, data order) is a
function of `consumed_samples`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from batchpilot import runstate
from batchpilot.config import Config, resolved_runtime
from batchpilot.exitcodes import PREEMPTED_FILE
from batchpilot.planning import Plan, Stage
from batchpilot.planning.adaptive import AdaptiveRun
from batchpilot.train.checkpoint import Checkpointer, restore_rng_state
from batchpilot.train.evaluate import Validator
from batchpilot.train.loop import TrainingLoop, prepare_outputs, run_loop
from batchpilot.train.progress import ProgressWriter
from batchpilot.train.runtime import Runtime
from batchpilot.train.setup import (
    check_resume_point,
    check_same_data_order,
    check_same_run,
    check_world,
    initial_model,
    make_optimizer,
    model_flops_per_token,
    train_loader,
)
from batchpilot.train.xla import XLA_RUNTIME

logger = logging.getLogger(__name__)


def start_runtime(config: Config, plan: Plan) -> Runtime:
    """The runtime `train.runtime` resolves to, started in this process (a process group under torchrun;
    SPMD and the hosts' group under XLA)."""
    if resolved_runtime(config) == XLA_RUNTIME:  # torch_xla, one process per host
        from batchpilot.train.xla_runtime import XlaRuntime

        return XlaRuntime.start(config, strategy=plan.parallelism, devices_per_node=plan.devices_per_node)
    from batchpilot.train.distributed import DistContext
    from batchpilot.train.eager import EagerRuntime

    return EagerRuntime(DistContext.from_env(), tensor_parallel_size=plan.tensor_parallel_size)


def train(
    *,
    config: Config,
    plan: Plan,
    stage: str,
    output_dir: Path,
    audit: bool = False,
    adaptive: AdaptiveRun | None = None,
) -> int:
    """Trains the selected stage(s) of `plan` in this process (one rank of a torchrun job, or one host of an
    XLA job); returns the exit code. With `adaptive` (an adaptive ramp-up) the open stage ends where the
    rule fires (`TrainingLoop._adaptive_decision`)."""
    stages = list(plan.select(stage, allow_all=True))
    runtime = start_runtime(config, plan)

    def say(message: str) -> None:
        if runtime.place.is_main:
            logger.info(message)

    # `all` trains every stage on whatever world divides them (tests, one-machine runs); a stage or a range
    # of stages (one launch) runs at its planned size.
    if stage != "all":
        check_world(
            stages, place=runtime.place, devices_per_node=plan.devices_per_node, fix=runtime.relaunch_fix
        )
    uri = config.train.checkpoint_uri
    checkpointer = Checkpointer(uri=uri, keep_last=config.train.keep_checkpoints)
    checkpoint = checkpointer.load()
    consumed = check_resume_point(stages=stages, checkpoint=checkpoint, uri=uri)
    check_same_data_order(config, checkpoint)
    run = check_same_run(config, checkpoint, uri=uri)
    if consumed == stages[-1].end_sample:
        say(
            f"{stages[-1].name} is already complete ({consumed:,} samples): nothing to do (the checkpoint is of {run})"
        )
        return 0
    if saves_before_its_end(stages, consumed=consumed, every_steps=config.train.checkpoint_every_steps):
        checkpointer.start_writer()  # its start runs beside the start-up below, not beside the first save's steps
    loader = train_loader(config, reader=runtime.place.reader)
    validator = Validator.from_config(
        config, runtime
    )  # a missing validation split fails here, before training
    model, initialize = initial_model(
        config, vocab_size=loader.vocab_size, checkpoint=checkpoint, local_rank=runtime.place.local_rank,
        say=say, say_every_rank=lambda message: logger.info(f"[{runtime.place.label}] {message}"),
    )  # fmt: skip
    how = runtime.parallelize(
        model, config, strategy=plan.parallelism, initialize=initialize, shard_nodes=plan.hsdp_shard_nodes
    )
    optimizer = make_optimizer(model, weight_decay=config.train.weight_decay)  # after sharding: on the shards
    runtime.prepare_optimizer(model, optimizer)
    if checkpoint is not None:
        runtime.restore(checkpoint, model, optimizer)
        restore_rng_state(checkpoint.rng)
        meta = checkpoint.meta
        say(
            f"resumed from step {checkpoint.step} ({consumed:,} samples) of {uri} (saved by "
            f"{meta.get('world_size', '?')} {runtime.place.counted} under {meta.get('parallelism', 'ddp')}"
            f"{', each block split ' + str(meta['tensor_parallel_size']) + ' ways' if 'tensor_parallel_size' in meta else ''}, runtime "
            f"{meta.get('runtime', 'eager')}); it continues {run}"
        )
    metrics, audit_dir = prepare_outputs(
        output_dir, is_main=runtime.place.is_main, checkpointer=checkpointer, consumed=consumed, audit=audit
    )
    loop = TrainingLoop(
        runtime=runtime,
        config=config,
        plan=plan,
        stages=stages,
        model=model,
        optimizer=optimizer,
        loader=loader,
        checkpointer=checkpointer,
        metrics=metrics,
        lr=plan.lr_schedule,
        consumed=consumed,
        step=checkpoint.step if checkpoint else 0,
        resumed_from=checkpoint.step if checkpoint else None,
        audit_dir=audit_dir,
        validator=validator if validator.enabled else None,
        flops_per_token=model_flops_per_token(config),
        peak_flops=runtime.peak_flops(config),
        micro_override=runstate.read_micro_batch_overrides(checkpointer.storage),
        preempted_file=output_dir / PREEMPTED_FILE,
        adaptive=adaptive,
        progress=(
            ProgressWriter(config.train.checkpoint_uri, stages=[s.index for s in stages])
            if runtime.place.is_main
            else None
        ),
    )
    loop.resume_from(checkpoint)
    say(f"training {', '.join(s.name for s in stages)} on {runtime.world_line(how)} from sample {consumed:,}")
    code = run_loop(loop, closing=[loader.close])
    if runtime.place.is_main and loop.first_step_s is not None and loop.last_step_s is not None:
        record_trainer_event(config, stages=stages, loop=loop)
    runtime.close()  # training ended on every process: its process groups go before the interpreter finalises
    return code


def saves_before_its_end(stages: list[Stage], *, consumed: int, every_steps: int) -> bool:
    """Whether a launch of `stages`, resumed at `consumed` samples, checkpoints before its last step: at the
    end of a stage before its last, or every `every_steps` optimizer steps (a multiple of it falls among any
    more than `every_steps` steps in a row). A save for `train.checkpoint_every_s` is not foreseen."""
    left = [stage for stage in stages if stage.end_sample > consumed]
    if len(left) > 1:
        return True
    steps = sum(
        (stage.end_sample - max(consumed, stage.start_sample)) // stage.global_batch_size for stage in left
    )
    return bool(every_steps) and steps > every_steps


def record_trainer_event(config: Config, *, stages: list[Stage], loop: TrainingLoop) -> None:
    """The goodput ledger's `trainer` event (`planning.goodput`): this process's start, its first and last
    steps, the seconds checkpoints blocked them, validation took and they waited for their data."""
    event = {
        "kind": "trainer", "stages": [stages[0].index, stages[-1].index], "started_s": process_started_s(),
        "first_step_s": loop.first_step_s, "last_step_s": loop.last_step_s,
        "checkpoint_blocked_s": loop.checkpoint_blocked_s, "evaluation_s": loop.evaluation_s,
        "data_wait_s": loop.loader.stats.wait_s,
    }  # fmt: skip
    runstate.record_event(config.train.checkpoint_uri, event)


def process_started_s() -> float:
    """When this process started (unix seconds), from the kernel's record: /proc/self/stat's start time in
    clock ticks after boot, plus the boot time in /proc/stat (Linux, where the trainers run)."""
    import os

    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22 of stat(5), counted after the command's closing parenthesis
    boot_s = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot_s + ticks / os.sysconf("SC_CLK_TCK")
