"""The config read as the planning layer's narrow arguments: the batch schedule of whichever ramp-up form
is set, and where its batches can be placed (`Placement`: node range, model parallelism, loading factor,
TPU slices).

One home for both readers of the config: the checks (`plan.checks`) judge these, the planner
(`plan.stages`, `plan.planner`) plans with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from batchpilot.config import AdaptiveRampup, Config, MaxTextRampup, MegatronRampup, SeesawRampup
from batchpilot.errors import BatchpilotError
from batchpilot.planning import (
    BatchSchedule,
    constant_schedule,
    explicit_schedule,
    maxtext_rampup,
    megatron_rampup,
    seesaw_rampup,
)
from batchpilot.planning.adaptive import StageDecision, adaptive_schedule
from batchpilot.planning.nodes import Placement, whole_loading_factor
from batchpilot.planning.tpu import TpuSlices, is_tpu, tpu_slices


def batch_schedule(config: Config, decisions: Sequence[StageDecision] = ()) -> BatchSchedule:
    """The global batch size as a function of consumed samples, from whichever ramp-up form is set; for the
    adaptive form, as far as the run's `decisions` so far fix it (the open stage runs to the ramp's end)."""
    batch = config.batch
    target = batch.target_bound  # an `auto` target is resolved (make_run_document) before stages run
    if isinstance(batch.rampup, AdaptiveRampup):
        settings = batch.rampup.adaptive
        if settings.start >= target:
            raise BatchpilotError(
                "batch.rampup.adaptive.start",
                f"({settings.start}) must be smaller than the target global batch size ({target})",
                "lower the start or remove the ramp-up",
            )
        return adaptive_schedule(
            start=settings.start, target=target, ramp_samples=settings.samples, decisions=decisions
        )
    if isinstance(batch.rampup, MegatronRampup):
        return megatron_rampup(
            start=batch.rampup.start,
            increment=batch.rampup.increment,
            ramp_samples=batch.rampup.samples,
            target=target,
        )
    if isinstance(batch.rampup, SeesawRampup):
        seesaw = batch.rampup.seesaw
        return seesaw_rampup(start=seesaw.start, factor=seesaw.factor, cuts=seesaw.cuts, target=target)
    if isinstance(batch.rampup, MaxTextRampup):
        return maxtext_rampup(
            per_device_start=Fraction(str(batch.rampup.per_device_start)),
            per_device_increment=Fraction(str(batch.rampup.per_device_increment)),
            ramp_samples=batch.rampup.samples,
            target=target,
            num_devices=config.cluster.max_nodes * config.cluster.devices_per_node,
        )
    if batch.schedule is not None:
        return explicit_schedule(batch.schedule, target=target, seq_len=config.data.seq_len)
    return constant_schedule(target)


def tpu_plan_slices(config: Config) -> TpuSlices | None:
    """The slices the config's TPU type can form (None: not a TPU pool).

    Raises:
        BatchpilotError: an unknown TPU type or machine type, or devices_per_node that is not its chips
            per host.
    """
    cluster = config.cluster
    if not is_tpu(cluster.accelerator_type):
        return None
    assert cluster.accelerator_type is not None
    return tpu_slices(
        accelerator_type=cluster.accelerator_type,
        machine_type=cluster.machine_type,
        devices_per_node=cluster.devices_per_node,
    )


def loading_factor(config: Config) -> int:
    """The whole `data.expansion_factor_real_data` that node counts must be multiples of (1: no rule)."""
    return whole_loading_factor(Fraction(str(config.data.expansion_factor_real_data)))


def placement(config: Config) -> Placement:
    """Where the config's stages may run: the node range, the model-parallel sizes, the loading factor and,
    on a TPU type, the host counts that form a slice."""
    cluster, batch, train = config.cluster, config.batch, config.train
    slices = tpu_plan_slices(config)
    return Placement(
        devices_per_node=cluster.devices_per_node,
        max_nodes=cluster.max_nodes,
        min_nodes=cluster.min_nodes,
        pipeline_parallel_size=batch.pipeline_parallel_size,
        tensor_parallel_size=train.tensor_parallel_size,
        loading_factor=loading_factor(config),
        allowed_nodes=frozenset(slices.host_counts()) if slices else None,
    )


def allowed_node_counts(config: Config) -> list[int]:
    """Every node count a stage may run on: the node range, multiples of the loading factor, whole slices."""
    return placement(config).node_counts()


def largest_usable_micro_batch(config: Config) -> int | None:
    """The largest micro batch a plan of this config can train every stage with (each stage's batch splits
    into whole micro batches on some node count of the NeMo walk), or None when the stages are not known
    before the run (an `auto` target, an adaptive ramp-up) or the ramp is invalid (the plan says why).
    Explore measures no larger size: the plan could not use it."""
    from batchpilot.planning.nodes import MAX_DIVISOR_SEARCH, divisors, walk_nodes
    from batchpilot.planning.stages import sample_ranges

    if config.batch.global_batch_size == "auto" or isinstance(config.batch.rampup, AdaptiveRampup):
        return None
    try:
        ranges = sample_ranges(batch_schedule(config), total_samples=config.total_samples)
    except BatchpilotError:
        return None
    batches = sorted({batch for batch, _, _ in ranges})
    where = placement(config)
    common = math.gcd(*batches)
    if common > MAX_DIVISOR_SEARCH:
        return None
    for micro in reversed(divisors(common)):
        if None not in walk_nodes(batch_sizes=batches, micro_batch_size=micro, placement=where):
            return micro
    return None
