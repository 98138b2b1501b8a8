"""Which run a GKE node pool belongs to, and whether that run is still alive (orphaned pools).

The exit handler scales the pool down at the end of a run, but it is an Argo exit hook, and an exit
hook can fail or never run (its pod stays Pending, the run is terminated before it starts). So every
run also leaves a record that outlives it:

- the pool's GCP resource labels (`NodePool.config.resourceLabels`, set with updateNodePool):
  `batchpilot-run: <run>` and `batchpilot-idle-nodes: <cluster.idle_nodes>` (the reaper has no config of
  that run, so the size to go back to travels with the pool). GCP label values are lowercase letters,
  digits, `_` and `-`, at most 63 characters (Compute Engine "Labels" requirements).
- a Kubernetes Lease `batchpilot-run-<run>` (coordination.k8s.io/v1) in `cluster.namespace`, renewed by
  the run's tasks while they work: `holderIdentity` the run, `renewTime`, `leaseDurationSeconds`
  `cluster.orphan_ttl_s`. The resize task renews it; the train task renews it every third of the TTL
  while it follows its JobSet; the exit handler deletes it after the scale-down.

A pool labelled with a run whose Lease is missing or expired is orphaned: the next run that uses the pool
takes it over, and `batchpilot pool scale-down --orphaned` (the chart's optional CronJob) deletes the run's
JobSets and ProvisioningRequests left behind (a cancelled task that was killed before it cleaned up, an
exit handler that never ran) and scales the pool down to its recorded idle size. A pool of another live run
is refused: two runs must not fight over one pool.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from batchpilot.cluster.labels import (
    CREATED_BY_LABEL,
    IDLE_POOL_LABEL,
    RUN_LABEL,
    RUN_POOL_LABEL,
    label_value,
)

if TYPE_CHECKING:
    from batchpilot.config import ClusterConfig

logger = logging.getLogger(__name__)

LEASE_PREFIX = "batchpilot-run-"


def lease_name(run: str) -> str:
    """The run's Lease: a DNS subdomain name made from the run's label value."""
    return (LEASE_PREFIX + label_value(run).replace("_", "-")).rstrip("-")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def renew_lease(
    api_client: Any, *, namespace: str, run: str, ttl_s: float, now: Callable[[], dt.datetime] | None = None
) -> None:
    """Creates or renews the run's Lease for `ttl_s` seconds from now."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.CoordinationV1Api(api_client)
    name, stamp = lease_name(run), (now or _now)()
    spec = client.V1LeaseSpec(
        holder_identity=label_value(run), lease_duration_seconds=int(ttl_s), renew_time=stamp
    )
    try:
        lease = api.read_namespaced_lease(name, namespace, _request_timeout=10)
    except ApiException as error:
        if error.status != 404:
            raise
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=name), spec=spec)
        body.spec.acquire_time = stamp
        api.create_namespaced_lease(namespace, body, _request_timeout=10)
        return
    lease.spec.holder_identity = spec.holder_identity
    lease.spec.lease_duration_seconds = spec.lease_duration_seconds
    lease.spec.renew_time = stamp
    api.replace_namespaced_lease(name, namespace, lease, _request_timeout=10)


def delete_lease(api_client: Any, *, namespace: str, run: str) -> None:
    """Deletes the run's Lease (the run ended); a missing one is fine."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        client.CoordinationV1Api(api_client).delete_namespaced_lease(
            lease_name(run), namespace, _request_timeout=10
        )
    except ApiException as error:
        if error.status != 404:
            raise


def run_alive(
    api_client: Any, *, namespace: str, run: str, now: Callable[[], dt.datetime] | None = None
) -> tuple[bool, str]:
    """(alive, why): the run's Lease is unexpired. A JobSet of the run does not keep it alive: a train task
    renews the Lease while it follows its JobSet, so a JobSet still running after the Lease expired is one
    whose task was cancelled or killed before it could delete it (KFP's launcher and Argo's emissary do
    not give a task time to clean up after SIGTERM), and it is orphaned with the pool."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(
            lease_name(run), namespace, _request_timeout=10
        )
    except ApiException as error:
        if error.status != 404:
            raise
        lease = None
    if lease is not None and lease.spec.renew_time is not None:
        expires = lease.spec.renew_time + dt.timedelta(seconds=lease.spec.lease_duration_seconds or 0)
        if expires > (now or _now)():
            return True, f"Lease {lease_name(run)} renewed until {expires:%Y-%m-%dT%H:%M:%SZ}"
    return False, f"Lease {lease_name(run)} {'expired' if lease is not None else 'missing'}"


@contextlib.contextmanager
def lease_renewed(api_client: Callable[[], Any], *, namespace: str, run: str, ttl_s: float) -> Iterator[None]:
    """Renews the run's Lease now and every third of `ttl_s` in a thread while the block runs; a failed
    renewal is a warning (the next one may pass before the Lease expires)."""
    stop = threading.Event()

    def renew() -> None:
        while True:
            try:
                renew_lease(api_client(), namespace=namespace, run=run, ttl_s=ttl_s)
            except Exception as error:  # a lost renewal must not stop the training it accompanies
                logger.warning("could not renew Lease %s: %s", lease_name(run), str(error).splitlines()[0])
            if stop.wait(ttl_s / 3):
                return

    thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


def claim_pool(
    pool: Any, *, api_client: Any, namespace: str, run: str, idle_nodes: int, ttl_s: float
) -> None:
    """Before a run resizes `pool` (a `GkeNodePool`): refuses a pool of another live run, takes over an
    orphaned one, renews this run's Lease and labels the pool with the run and its idle size.

    An orphaned pool is not scaled down first: this run's resize sets its size anyway, and a shrink
    followed by a grow would only recreate nodes.

    Raises:
        BatchpilotError: the pool is labelled with another run that is still alive.
    """
    from batchpilot.errors import BatchpilotError

    labels = pool.resource_labels()
    owner, me = labels.get(RUN_POOL_LABEL), label_value(run)
    if owner and owner != me:
        alive, why = run_alive(api_client, namespace=namespace, run=owner)
        if alive:
            raise BatchpilotError(
                "cluster.node_pool",
                f"{pool.pool.node_pool} belongs to run {owner}, which is still alive ({why})",
                "wait for that run to end (or cancel it), or give this run another node pool",
            )
        logger.info("%s: taking over from run %s (%s)", pool.pool.node_pool, owner, why)
    renew_lease(api_client, namespace=namespace, run=run, ttl_s=ttl_s)
    wanted = {**labels, RUN_POOL_LABEL: me, IDLE_POOL_LABEL: str(idle_nodes)}
    if wanted != labels:
        pool.set_resource_labels(wanted)


def release_pool(pool: Any, *, api_client: Any, namespace: str, run: str) -> None:
    """After the pool was scaled down at the end of `run`: drops the run's labels, deletes its Lease."""
    labels = pool.resource_labels()
    if labels.get(RUN_POOL_LABEL) == label_value(run):
        pool.set_resource_labels(
            {k: v for k, v in labels.items() if k not in (RUN_POOL_LABEL, IDLE_POOL_LABEL)}
        )
    delete_lease(api_client, namespace=namespace, run=run)


def scale_down_orphans(
    *,
    client: Any,
    parent: str,
    api_client: Any,
    namespace: str,
    pool_for: Callable[[str, int, bool, bool], Any],
    delete_slice: Callable[[str], None],
    delete_run: Callable[[str], list[str]],
) -> list[str]:
    """Scales every orphaned batchpilot pool of the cluster `parent` down to its recorded idle size and
    releases it, and deletes every orphaned TPU slice pool batchpilot created; one line each.
    `pool_for(name, idle_nodes, autoscaled, queued)` makes the `GkeNodePool` of a pool (an autoscaled pool gets
    its bounds set, not its size; a queued-provisioning pool neither: its nodes go with its run's
    ProvisioningRequests, and bounds of [0, 0] would refuse the next flex-start run); `delete_slice(name)`
    deletes a slice pool and waits for it; `delete_run(run)` deletes the run's JobSets and ProvisioningRequests
    and returns their names."""

    lines = []
    for node_pool in client.list_node_pools(parent=parent).node_pools:
        labels = dict(node_pool.config.resource_labels)
        run = labels.get(RUN_POOL_LABEL)
        if not run:
            continue
        alive, why = run_alive(api_client, namespace=namespace, run=run)
        if alive:
            lines.append(f"{node_pool.name}: run {run} is alive ({why}); left alone")
            continue
        for name in delete_run(run):  # its JobSets and ProvisioningRequests go before its nodes
            lines.append(f"{name}: left running by run {run} ({why}); deleted")
        if CREATED_BY_LABEL in node_pool.config.labels:
            # A multi-host slice pool cannot be resized, and batchpilot made this one for that run only.
            delete_slice(node_pool.name)
            delete_lease(api_client, namespace=namespace, run=run)
            lines.append(f"{node_pool.name}: TPU slice orphaned by run {run} ({why}); deleted")
            continue
        idle = int(labels.get(IDLE_POOL_LABEL, "0"))
        queued = bool(getattr(node_pool.queued_provisioning, "enabled", False))
        pool = pool_for(node_pool.name, idle, bool(node_pool.autoscaling.enabled), queued)
        before = pool.current_size()
        pool.resize(idle)
        release_pool(pool, api_client=api_client, namespace=namespace, run=run)
        lines.append(
            f"{node_pool.name}: orphaned by run {run} ({why}); scaled down {before} -> {idle} node(s)"
        )
    return lines


def scale_down_orphaned(cluster: ClusterConfig) -> list[str]:
    """Scales down every orphaned batchpilot pool of the config's GKE cluster; one line per pool."""
    from batchpilot.cluster.gke import ContainerCalls, GkeNodePool, PoolRef, gke_node_pool
    from batchpilot.cluster.readiness import PoolNodes, kube_api_client
    from batchpilot.errors import BatchpilotError

    if cluster.backend != "gke":
        raise BatchpilotError("--orphaned", "needs a gke config", "give the config of the GKE cluster")
    template = gke_node_pool(cluster)
    api_client = kube_api_client()
    ref = template.pool

    def pool_for(full_name: str, idle_nodes: int, autoscaled: bool, queued: bool) -> GkeNodePool:
        name = full_name.rsplit("/", 1)[-1]
        return GkeNodePool(
            client=template.client, pool=PoolRef(ref.project, ref.location, ref.cluster, name),
            pool_mode="autoscale" if autoscaled else "resize", idle_nodes=idle_nodes,
            nodes=PoolNodes(api_client=api_client, node_pool=name, gpus_per_node=0),
            operation_timeout_s=cluster.operation_timeout_s, provisioning="flex-start" if queued else "resize",
        )  # fmt: skip

    def delete_run(run: str) -> list[str]:
        from batchpilot.cluster.lifecycle import delete_labelled
        from batchpilot.cluster.provisioning import delete_run_requests

        names = delete_labelled(cluster, labels={RUN_LABEL: run}, wait_s=60.0, why=f"run {run} has ended")
        return names + delete_run_requests(
            api_client=api_client, namespace=cluster.namespace, run=run, unserved_is_none=True
        )

    def delete_slice(full_name: str) -> None:
        calls = ContainerCalls(client=template.client, operation_timeout_s=cluster.operation_timeout_s)
        name = full_name.rsplit("/", 1)[-1]
        ref_of = PoolRef(ref.project, ref.location, ref.cluster, name)
        operation = calls.call(
            "delete node pool", template.client.delete_node_pool, {"name": ref_of.name}, target=ref_of.name
        )
        calls.wait_operation(
            ref.operation_name(operation.name), what="delete orphaned TPU slice", subject=name
        )

    return scale_down_orphans(
        client=template.client, parent=ref.parent, api_client=api_client, namespace=cluster.namespace,
        pool_for=pool_for, delete_slice=delete_slice, delete_run=delete_run,
    )  # fmt: skip
