"""Every check of a config's plan that does not depend on the micro batch, each problem one error line.

`config check`, `plan` and `compile` run these first (`check_plan_config`), so a config with
`micro_batch_size: explore` is refused as early as one with an integer; the planner (`plan.stages`)
then assembles the plan from a checked config. Fixes are written in the user's form: a corrected
`rampup: [start, increment, samples]` or `schedule: "..."` (docs/planning.md).

Below them, the config against the files a plan is made with: a local shard set (`data_problems`) and
explore.json (`explore_problems`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from batchpilot.config import Config, MaxTextRampup, MegatronRampup, SeesawRampup, explores, resolved_runtime
from batchpilot.errors import BatchpilotError
from batchpilot.plan.init_from import init_from_problems
from batchpilot.plan.schedule import (
    allowed_node_counts,
    batch_schedule,
    loading_factor,
    placement,
    tpu_plan_slices,
)
from batchpilot.planning import MAX_STAGES, nearest_ramp, unschedulable_stages
from batchpilot.planning.batch import raise_problems, split_problems
from batchpilot.planning.capacity import capacity_problems
from batchpilot.planning.devices import accelerator_problem
from batchpilot.planning.gpudirect import gpudirect_problems
from batchpilot.planning.names import cluster_problems, launcher_problems
from batchpilot.planning.nodes import check_loading_factor, data_parallel_size, nearest_valid_batch_sizes
from batchpilot.planning.provisioning import provisioning_problems
from batchpilot.planning.rampup import format_schedule, parse_schedule
from batchpilot.planning.stages import sample_ranges
from batchpilot.planning.tpu import check_host_range, is_tpu, is_zone
from batchpilot.planning.units import format_count

SHOWN_STAGES = 8
"""How many unplaceable stages one error line names; it counts the rest (a ramp may have hundreds)."""


def check_plan_config(config: Config) -> None:
    """Refuses a config whose plan no micro batch could make: one line per problem (`plan_problems`)."""
    raise_problems(plan_problems(config))


def plan_problems(config: Config) -> list[BatchpilotError]:
    """Every problem of the config's plan that does not depend on the micro batch, one error each.

    Model parallelism, what the cluster would refuse (names, storage, provisioning, capacity, GPUDirect,
    TPU slices), the loading factor against the node range, the ramp-up's shape (or the schedule's
    entries), training shorter than the ramp, stages that no micro batch can place (micro batch 1 cannot:
    every micro batch is a multiple of it) and more than `MAX_STAGES` stages.
    """
    problems = parallelism_problems(config)
    problems += init_from_problems(config)
    problems += length_problems(config)
    problems += seesaw_problems(config)
    problems += cluster_config_problems(config)
    tpu_problems = check_tpu(config)
    if tpu_problems:
        return problems + tpu_problems  # no slice to judge the stages on
    cluster = config.cluster
    try:
        check_loading_factor(
            loading_factor=loading_factor(config), min_nodes=cluster.min_nodes, max_nodes=cluster.max_nodes
        )
    except BatchpilotError as error:
        return [*problems, error]  # no node count to judge the stages on
    return problems + ramp_problems(config)


def seesaw_problems(config: Config) -> list[BatchpilotError]:
    """`batch.rampup: {seesaw: ...}` sets the LR itself (lr / sqrt(batch / start), no decay beyond the cuts):
    a decay, an LR scaling or reference of the config's own, or an `auto` target would fight it."""
    if not isinstance(config.batch.rampup, SeesawRampup):
        return []
    train, problems = config.train, []
    if train.lr_decay != "constant":
        problems.append(BatchpilotError(
            "train.lr_decay",
            f"is {train.lr_decay}, but batch.rampup.seesaw replaces the step decay (the batch grows where it would "
            "cut the LR)",
            "set train.lr_decay: constant (a warmup stays), or use another ramp-up",
        ))  # fmt: skip
    if train.lr_scaling != "none" or train.lr_reference_batch is not None:
        problems.append(BatchpilotError(
            "train.lr_scaling",
            "batch.rampup.seesaw sets the LR per stage itself (lr at the start batch, divided by sqrt(factor) at "
            "each cut)",
            "remove train.lr_scaling and train.lr_reference_batch",
        ))  # fmt: skip
    if config.batch.global_batch_size == "auto":
        problems.append(BatchpilotError(
            "batch.global_batch_size",
            "is auto, but batch.rampup.seesaw fixes the target (start x factor^cuts)",
            "set global_batch_size to the seesaw's last batch",
        ))  # fmt: skip
    return problems


TOKEN_LIKE_BATCH_TOKENS = 2**27
TOKEN_LIKE_BATCH_SAMPLES = 2**17
"""A global batch of more samples than this (131,072) and more tokens than TOKEN_LIKE_BATCH_TOKENS per
optimizer step (134M; the largest published language-model batches are around 16-60M tokens, a few thousand
samples) is taken for a token count written where samples belong."""


def length_problems(config: Config) -> list[BatchpilotError]:
    """Lengths that contradict the run's: a warm-up longer than the run, a batch that looks like a
    token count (the batch keys are in samples of data.seq_len tokens)."""
    problems: list[BatchpilotError] = []
    train, total = config.train, config.total_samples
    length = "train.total_samples" if train.total_samples is not None else "train.total_tokens"
    if train.warmup_samples > total:
        problems.append(
            BatchpilotError(
                "train.warmup_samples",
                f"is {format_count(train.warmup_samples)}, longer than the run ({length}: "
                f"{format_count(total)} samples), so the LR never reaches its peak",
                f"set warmup_samples below {format_count(total)} (a few percent of the run is usual)",
            )
        )
    seq_len = config.data.seq_len
    for key in ("global_batch_size", "max_global_batch_size"):
        value = getattr(config.batch, key)
        if (
            isinstance(value, int)
            and value > TOKEN_LIKE_BATCH_SAMPLES
            and value * seq_len > TOKEN_LIKE_BATCH_TOKENS
        ):
            samples = value // seq_len
            problems.append(
                BatchpilotError(
                    f"batch.{key}",
                    f"is {value:,} samples of {seq_len} tokens, {value * seq_len:,} tokens "
                    "per optimizer step: it looks like a token count, but batch sizes count samples",
                    f"give it in samples: {value:,} tokens are {max(samples, 1):,} samples of {seq_len}",
                )
            )
    return problems


def cluster_config_problems(config: Config) -> list[BatchpilotError]:
    """gke: names the cluster would refuse, storage the trainer pods cannot reach, provisioning, capacity
    and GPUDirect settings that contradict each other or the machine."""
    cluster = config.cluster
    problems = cluster_problems(
        backend=cluster.backend, run_name=config.name, namespace=cluster.namespace,
        kueue_queue=cluster.kueue_queue, node_pool=cluster.node_pool, accelerator_type=cluster.accelerator_type,
        machine_type=cluster.machine_type, devices_per_node=cluster.devices_per_node,
        min_nodes=cluster.min_nodes, max_nodes=cluster.max_nodes, data_uri=config.data.uri,
        checkpoint_uri=config.train.checkpoint_uri, priority_class=cluster.priority_class,
    )  # fmt: skip
    problems += launcher_problems(
        backend=cluster.backend, launcher=cluster.launcher, training_runtime=cluster.training_runtime,
        accelerator_type=cluster.accelerator_type,
    )  # fmt: skip
    problems += provisioning_problems(
        provisioning=cluster.provisioning, backend=cluster.backend, launcher=cluster.launcher,
        accelerator_type=cluster.accelerator_type, pool_mode=cluster.pool_mode, fewer_nodes=cluster.fewer_nodes,
    )  # fmt: skip
    problems += capacity_problems(
        backend=cluster.backend, pool_mode=cluster.pool_mode, accelerator_type=cluster.accelerator_type,
        fewer_nodes=cluster.fewer_nodes, local_capacity_nodes=cluster.local_capacity_nodes,
    )  # fmt: skip
    unknown = accelerator_problem(
        cluster.accelerator_type, device_memory_bytes=cluster.device_memory_bytes,
        is_tpu_type=is_tpu(cluster.accelerator_type),
    )  # fmt: skip
    if unknown is not None:
        problems.append(BatchpilotError("cluster.accelerator_type", *unknown))
    problems += gpudirect_problems(
        backend=cluster.backend, gpudirect=cluster.gpudirect, machine_type=cluster.machine_type,
        gpudirect_networks=cluster.gpudirect_networks,
    )  # fmt: skip
    if cluster.backend == "gke" and cluster.provisioning == "flex-start" and explores(config):
        # google.container.v1 NodePool.QueuedProvisioning: such a pool's nodes "can be only obtained through
        # queuing via the ProvisioningRequest API"; the explore task is a pod pinned to the pool with none.
        what = (
            "a micro batch to explore" if config.batch.micro_batch_size == "explore" else "explore.study on"
        )
        problems.append(
            BatchpilotError(
                "cluster.provisioning",
                f"is flex-start, whose pool's nodes come only through a ProvisioningRequest, but the config has "
                f"{what}, which the pipeline's explore task measures on a node of that pool and would wait for "
                "for ever",
                "set an integer batch.micro_batch_size and explore.study: false (explore once on an on-demand or "
                "spot pool of the same machine type: `batchpilot explore`, then `batchpilot plan --explore`)",
            )
        )
    return problems


def ramp_problems(config: Config) -> list[BatchpilotError]:
    """The ramp-up's shape or the schedule's entries, stages no micro batch can place, too many stages."""
    try:
        ranges = sample_ranges(batch_schedule(config), total_samples=config.total_samples)
    except BatchpilotError as error:
        return [_with_corrected_ramp(config, line) for line in split_problems(error)]
    problems: list[BatchpilotError] = []
    batches = [batch for batch, _, _ in ranges]
    unplaceable = unschedulable_stages(batch_sizes=batches, placement=placement(config))
    if unplaceable:
        problems.append(_unplaceable_stages(config, batches, unplaceable))
    if len(ranges) > MAX_STAGES:
        problems.append(
            BatchpilotError(
                _ramp_field(config),
                f"makes {len(ranges)} stages, more than {MAX_STAGES} (each stage resizes the node pool, "
                "launches the job and writes a checkpoint)",
                _corrected(config, unplaceable=set()) or "use fewer, larger steps",
            )
        )
    return problems


def parallelism_problems(config: Config) -> list[BatchpilotError]:
    """Model parallelism the trainer does not implement (it would be planned, then ignored), and tensor
    parallelism where the trainer cannot apply it (`tensor_parallel_problems`)."""
    value = config.batch.pipeline_parallel_size
    problems = tensor_parallel_problems(config)
    if value > 1:
        problems.insert(
            0,
            BatchpilotError(
                "batch.pipeline_parallel_size",
                f"is {value}, but the trainer implements data and tensor parallelism (train.parallelism, "
                "train.tensor_parallel_size), not pipeline parallelism",
                "set batch.pipeline_parallel_size: 1 and shard the model with train.parallelism: fsdp or hsdp",
            ),
        )
    return problems


def tensor_parallel_problems(config: Config) -> list[BatchpilotError]:
    """`train.tensor_parallel_size` > 1: its group lies within one node (it must divide devices_per_node),
    FSDP2 shards over the data-parallel dimension of the 2-D mesh (fsdp or hsdp, not ddp), the eager runtime
    applies it (not SPMD under xla), a sequence splits evenly over the group, and no loading host forwards
    samples (not implemented with tensor parallelism). What the
    model's shape must allow is checked with the shape (`planning.memory.tensor_parallel_problem`)."""
    train, cluster = config.train, config.cluster
    tp = train.tensor_parallel_size
    if tp == 1:
        return []
    problems: list[BatchpilotError] = []
    if cluster.devices_per_node % tp:
        problems.append(
            BatchpilotError(
                "train.tensor_parallel_size",
                f"is {tp}, which does not divide cluster.devices_per_node ({cluster.devices_per_node}): a "
                "tensor-parallel group is devices of one node",
                f"use a divisor of {cluster.devices_per_node} (1, 2, 4 or 8)",
            )
        )
    if train.parallelism == "ddp":
        problems.append(
            BatchpilotError(
                "train.parallelism",
                f"is ddp, but with train.tensor_parallel_size {tp} the parameters are tensor-parallel DTensors, "
                "which FSDP2 shards over the data-parallel dimension (DistributedDataParallel does not take them)",
                "set train.parallelism: fsdp, hsdp or auto",
            )
        )
    if resolved_runtime(config) == "xla":
        problems.append(
            BatchpilotError(
                "train.tensor_parallel_size",
                f"is {tp}, but the xla runtime shards every parameter over the whole slice with SPMD "
                "(its own layout): tensor parallelism is the eager runtime's",
                "set train.tensor_parallel_size: 1 on a TPU slice",
            )
        )
    if config.data.seq_len % tp:
        problems.append(
            BatchpilotError(
                "data.seq_len",
                f"is {config.data.seq_len}, which train.tensor_parallel_size {tp} does not divide: sequence "
                "parallelism gives each device of the group an equal part of every sequence",
                f"use a multiple of {tp}",
            )
        )
    if config.data.expansion_factor_real_data > 1:
        problems.append(
            BatchpilotError(
                "data.expansion_factor_real_data",
                f"is {config.data.expansion_factor_real_data}: loading hosts that forward samples to other "
                f"nodes are not implemented with train.tensor_parallel_size {tp}",
                "set data.expansion_factor_real_data: 1 (every data-parallel rank reads its own samples)",
            )
        )
    return problems


def check_tpu(config: Config) -> list[BatchpilotError]:
    """The TPU rules, one error each: a known type and machine type, devices_per_node = its chips per host,
    max_nodes a whole slice, runtime xla on a TPU pool, and what the xla runtime does not implement."""
    problems: list[BatchpilotError] = []
    cluster, train = config.cluster, config.train
    try:
        slices = tpu_plan_slices(config)
    except BatchpilotError as error:
        return [error]
    if slices is not None:
        try:
            check_host_range(slices, min_nodes=cluster.min_nodes, max_nodes=cluster.max_nodes)
        except BatchpilotError as error:
            problems.append(error)
        zoned = cluster.tpu_zone or is_zone(cluster.location)
        if cluster.backend == "gke" and cluster.pool_mode == "resize" and cluster.location and not zoned:
            problems.append(
                BatchpilotError(
                    "cluster.tpu_zone",
                    f"is not set and cluster.location {cluster.location!r} is a region, but batchpilot creates "
                    "each stage's slice node pool in one zone",
                    f"set cluster.tpu_zone to a zone of {cluster.location} that offers {cluster.accelerator_type}",
                )
            )
        if train.runtime == "eager":
            problems.append(
                BatchpilotError(
                    "train.runtime",
                    f"is eager, but {cluster.accelerator_type} nodes have TPUs, which PyTorch reaches only "
                    "through torch_xla",
                    "set train.runtime: xla (or auto)",
                )
            )
    if train.hsdp_shard_nodes is not None and (
        train.parallelism in ("ddp", "fsdp") or resolved_runtime(config) == "xla"
    ):
        problems.append(
            BatchpilotError(
                "train.hsdp_shard_nodes",
                f"is {train.hsdp_shard_nodes}, but the trainers run "
                + (
                    f"{train.parallelism}, which has no shard groups"
                    if train.parallelism != "auto"
                    else "runtime xla"
                ),
                "remove it, or set train.parallelism: hsdp (or auto)",
            )
        )
    if resolved_runtime(config) == "xla":
        if train.parallelism in ("ddp", "hsdp"):
            problems.append(
                BatchpilotError(
                    "train.parallelism",
                    f"{train.parallelism} is not implemented for runtime xla, which shards parameters, "
                    "gradients and optimizer state over every device of the slice (SPMD)",
                    "set train.parallelism: fsdp (or auto)",
                )
            )
        problems += _explore_on_xla(config)
        if config.data.expansion_factor_real_data != 1:
            problems.append(
                BatchpilotError(
                    "data.expansion_factor_real_data",
                    f"is {config.data.expansion_factor_real_data}, but loading hosts are not implemented "
                    "for runtime xla (every host reads its own samples)",
                    "set data.expansion_factor_real_data: 1",
                )
            )
    return problems


def _explore_on_xla(config: Config) -> list[BatchpilotError]:
    """Explore's probes and study run eager PyTorch: under runtime xla they would measure another device
    than the trainers', so what needs them is refused (docs/cluster.md, TPU)."""
    why = "explore's probes and noise-scale study do not run on XLA (TPU) yet"
    problems = []
    if config.batch.micro_batch_size == "explore":
        problems.append(
            BatchpilotError(
                "batch.micro_batch_size", f"is 'explore', but {why}", "set an integer micro batch"
            )
        )
    if config.batch.global_batch_size == "auto":
        problems.append(
            BatchpilotError("batch.global_batch_size", f"is 'auto', but {why}", "set an integer target batch")
        )
    if config.explore.study:
        problems.append(
            BatchpilotError(
                "explore.study",
                f"is true, but {why}",
                "set explore.study: false (the trainers still measure the noise scale every step)",
            )
        )
    return problems


# --- unplaceable stages, and the fix in the user's form (a corrected ramp-up or schedule) -------------


def _placeable(config: Config, batch_sizes: Sequence[int]) -> bool:
    return not unschedulable_stages(batch_sizes=batch_sizes, placement=placement(config))


def _nearest_placeable(config: Config, batch: int) -> tuple[int | None, int | None]:
    return nearest_valid_batch_sizes(
        batch,
        node_range=allowed_node_counts(config),
        micro_batch_size=1,
        devices_per_node=config.cluster.devices_per_node,
        pp=config.batch.pipeline_parallel_size,
        tp=config.train.tensor_parallel_size,
    )


def _ramp_field(config: Config) -> str:
    return "batch.schedule" if config.batch.schedule is not None else "batch.rampup"


def _unplaceable_stages(config: Config, batches: list[int], unplaceable: list[int]) -> BatchpilotError:
    cluster = config.cluster
    factor = loading_factor(config)
    where = f"{cluster.min_nodes}-{cluster.max_nodes} nodes of {cluster.devices_per_node} device(s)"
    where += f" (node counts divisible by data.expansion_factor_real_data {factor})" if factor > 1 else ""
    if unplaceable[-1] == len(batches) - 1:  # the target itself: fix it first, the ramp follows from it
        nearby = " or ".join(str(b) for b in _nearest_placeable(config, batches[-1]) if b is not None)
        return BatchpilotError(
            "batch.global_batch_size",
            f"{batches[-1]} splits over no node count at any micro batch on {where} (even "
            "micro_batch_size 1 leaves a remainder)",
            f"use {nearby}" if nearby else "change cluster.devices_per_node or the node range",
        )
    named = ", ".join(f"stage {i} ({batches[i]})" for i in unplaceable[:SHOWN_STAGES])
    more = len(unplaceable) - SHOWN_STAGES
    return BatchpilotError(
        _ramp_field(config),
        f"{len(unplaceable)} of its {len(batches)} stages fit no micro batch on {where}, not even "
        f"micro_batch_size 1: {named}" + (f" and {more} more" if more > 0 else ""),
        _corrected(config, unplaceable={batches[i] for i in unplaceable})
        or "use global batch sizes that split over whole nodes",
    )


def _with_corrected_ramp(config: Config, error: BatchpilotError) -> BatchpilotError:
    """A ramp-up shape error (start not below the target, increment not dividing the span, a per-device
    value that is no whole number of samples) with the nearest valid ramp as its fix."""
    if not error.field.startswith("batch.rampup") or error.field == "batch.rampup.samples":
        return error
    corrected = _corrected(config, unplaceable=set())
    if corrected is None:
        return error
    return BatchpilotError(error.field, error.problem, f"{corrected}, or remove the ramp-up")


def _corrected(config: Config, *, unplaceable: set[int]) -> str | None:
    """The config's ramp-up in its own form, corrected to pass every micro-batch-independent check."""
    if config.batch.schedule is not None:
        return _corrected_schedule(config, unplaceable=unplaceable)
    return _corrected_rampup(config)


def _smallest_unit(config: Config) -> int:
    """The smallest global batch that one pass of micro batch 1 takes on an allowed node count."""
    sizes = [
        data_parallel_size(
            num_nodes=n,
            devices_per_node=config.cluster.devices_per_node,
            pipeline_parallel_size=config.batch.pipeline_parallel_size,
            tensor_parallel_size=config.train.tensor_parallel_size,
        )
        for n in allowed_node_counts(config)
    ]
    return min((size for size in sizes if size is not None), default=1)


def _corrected_rampup(config: Config) -> str | None:
    rampup, target = config.batch.rampup, config.batch.target_bound
    unit = _smallest_unit(config)
    step = unit if target % unit == 0 else 1
    devices = 0  # the MaxText form's device count; 0 for the NeMo/Megatron form
    if isinstance(rampup, MaxTextRampup):
        devices = config.cluster.max_nodes * config.cluster.devices_per_node
        # per-device values must be exact decimals: an increment that is a multiple of the devices' odd part
        step = math.lcm(step, _without_2_and_5(devices))
        start = Fraction(str(rampup.per_device_start)) * devices
        increment = Fraction(str(rampup.per_device_increment)) * devices
    elif isinstance(rampup, MegatronRampup):
        start, increment = Fraction(rampup.start), Fraction(rampup.increment)
    else:
        return None

    def accept(start: int, increment: int) -> bool:
        if devices and not (_decimal(Fraction(start, devices)) and _decimal(Fraction(increment, devices))):
            return False
        return _placeable(config, range(start, target + 1, increment))

    found = nearest_ramp(
        start=start, increment=increment, target=target, max_levels=MAX_STAGES, step=step, accept=accept
    )
    if found is None:
        return None
    samples = _count_text(rampup.samples)
    if devices:
        first, each = (_decimal(Fraction(value, devices)) for value in found)
        return f"rampup: {{per_device_start: {first}, per_device_increment: {each}, samples: {samples}}}"
    return f"rampup: [{found[0]}, {found[1]}, {samples}]"


def _corrected_schedule(config: Config, *, unplaceable: set[int]) -> str | None:
    """The schedule with each unplaceable batch replaced by the nearest placeable one (repeats dropped),
    thinned to `MAX_STAGES` entries when longer."""
    assert config.batch.schedule is not None
    fixed: list[tuple[str, int]] = []
    for raw, _, batch in parse_schedule(config.batch.schedule, seq_len=config.data.seq_len):
        if batch in unplaceable:
            nearby = [b for b in _nearest_placeable(config, batch) if b is not None]
            batch = min(nearby, key=lambda b: (abs(b - batch), -b), default=batch)
        if not fixed or batch > fixed[-1][1]:
            fixed.append((raw, batch))
    if len(fixed) > MAX_STAGES:
        keep = sorted({round(i * (len(fixed) - 1) / (MAX_STAGES - 1)) for i in range(MAX_STAGES)})
        fixed = [fixed[i] for i in keep]
    if fixed[-1][1] != config.batch.target_bound or not _placeable(config, [b for _, b in fixed]):
        return None
    return f'schedule: "{format_schedule(fixed)}"'


def _without_2_and_5(value: int) -> int:
    for prime in (2, 5):
        while value % prime == 0:
            value //= prime
    return value


def _decimal(value: Fraction) -> str | None:
    """`value` as an exact decimal (0.75), or None when it has none (1/3)."""
    if _without_2_and_5(value.denominator) != 1:
        return None
    text = f"{float(value):.12f}".rstrip("0").rstrip(".")
    return text if Fraction(text) == value else None


def _count_text(value: int) -> str:
    """A sample count as a config writes it: `10M`, else the plain integer."""
    text = format_count(value)
    return str(value) if "," in text else text


# --- the config against its inputs ------------------------------------------------------------------


# --- train.init_from: a Hugging Face Llama checkpoint against the config ---------------------------------
