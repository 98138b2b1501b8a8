"""A launch's nodes: the resize to its planned count and, when fewer come (`cluster.fewer_nodes: allow`),
the largest node count its batches split over, recorded beside the checkpoints (`capacity.json`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from batchpilot import runstate
from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.capacity import LaunchCapacity
from batchpilot.planning.launches import Launch
from batchpilot.planning.stages import Stage
from batchpilot.workflow.document import with_capacity
from batchpilot.workflow.pool import prepare_pool
from batchpilot.workflow.stage import pipeline_launch

if TYPE_CHECKING:
    from batchpilot.cluster.capacity import CapacityShortfall

logger = logging.getLogger(__name__)


def prepare_launch_pool(document: RunDocument, *, slot: int) -> int | None:
    """Resizes the pool to the planned node count of the launch in `slot` and returns the nodes the launch
    trains on (None: an unused slot).

    When only some nodes are ready by `cluster.capacity_timeout_s` (a stockout, a quota): with
    `cluster.fewer_nodes: allow` the launch trains on the largest node count at most the ready ones that
    its stages' batches split over (memory checked again for that shard degree), the pool goes to that
    count and the choice is recorded beside the checkpoints (`capacity.json`) for the train task, a retry
    and the report; otherwise the resize fails naming the shortfall. A launch that gets its planned nodes
    clears an earlier record of itself (a retry that found capacity).
    """
    from batchpilot.cluster.capacity import CapacityShortfall

    launch = pipeline_launch(document, slot=slot)
    if launch is None:
        return None
    config = document.config
    planned = launch.requested_nodes
    # What it asks for: the plan's count, whatever a previous attempt's record moved it to.
    logger.info("launch-%d is %s", slot, replace(launch, num_nodes=planned, planned_nodes=None).describe())
    timeout_s = config.cluster.capacity_timeout_s or config.cluster.ready_timeout_s
    started = time.monotonic()
    try:
        prepare_pool(config, num_nodes=planned, timeout_s=timeout_s)
    except CapacityShortfall as short:
        if config.cluster.fewer_nodes != "allow":
            raise BatchpilotError(
                short.field,
                f"{launch.name} needs {planned} node(s): {short.problem}",
                f"{short.fix}; or set cluster.fewer_nodes: allow to train {launch.name} on the nodes that come",
            ) from None
        record = _fewer_nodes(document, launch, short=short, waited_s=time.monotonic() - started)
        return record.nodes
    if config.cluster.fewer_nodes == "allow":
        record_capacity(config, launch, None)  # a retry that got every node trains on them
    return planned


def _fewer_nodes(
    document: RunDocument, launch: Launch, *, short: CapacityShortfall, waited_s: float
) -> LaunchCapacity:
    """Moves `launch` to the nodes that came (see `prepare_launch_pool`); returns the record it keeps."""
    from batchpilot.cluster.nodepool import node_pool_for
    from batchpilot.plan.memory import memory_on_fewer_nodes
    from batchpilot.plan.schedule import placement
    from batchpilot.planning.capacity import fewer_nodes
    from batchpilot.train.shape import model_shape

    config = document.config
    planned = launch.requested_nodes
    stages = document.plan.stages[launch.first_stage : launch.last_stage + 1]
    nodes = fewer_nodes(
        stages,
        available=short.ready,
        placement=placement(config),
        base_micro_batch=document.plan.micro_batch_size,
    )
    if nodes is None:
        batches = ", ".join(str(stage.global_batch_size) for stage in stages)
        raise BatchpilotError(
            "cluster.fewer_nodes",
            f"{launch.name} got {short.ready} of its {planned} node(s), and no node count from "
            f"{config.cluster.min_nodes} (cluster.min_nodes) to {short.ready} splits its global batch(es) {batches} "
            f"into whole micro batches of {_micro_batch_words(stages, document.plan.micro_batch_size)}: "
            f"{short.problem}",
            "wait longer for the planned nodes (cluster.capacity_timeout_s) or retry when capacity returns",
        )
    record = LaunchCapacity(
        launch=launch.name, first_stage=launch.first_stage, last_stage=launch.last_stage,
        planned_nodes=planned, ready_nodes=short.ready, nodes=nodes, waited_s=round(waited_s, 1),
        reason=short.problem,
    )  # fmt: skip
    moved = with_capacity(document, [record])
    if document.memory is not None:  # the shard degree changes with the world: fsdp's share grows
        memory_on_fewer_nodes(
            config, document.memory, stages=moved.plan.stages[launch.first_stage : launch.last_stage + 1],
            shape=model_shape(factory=config.model.factory, args=config.model.args),
        )  # fmt: skip
    logger.warning(
        "%s: %d of %d planned node(s) ready after %.0fs (cluster.fewer_nodes: allow): training on %d node(s) "
        "at the planned global batch%s; only data parallelism and accumulation change",
        launch.name, short.ready, planned, waited_s, nodes, "es" if len(stages) > 1 else "",
    )  # fmt: skip
    for before, after in zip(
        stages, moved.plan.stages[launch.first_stage : launch.last_stage + 1], strict=True
    ):
        if after.micro_batch_size != before.micro_batch_size:
            logger.warning(
                "%s: micro batch %d (the plan's) on %d node(s): its own %d does not split its batch %d over them",
                after.name, after.micro_batch_size, nodes, before.micro_batch_size, after.global_batch_size,
            )  # fmt: skip
    # The pool's target goes to what the launch uses: ready nodes it cannot use are not paid for, and
    # nodes the cloud would still bring mid-launch (the stockout ends) would only idle.
    node_pool_for(config).resize(nodes)
    logger.info("pool set to the %d node(s) %s trains on", nodes, launch.name)
    record_capacity(config, launch, record)
    return record


def _micro_batch_words(stages: Sequence[Stage], base: int) -> str:
    """`2`, or `8 (or the plan's 2)` where a stage took a larger micro batch than the plan's."""
    own = sorted({stage.micro_batch_size for stage in stages})
    words = "/".join(str(size) for size in own)
    return words if own == [base] else f"{words} (or the plan's {base})"


def record_capacity(config: Config, launch: Launch, record: LaunchCapacity | None) -> None:
    """Replaces the launch's capacity record beside the checkpoints (None: removes it)."""
    runstate.record_capacity(
        config.train.checkpoint_uri,
        first_stage=launch.first_stage,
        last_stage=launch.last_stage,
        record=record,
    )
