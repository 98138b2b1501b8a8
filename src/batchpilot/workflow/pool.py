"""The node pool steps: bring the pool to a size and wait for its nodes, scale it down at the end (the exit
handler), and the run's claim on a GKE pool (its labels and Lease) while it holds it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.planning.trials import trial_run_names
from batchpilot.runstate import record_event
from batchpilot.workflow.timeouts import task_timeouts

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolChange:
    """What a resize did: sizes before and after, the wait, and the pool's description afterwards."""

    before: int
    after: int
    elapsed_s: float
    description: str


def prepare_pool(
    config: Config,
    *,
    num_nodes: int,
    timeout_s: float | None = None,
    state_path: str | None = None,
    early: bool = False,
) -> PoolChange:
    """Resizes the pool to `num_nodes` and waits until that many nodes are ready; bad input touches nothing.
    `early`: for the next launch, while the current one trains (`workflow.ahead`; the ledger's event says so)."""
    from batchpilot.cluster.nodepool import node_pool_for

    if not 0 <= num_nodes <= config.cluster.max_nodes:
        raise BatchpilotError(
            "--nodes",
            f"{num_nodes} is outside 0..{config.cluster.max_nodes} (cluster.max_nodes)",
            "give a node count the config allows",
        )
    if timeout_s is not None and timeout_s <= 0:
        raise BatchpilotError("--timeout-s", f"{timeout_s} is not positive", "give seconds > 0")
    cluster = config.cluster
    if cluster.backend == "gke" and cluster.kueue_queue and num_nodes > 0:
        from batchpilot.cluster.kueue import queue_problem
        from batchpilot.cluster.readiness import kube_api_client

        # Before any node is asked for: a queue whose quota can never hold the launch would keep it waiting; with
        # flex-start, a ClusterQueue without a ProvisioningRequest admission check would never bring the nodes.
        problem = queue_problem(kube_api_client(), cluster, nodes=num_nodes)
        if problem is not None:
            raise problem
    pool = node_pool_for(config, state_path=state_path)
    _claim(config, pool)
    started = time.monotonic()
    requested_s = time.time()
    before = pool.current_size()
    pool.resize(num_nodes)
    # Flex-start (a ProvisioningRequest per launch) and autoscale mode (pending pods) bring the nodes
    # when the launch's job asks for them: the pool task neither resized nor waited for them.
    deferred = cluster.backend == "gke" and (
        cluster.provisioning == "flex-start" or cluster.pool_mode == "autoscale"
    )
    if not deferred:
        logger.info("resized: %d -> %d node(s)", before, num_nodes)
    pool.wait_ready(num_nodes, timeout_s=timeout_s if timeout_s is not None else cluster.ready_timeout_s)
    change = PoolChange(before, num_nodes, time.monotonic() - started, pool.describe())
    record_pool_event(config, before=before, after=num_nodes, requested_s=requested_s, early=early)
    if deferred:
        how = (
            "the ProvisioningRequest of Kueue's admission check"
            if cluster.provisioning == "flex-start" and cluster.kueue_queue
            else "its ProvisioningRequest"
            if cluster.provisioning == "flex-start"
            else "the cluster autoscaler"
        )
        logger.info("%d node(s) come with the launch's job (%s); %s", num_nodes, how, change.description)
    else:
        logger.info("ready: %d node(s) after %.1fs; %s", num_nodes, change.elapsed_s, change.description)
    return change


def record_pool_event(
    config: Config, *, before: int, after: int, requested_s: float, early: bool = False
) -> None:
    """The goodput ledger's `pool` event of a resize asked for at `requested_s` and ready now; `early`: for the
    next launch, while the current one trains (`planning.goodput`)."""
    event = {
        "kind": "pool",
        "before": before,
        "after": after,
        "requested_s": requested_s,
        "ready_s": time.time(),
    }
    record_event(config.train.checkpoint_uri, event | ({"early": True} if early else {}))


def _claim(config: Config, pool: Any) -> None:
    """A GKE pool is labelled with the run and its Lease renewed before it is resized
    (`batchpilot.cluster.ownership`); TPU slice pools carry the run from their creation, so only the
    Lease is renewed for them. The Lease lasts at least until the next task that renews it can have run:
    explore and plan follow the explore pool's resize. A static pool is never changed, its labels
    included (and nothing would scale it down)."""
    from batchpilot.cluster.gke import GkeNodePool
    from batchpilot.cluster.tpu_pool import TpuSlicePool

    if not isinstance(pool, GkeNodePool | TpuSlicePool) or pool.pool_mode == "static":
        return
    from batchpilot.cluster.ownership import claim_pool, renew_lease
    from batchpilot.cluster.readiness import kube_api_client

    limits = task_timeouts(config)
    ttl_s = max(config.cluster.orphan_ttl_s, limits.explore_s + limits.plan_s + limits.pool_s)
    if isinstance(pool, TpuSlicePool):
        # Slice pools carry the run from their creation (`run_labels`); the Lease keeps them from looking
        # orphaned between this resize and the train task.
        renew_lease(kube_api_client(), namespace=config.cluster.namespace, run=config.name, ttl_s=ttl_s)
        return
    claim_pool(
        pool, api_client=kube_api_client(), namespace=config.cluster.namespace, run=config.name,
        idle_nodes=config.cluster.idle_nodes, ttl_s=ttl_s,
    )  # fmt: skip


def scale_down(config: Config, *, state_path: str | None = None) -> PoolChange:
    """Resizes the pool to `cluster.idle_nodes` (the exit handler: it runs whether the stages succeeded)."""
    from batchpilot.cluster.nodepool import node_pool_for

    if config.cluster.backend == "gke":
        from batchpilot.cluster.lifecycle import delete_run_jobs

        # A cancelled or failed run may leave its JobSets (and its trials') on the GPUs; they go (and their
        # trainers stop, checkpointing) before the pool shrinks under them.
        trials = config.trials
        trial_runs = (
            trial_run_names(config.name, batch_sizes=trials.batch_sizes, lr_multipliers=trials.lr_multipliers)
            if trials.enabled
            else []
        )
        for run in (config.name, *trial_runs):
            delete_run_jobs(cluster=config.cluster, run=run)
    pool = node_pool_for(config, state_path=state_path)
    started = time.monotonic()
    requested_s = time.time()
    before = pool.current_size()
    pool.resize(config.cluster.idle_nodes)
    _release(config, pool)
    change = PoolChange(before, config.cluster.idle_nodes, time.monotonic() - started, pool.describe())
    record_pool_event(config, before=before, after=change.after, requested_s=requested_s)
    logger.info(
        "scaled down: %d -> %d node(s) (cluster.idle_nodes); %s", before, change.after, change.description
    )
    return change


def _release(config: Config, pool: Any) -> None:
    """The run is over: its labels leave the (scaled down) GKE pool and its Lease is deleted."""
    from batchpilot.cluster.gke import GkeNodePool
    from batchpilot.cluster.tpu_pool import TpuSlicePool

    if not isinstance(pool, GkeNodePool | TpuSlicePool) or pool.pool_mode == "static":
        return
    from batchpilot.cluster.ownership import delete_lease, release_pool
    from batchpilot.cluster.readiness import kube_api_client

    if isinstance(pool, TpuSlicePool):  # resize(0) deleted the run's slice pools, labels and all
        delete_lease(kube_api_client(), namespace=config.cluster.namespace, run=config.name)
        return
    release_pool(pool, api_client=kube_api_client(), namespace=config.cluster.namespace, run=config.name)


def pool_status(config: Config, *, state_path: str | None = None) -> str:
    from batchpilot.cluster.nodepool import node_pool_for

    return node_pool_for(config, state_path=state_path).describe()
