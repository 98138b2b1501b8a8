"""A launch on the nodes it got: when a resize reaches only some of a launch's planned nodes
(`cluster.fewer_nodes: allow`), the launch trains on the largest node count at most the ready ones that
every one of its stages' global batches splits over.

Only data parallelism changes: each stage keeps its global batch, sample range, steps and learning rate,
so the sample order (a function of consumed samples) and the LR schedule are exactly the planned ones, and
the accumulation grows to make up the devices that are missing. A later launch asks for its own planned
count again. The record of what happened (`LaunchCapacity`) is kept beside the checkpoints, so that the
launch's train task, a retry and the report all see the same node count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import gradient_accumulation_steps, num_loading_hosts
from batchpilot.planning.launches import launches
from batchpilot.planning.nodes import Placement, data_parallel_size
from batchpilot.planning.stages import Plan, Stage
from batchpilot.planning.tpu import is_tpu


@dataclass(frozen=True)
class LaunchCapacity:
    """What a launch's resize got, when it was fewer nodes than planned.

    Attributes:
        launch: the launch's name (`stage-4`, `final`, `stages-0-3`).
        first_stage, last_stage: the launch's stages (what the record applies to, with `planned_nodes`).
        planned_nodes: the plan's node count for the launch.
        ready_nodes: the nodes that were ready when the wait for capacity ended.
        nodes: what the launch trains on (at most `ready_nodes`, accepted by every stage's batch).
        waited_s: how long the resize waited for the planned count.
        reason: what the cloud said (a stockout, a quota), or the shortfall line.
    """

    launch: str
    first_stage: int
    last_stage: int
    planned_nodes: int
    ready_nodes: int
    nodes: int
    waited_s: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchCapacity:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})

    def describe(self) -> str:
        """`final: 1 of 2 planned node(s) (1 ready after 600s: ...)`."""
        return (
            f"{self.launch}: {self.nodes} of {self.planned_nodes} planned node(s) ({self.ready_nodes} ready "
            f"after {self.waited_s:.0f}s: {self.reason})"
        )


def fewer_nodes(
    stages: Sequence[Stage], *, available: int, placement: Placement, base_micro_batch: int | None = None
) -> int | None:
    """The largest node count in [min_nodes, available] that every stage's global batch splits over in
    whole micro batches (the node scheduling rule of `Placement.fits`), each stage's own or, where a stage
    took a larger one of its own (`faster_micro_batches`), the plan's `base_micro_batch`; None when there
    is none."""
    for num_nodes in range(available, placement.min_nodes - 1, -1):
        if num_nodes > 0 and all(
            any(
                placement.fits(
                    global_batch_size=stage.global_batch_size, num_nodes=num_nodes, micro_batch_size=micro
                )
                for micro in _micro_batches(stage, base_micro_batch)
            )
            for stage in stages
        ):
            return num_nodes
    return None


def _micro_batches(stage: Stage, base_micro_batch: int | None) -> list[int]:
    """The micro batches a stage may train at on other nodes: its own first, then the plan's (which the
    node walk placed every stage with), when the stage took a larger one."""
    own = stage.micro_batch_size
    return [own] if base_micro_batch is None or base_micro_batch >= own else [own, base_micro_batch]


def stage_on_nodes(
    stage: Stage,
    *,
    num_nodes: int,
    planned_nodes: int,
    devices_per_node: int,
    expansion_factor: Fraction,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    base_micro_batch: int | None = None,
) -> Stage:
    """`stage` trained on `num_nodes`: the same batch, samples and LR; its data parallelism, accumulation,
    world size and loading hosts for that count (`planned_nodes` remembers the plan's). A stage whose own
    micro batch (larger than the plan's, `faster_micro_batches`) does not split its batch over the new data
    parallelism trains at the plan's `base_micro_batch` there.

    Raises:
        ValueError: the stage's batch does not split over `num_nodes` (see `fewer_nodes`).
    """
    dp = data_parallel_size(
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        pipeline_parallel_size=pipeline_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
    )
    micro = next(
        (
            size
            for size in _micro_batches(stage, base_micro_batch)
            if dp and stage.global_batch_size % (size * dp) == 0
        ),
        None,
    )
    if dp is None or micro is None:
        raise ValueError(
            f"{stage.name}'s batch {stage.global_batch_size} does not split over {num_nodes} node(s)"
        )
    return replace(
        stage,
        num_nodes=num_nodes,
        micro_batch_size=micro,
        data_parallel_size=dp,
        gradient_accumulation_steps=gradient_accumulation_steps(
            global_batch_size=stage.global_batch_size,
            micro_batch_size=micro,
            data_parallel_size=dp,
        ),
        world_size=num_nodes * devices_per_node,
        num_loading_hosts=num_loading_hosts(
            num_hosts=num_nodes,
            expansion_factor=expansion_factor,
            samples_per_host_pass=micro * dp // num_nodes,  # a node's data-parallel ranks
        ),
        planned_nodes=planned_nodes if num_nodes != planned_nodes else None,
    )


def apply_capacity(
    plan: Plan,
    records: Sequence[LaunchCapacity],
    *,
    expansion_factor: Fraction,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> Plan:
    """The plan with each recorded launch on the nodes it got. A record applies only to the launch it was
    made for (the same stages and planned node count): a record of another plan changes nothing."""
    stages = list(plan.stages)
    planned = {(launch.first_stage, launch.last_stage, launch.requested_nodes) for launch in launches(plan)}
    for record in records:
        if (record.first_stage, record.last_stage, record.planned_nodes) not in planned:
            continue
        for stage in stages[record.first_stage : record.last_stage + 1]:
            stages[stage.index] = stage_on_nodes(
                stage,
                num_nodes=record.nodes,
                planned_nodes=record.planned_nodes,
                devices_per_node=plan.devices_per_node,
                expansion_factor=expansion_factor,
                pipeline_parallel_size=pipeline_parallel_size,
                tensor_parallel_size=tensor_parallel_size,
                base_micro_batch=plan.micro_batch_size,
            )
    return replace(plan, stages=tuple(stages))


def capacity_problems(
    *,
    backend: str,
    pool_mode: str,
    accelerator_type: str | None,
    fewer_nodes: str,
    local_capacity_nodes: int | None,
) -> list[BatchpilotError]:
    """Settings of `cluster.fewer_nodes` and `cluster.local_capacity_nodes` that cannot take effect, one
    error each (the planner refuses them before anything is resized)."""
    problems = []
    if local_capacity_nodes is not None and backend != "local":
        problems.append(
            BatchpilotError(
                "cluster.local_capacity_nodes",
                f"limits the local pool, but cluster.backend is {backend}",
                "remove it (a gke pool's capacity is what GKE grants)",
            )
        )
    if fewer_nodes == "allow" and backend == "gke":
        if is_tpu(accelerator_type):
            problems.append(
                BatchpilotError(
                    "cluster.fewer_nodes",
                    f"allow cannot apply to TPU slices ({accelerator_type}): a slice is created whole or not at all",
                    "set cluster.fewer_nodes: fail",
                )
            )
        elif pool_mode != "resize":
            problems.append(
                BatchpilotError(
                    "cluster.fewer_nodes",
                    f"allow applies to pool_mode resize, not {pool_mode}: "
                    + (
                        "an autoscaled pool grows for pending pods, which wait for every node "
                        "(cluster.pending_timeout_s)"
                        if pool_mode == "autoscale"
                        else "a static pool is never resized"
                    ),
                    "set cluster.pool_mode: resize or cluster.fewer_nodes: fail",
                )
            )
    return problems
