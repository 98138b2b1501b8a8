"""How long each kind of pipeline task may run on a cluster: from the config's own bounds, with a margin."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchpilot.config import Config

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskTimeouts:
    """Seconds each kind of pipeline task may run on a cluster before KFP stops its pod."""

    pool_s: int
    explore_s: int
    plan_s: int
    train_s: int
    report_s: int
    canary_s: int
    next_nodes_s: int
    """The task beside a train task that asks for the next launch's nodes ahead: it follows the launch."""


def task_timeouts(config: Config) -> TaskTimeouts:
    """Timeouts from the config's own limits, with a margin for start-up and image pulls."""
    margin_s = 600
    cluster, explore = config.cluster, config.explore
    return TaskTimeouts(
        pool_s=int(cluster.operation_timeout_s + cluster.ready_timeout_s) + margin_s,
        # The search stops starting probes after max_minutes; the last probe and the study may still run.
        explore_s=int(explore.max_minutes * 60 + explore.probe_timeout_s + explore.study_timeout_s)
        + margin_s,
        plan_s=margin_s,
        train_s=int(cluster.stage_timeout_s),
        report_s=margin_s,
        canary_s=_canary_timeout_s(config) + margin_s,
        next_nodes_s=int(cluster.stage_timeout_s),
    )


def _canary_timeout_s(config: Config) -> int:
    """The canary task's bound: the pool's resize, its pods' pending bound, the job's own bounds."""
    from batchpilot.train.canary import CANARY_TIMEOUT_S

    cluster = config.cluster
    autoscale = cluster.pool_mode == "autoscale"  # the nodes come once the pods are pending
    pending_s = cluster.pending_timeout_s + (cluster.ready_timeout_s if autoscale else 0)
    ready_s = max(cluster.ready_timeout_s, cluster.capacity_timeout_s or 0)  # the canary's resize waits this
    return int(cluster.operation_timeout_s + ready_s + pending_s + 2 * CANARY_TIMEOUT_S)
