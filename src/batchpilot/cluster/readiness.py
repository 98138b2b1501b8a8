"""Node readiness through the Kubernetes API: which nodes of a pool can run a trainer now.

A node counts when it is Ready, not cordoned, and (for accelerator pools) advertises the expected number
of allocatable devices: `nvidia.com/gpu` on GPU nodes, `google.com/tpu` (chips) on TPU slice nodes. A GPU
node is Ready some time before the device plugin publishes its GPUs, and a trainer scheduled in that
window would wait or land short of devices.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.cluster.capacity import CapacityShortfall
from batchpilot.cluster.machines import Allocatable
from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import TPU_RESOURCE_NAME

GKE_NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_RESOURCE = TPU_RESOURCE_NAME

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeState:
    """What readiness needs to know about one node."""

    name: str
    ready: bool
    cordoned: bool
    allocatable_devices: int
    allocatable_cpu_millicores: int
    allocatable_memory_bytes: int
    device_resource: str = GPU_RESOURCE
    """The extended resource `allocatable_devices` counts (`nvidia.com/gpu` or `google.com/tpu`)."""

    def problem(self, *, gpus_per_node: int) -> str | None:
        """Why this node cannot take a trainer, or None when it can (`gpus_per_node`: devices of
        `device_resource` a trainer needs)."""
        if not self.ready:
            return f"{self.name} is not Ready"
        if self.cordoned:
            return f"{self.name} is cordoned"
        if self.allocatable_devices < gpus_per_node:
            return (
                f"{self.name} has {self.allocatable_devices} of {gpus_per_node} {self.device_resource} "
                "allocatable"
            )
        return None


def kube_api_client() -> Any:
    """A Kubernetes ApiClient: in-cluster service account first (pipeline pods), then kubeconfig."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            # KUBECONFIG is read now: the kubernetes package reads it once, at its import.
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        except (config.ConfigException, OSError) as error:
            raise BatchpilotError(
                "cluster",
                f"no Kubernetes credentials: not in a pod and no usable kubeconfig ({error})",
                "run `gcloud container clusters get-credentials CLUSTER` or run inside the cluster",
            ) from None
    return client.ApiClient(configuration)


def parse_cpu_millicores(quantity: str) -> int:
    """A Kubernetes CPU quantity ("7910m", "8", "0.5") in millicores, rounded down."""
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(quantity) * 1000)


def parse_bytes_quantity(quantity: str) -> int:
    """A Kubernetes memory quantity ("1869654592Ki", "1.5Gi", "64G") in bytes, rounded down."""
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(quantity))


def _node_state(node: Any, *, device_resource: str = GPU_RESOURCE) -> NodeState:
    conditions = (node.status.conditions or []) if node.status else []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    allocatable = (node.status.allocatable or {}) if node.status else {}
    return NodeState(
        name=node.metadata.name,
        ready=ready,
        cordoned=bool(node.spec and node.spec.unschedulable),
        allocatable_devices=int(allocatable.get(device_resource, "0")),
        allocatable_cpu_millicores=parse_cpu_millicores(allocatable.get("cpu", "0")),
        allocatable_memory_bytes=parse_bytes_quantity(allocatable.get("memory", "0")),
        device_resource=device_resource,
    )


def smallest_allocatable(nodes: list[NodeState]) -> Allocatable | None:
    """The least CPU and the least memory any of `nodes` offers to pods (None for no nodes): a pod
    sized to it fits whichever of them the scheduler picks."""
    if not nodes:
        return None
    return Allocatable(
        cpu_millicores=min(node.allocatable_cpu_millicores for node in nodes),
        memory_bytes=min(node.allocatable_memory_bytes for node in nodes),
    )


class PoolNodes:
    """The nodes of one node pool, read from the Kubernetes API by their pool label.

    Args:
        gpus_per_node: allocatable devices of `device_resource` a node must advertise (0: none needed).
        device_resource: `GPU_RESOURCE` (GPU pools) or `TPU_RESOURCE` (TPU slice pools: chips per host).
    """

    def __init__(
        self, *, api_client: Any, node_pool: str, gpus_per_node: int, device_resource: str = GPU_RESOURCE
    ) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self.node_pool = node_pool
        self.gpus_per_node = gpus_per_node
        self.device_resource = device_resource

    def states(self) -> list[NodeState]:
        """Every node carrying the pool label, whatever its state."""
        from kubernetes.client.rest import ApiException

        try:
            nodes = self._core.list_node(label_selector=f"{GKE_NODE_POOL_LABEL}={self.node_pool}")
        except ApiException as error:
            if error.status in (401, 403):
                raise BatchpilotError(
                    "cluster.service_account",
                    f"the Kubernetes API refused to list nodes ({error.status} {error.reason})",
                    "grant `list` on nodes (the chart's ClusterRole does)",
                ) from None
            raise
        return sorted(
            (_node_state(node, device_resource=self.device_resource) for node in nodes.items),
            key=lambda node: node.name,
        )

    def usable(self) -> tuple[list[NodeState], list[str]]:
        """(nodes that can take a trainer, one problem line per node that cannot)."""
        usable, problems = [], []
        for node in self.states():
            problem = node.problem(gpus_per_node=self.gpus_per_node)
            if problem is None:
                usable.append(node)
            else:
                problems.append(problem)
        return usable, problems

    def smallest_usable_allocatable(self) -> Allocatable | None:
        """The allocatable CPU and memory of the pool's smallest usable node (None: no usable node)."""
        return smallest_allocatable(self.usable()[0])

    def smallest_free_for_trainer(self) -> Allocatable | None:
        """What a trainer pod can request on any usable node of the pool: its allocatable (the capacity the
        kernel reports, less GKE's reservations) less the requests of the system pods bound to it, counted as
        the scheduler counts them (`system_pod_requests`). None: no usable node."""
        free = []
        for node in self.usable()[0]:
            cpu_m, memory = self._system_requests(node.name)
            free.append(
                Allocatable(
                    cpu_millicores=node.allocatable_cpu_millicores - cpu_m,
                    memory_bytes=node.allocatable_memory_bytes - memory,
                )
            )
        if not free:
            return None
        return Allocatable(min(f.cpu_millicores for f in free), min(f.memory_bytes for f in free))

    def _system_requests(self, node: str) -> tuple[int, int]:
        """(CPU millicores, memory bytes) requested by the pods on `node` that stay whatever runs there: those
        of DaemonSets and the static pods' mirrors (kube-proxy on GKE nodes)."""
        pods = self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
        ).items
        cpu_m = memory = 0
        for pod in pods:
            if not stays_on_node(pod):
                continue
            pod_cpu_m, pod_memory = pod_requests(pod)
            cpu_m += pod_cpu_m
            memory += pod_memory
        return cpu_m, memory

    def wait(
        self,
        num_nodes: int,
        *,
        timeout_s: float,
        poll_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        pool_conditions: Callable[[], list[str]] | None = None,
    ) -> list[NodeState]:
        """Polls until `num_nodes` nodes are usable; on timeout raises saying what is missing.

        `pool_conditions` reads what the cloud reports against the pool's size (GKE's GCE_STOCKOUT,
        GCE_QUOTA_EXCEEDED): each new line is logged as it appears and ends up in the timeout's message;
        an exceeded quota ends the wait at once, since it does not lift while a run waits.
        """
        deadline = clock() + timeout_s
        seen: list[str] = []
        while True:
            usable, problems = self.usable()
            if len(usable) >= num_nodes:
                return usable
            for line in pool_conditions() if pool_conditions else []:
                if line not in seen:
                    seen.append(line)
                    logger.warning("node pool %s: %s", self.node_pool, line)
            quota = any(line.startswith("GCE_QUOTA_EXCEEDED") for line in seen)
            if quota or clock() >= deadline:
                line = self.shortfall(
                    num_nodes=num_nodes,
                    usable=usable,
                    problems=problems,
                    after="so far" if quota else f"after {timeout_s:g}s",
                )
                line += "".join(f"; {condition}" for condition in seen)
                if quota:
                    raise CapacityShortfall(
                        "cluster.max_nodes",
                        line,
                        "request more of that quota for the region, or lower cluster.max_nodes",
                        ready=len(usable), wanted=num_nodes,
                    )  # fmt: skip
                raise CapacityShortfall(
                    "cluster.ready_timeout_s",
                    line,
                    f"check `kubectl describe nodes -l {GKE_NODE_POOL_LABEL}={self.node_pool}`, or raise "
                    "cluster.ready_timeout_s",
                    ready=len(usable), wanted=num_nodes,
                )  # fmt: skip
            sleep(min(poll_interval_s, max(deadline - clock(), 0.0)))

    def shortfall(self, *, num_nodes: int, usable: list[NodeState], problems: list[str], after: str) -> str:
        """One line: how many nodes are usable `after` the wait, and why each of the others is not."""
        unregistered = num_nodes - len(usable) - len(problems)
        parts = list(problems)
        if unregistered > 0:
            parts.append(f"{unregistered} node(s) not registered with Kubernetes yet")
        return (
            f"node pool {self.node_pool!r}: {len(usable)} of {num_nodes} node(s) usable {after}; "
            f"{'; '.join(parts)}"
        )


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
"""On the API's copy of a static pod (the kubelet starts those from its manifest folder, kubernetes.io
"Create static Pods")."""


def stays_on_node(pod: Any) -> bool:
    """A pod owned by a DaemonSet, or a static pod's mirror (owned by its Node, or annotated as a mirror)."""
    owners = {ref.kind for ref in pod.metadata.owner_references or []}
    annotations = pod.metadata.annotations or {}
    return bool(owners & {"DaemonSet", "Node"}) or MIRROR_ANNOTATION in annotations


def _container_requests(container: Any) -> tuple[int, int]:
    resources = container.resources
    asked = {
        **((resources.limits if resources else None) or {}),
        **((resources.requests if resources else None) or {}),
    }
    return parse_cpu_millicores(asked.get("cpu", "0")), parse_bytes_quantity(asked.get("memory", "0"))


def pod_requests(pod: Any) -> tuple[int, int]:
    """(CPU millicores, memory bytes) the scheduler counts for `pod` (k8s.io/component-helpers resource/helpers.go,
    PodRequests: the sidecar KEP 753's "Resources calculation for scheduling and Pod admission"): its app
    containers summed with its restartable init containers (sidecars); each other init container runs with
    the sidecars started before it, and the pod needs the largest of those if it is more (GKE's driver and
    GPUDirect installers request only there); then the pod's overhead. A limit without a request is the request."""
    spec = pod.spec
    total = [0, 0]
    for container in spec.containers or []:
        total = [a + b for a, b in zip(total, _container_requests(container), strict=True)]
    sidecars, peak = [0, 0], [0, 0]
    for container in spec.init_containers or []:
        own = list(_container_requests(container))
        if getattr(container, "restart_policy", None) == "Always":
            total = [a + b for a, b in zip(total, own, strict=True)]
            sidecars = [a + b for a, b in zip(sidecars, own, strict=True)]
            running = list(sidecars)
        else:
            running = [a + b for a, b in zip(own, sidecars, strict=True)]
        peak = [max(a, b) for a, b in zip(peak, running, strict=True)]
    total = [max(a, b) for a, b in zip(total, peak, strict=True)]
    overhead = spec.overhead or {}
    return (
        total[0] + parse_cpu_millicores(overhead.get("cpu", "0")),
        total[1] + parse_bytes_quantity(overhead.get("memory", "0")),
    )
