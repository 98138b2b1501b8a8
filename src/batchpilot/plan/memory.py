"""Per-device memory of a plan's stages (the memory model of `planning.memory` read with the config's
settings and explore's measured activations): the strategy `train.parallelism: auto` resolves to, explore's
probe strategy, and the check of a launch moved to fewer nodes or of a stage an adaptive ramp-up may decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchpilot.config import Config, resolved_runtime
from batchpilot.errors import BatchpilotError
from batchpilot.plan.stages import build_plan
from batchpilot.planning import Plan
from batchpilot.planning.activations import activation_bytes_per_sample
from batchpilot.planning.devices import device_memory_bytes
from batchpilot.planning.memory import (
    RESERVE_FIXED_BYTES,
    MemoryEstimate,
    MemoryPlan,
    StageMemory,
    estimate_memory,
    plan_memory,
    tensor_parallel_problem,
)
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.stages import Stage


def memory_plan(
    config: Config, plan: Plan, *, shape: ModelShape, explore: dict[str, Any] | None
) -> MemoryPlan:
    """Per-device memory of every stage and the strategy (`train.parallelism`, auto resolved); refuses a
    strategy that does not fit the device. Local runs check against explore's CPU memory budget."""
    cluster = config.cluster
    device_memory = planned_device_memory(config)
    problem = tensor_parallel_problem(
        shape, tensor_parallel_size=config.train.tensor_parallel_size, factory=config.model.factory
    )
    if problem is not None:
        raise problem
    return plan_memory(
        # SPMD under xla shards over every device of the slice: the memory of fsdp.
        requested="fsdp" if resolved_runtime(config) == "xla" else config.train.parallelism,
        shape=shape,
        stages=plan.stages,
        devices_per_node=cluster.devices_per_node,
        seq_len=config.data.seq_len,
        mixed_precision=mixed_precision(config),
        activation_checkpointing=config.train.activation_checkpointing,
        # per device as the stages run (explore's probes split the blocks as they do: the fingerprint says so)
        activation_bytes_per_sample=explored_activation_bytes(config, explore),
        device_memory_bytes=device_memory,
        reserve_fixed_bytes=_reserve_fixed_bytes(config),
        shard_nodes=config.train.hsdp_shard_nodes,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )


def planned_device_memory(config: Config) -> int | None:
    """The memory a device's estimate is checked against: `cluster.device_memory_bytes`, else explore's CPU
    budget for a local run, else the accelerator's in the device table (None: unknown)."""
    cluster = config.cluster
    local = cluster.backend == "local"
    return cluster.device_memory_bytes or (
        config.explore.memory_budget_bytes if local else device_memory_bytes(cluster.accelerator_type)
    )


def mixed_precision(config: Config) -> bool:
    """Whether the trainers will compute in bf16: `train.precision: bf16`, or `auto` on a GPU pool (local
    runs are planned as CPU runs)."""
    precision = config.train.precision
    on_accelerator = config.cluster.backend == "gke" and config.cluster.accelerator_type is not None
    return precision == "bf16" or (precision == "auto" and on_accelerator)


def _reserve_fixed_bytes(config: Config) -> int:
    """The runtime's fixed reserve per device: none on the CPU (local runs, or no accelerator)."""
    cluster = config.cluster
    return 0 if cluster.backend == "local" or cluster.accelerator_type is None else RESERVE_FIXED_BYTES


def _estimate_like(
    config: Config,
    planned: MemoryEstimate,
    *,
    shape: ModelShape,
    strategy: Any,
    world_size: int,
    micro_batch_size: int,
    shard_nodes: int = 1,
) -> MemoryEstimate:
    """A stage's per-device memory on `world_size` devices under `strategy` (hsdp in groups of `shard_nodes`),
    with the activations of the `planned` estimate (measured ones per sample; the micro batch is the plan's)."""
    measured = planned.activations_source == "explore"
    return estimate_memory(
        shape=shape, strategy=strategy, world_size=world_size, devices_per_node=config.cluster.devices_per_node,
        micro_batch_size=micro_batch_size, seq_len=config.data.seq_len, mixed_precision=mixed_precision(config),
        activation_checkpointing=config.train.activation_checkpointing,
        activation_bytes_per_sample=planned.activations / micro_batch_size if measured else None,
        reserve_fixed_bytes=_reserve_fixed_bytes(config), shard_nodes=shard_nodes,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )  # fmt: skip


def stage_estimate(
    config: Config,
    memory: MemoryPlan,
    *,
    shape: ModelShape,
    stage: Stage,
    micro_batch_size: int,
    explore: dict[str, Any] | None,
) -> MemoryEstimate:
    """A stage's per-device memory at another micro batch under the plan's strategy (and hsdp groups), with
    explore's measured activations per sample where it measured them."""
    return estimate_memory(
        shape=shape, strategy=memory.strategy, world_size=stage.world_size,
        devices_per_node=config.cluster.devices_per_node, micro_batch_size=micro_batch_size,
        seq_len=config.data.seq_len, mixed_precision=mixed_precision(config),
        activation_checkpointing=config.train.activation_checkpointing,
        activation_bytes_per_sample=explored_activation_bytes(config, explore),
        reserve_fixed_bytes=_reserve_fixed_bytes(config), shard_nodes=memory.shard_nodes,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )  # fmt: skip


def explored_activation_bytes(config: Config, explore: dict[str, Any] | None) -> float | None:
    """Activation memory per sample from explore's fitting probes of the trained setting (the slope of the
    per-device peak over the micro batch), or None when explore did not measure two sizes of it."""
    if explore is None:
        return None
    points = [
        (int(p["micro_batch_size"]), int(p["peak_memory_bytes"]))
        for p in explore.get("probes", [])
        if p.get("fits")
        and p.get("peak_memory_bytes")
        and bool(p.get("activation_checkpointing")) == config.train.activation_checkpointing
        and not p.get("compile")
    ]
    return activation_bytes_per_sample(points)


def explore_node_problem(config: Config, shape: ModelShape) -> BatchpilotError | None:
    """Explore's probes run on one node (`devices_per_node` processes, sharded over them at most): a model
    that one node cannot hold even at micro batch 1 with activation checkpointing, as fsdp over the node,
    leaves explore nothing to measure, and each probe would fail on the accelerator. None when it fits or
    the device's memory is unknown."""
    cluster = config.cluster
    device_memory = planned_device_memory(config)
    if device_memory is None:
        return None
    devices = cluster.devices_per_node
    estimate = estimate_memory(
        shape=shape, strategy="fsdp" if devices > 1 else "ddp", world_size=devices, devices_per_node=devices,
        micro_batch_size=1, seq_len=config.data.seq_len, mixed_precision=mixed_precision(config),
        activation_checkpointing=True, reserve_fixed_bytes=_reserve_fixed_bytes(config),
        tensor_parallel_size=config.train.tensor_parallel_size,
    )  # fmt: skip
    if estimate.total <= device_memory:
        return None
    return BatchpilotError(
        "batch.micro_batch_size",
        f"is explore, but explore probes on one node of {devices} device(s), where even micro batch 1 with "
        f"activation checkpointing needs {estimate.describe()} per device, more than the device's "
        f"{device_memory / 2**30:.1f} GiB",
        "give batch.micro_batch_size (the plan then spreads the model over the nodes its memory check picks)",
    )


def probe_parallelism(config: Config, shape: ModelShape) -> str:
    """The strategy explore's probes run under, so that they measure what the stages will run: the
    config's, or for `auto` the one the memory model picks at micro batch 1 (fsdp when even that does
    not fit: explore then finds out what does)."""
    if config.train.parallelism != "auto":
        return config.train.parallelism
    plan = build_plan(config, micro_batch_size=1)
    try:
        return memory_plan(config, plan, shape=shape, explore=None).strategy
    except BatchpilotError:
        return "fsdp"


def memory_on_fewer_nodes(
    config: Config, memory: MemoryPlan, *, stages: Sequence[Stage], shape: ModelShape
) -> tuple[StageMemory, ...]:
    """The per-device memory of `stages` (a launch moved to fewer nodes) under the plan's strategy, with
    the activations the plan estimated (the micro batch is unchanged; only the shard degree moves).

    Raises:
        BatchpilotError: a stage that no longer fits the device (fsdp's share grows as the world shrinks).
    """
    planned = {item.stage: item.estimate for item in memory.stages}
    checked = []
    for stage in stages:
        estimate = _estimate_like(
            config, planned[stage.name], shape=shape, strategy=memory.strategy,
            world_size=stage.world_size, micro_batch_size=stage.micro_batch_size, shard_nodes=memory.shard_nodes,
        )  # fmt: skip
        limit = memory.device_memory_bytes
        if limit is not None and estimate.total > limit:
            raise BatchpilotError(
                "cluster.fewer_nodes",
                f"{stage.name} on {stage.num_nodes} node(s) needs {estimate.describe()} per device under "
                f"{memory.strategy} (shard degree {estimate.shard_degree}), more than the device's "
                f"{limit / 2**30:.1f} GiB",
                "wait for the planned nodes (raise cluster.capacity_timeout_s) or set cluster.fewer_nodes: fail",
            )
        checked.append(StageMemory(stage.name, estimate))
    return tuple(checked)


def does_not_fit(
    config: Config,
    memory: MemoryPlan | None,
    shape: ModelShape | None,
    *,
    num_nodes: int,
    micro_batch_size: int,
) -> str | None:
    """Why a stage on `num_nodes` would not fit the device under the plan's strategy (None: it fits, or
    memory is unknown), with the activations the plan estimated for its first stage."""
    if memory is None or shape is None or memory.device_memory_bytes is None or not memory.stages:
        return None
    estimate = _estimate_like(
        config, memory.stages[0].estimate, shape=shape, strategy=memory.strategy,
        world_size=num_nodes * config.cluster.devices_per_node, micro_batch_size=micro_batch_size,
    )  # fmt: skip
    if estimate.total <= memory.device_memory_bytes:
        return None
    return (
        f"on {num_nodes} node(s) it needs {estimate.describe()} per device under {memory.strategy} (shard "
        f"degree {estimate.shard_degree}), more than the device's {memory.device_memory_bytes / 2**30:.1f} GiB"
    )
