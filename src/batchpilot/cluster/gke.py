"""A GKE node pool as a `NodePool`: the Container API resizes it, the Kubernetes API says when it is ready.

Modes (`cluster.pool_mode`):
- `resize`: `setSize` to the stage's node count. GKE's node count is per zone, so a pool spanning
  k zones is sized `num_nodes / k` and `num_nodes` must be a multiple of k.
- `autoscale`: `setAutoscaling` with total bounds `[idle_nodes, num_nodes]`; the cluster autoscaler adds
  nodes when the job's pods are pending and removes them when they are idle.
- `static`: the pool is never changed; resizing only checks that it already has the nodes.

A write that meets another operation on the cluster ("incompatible operation", "currently ...
please wait and try again", or the concurrent-operations quota) is retried with backoff; a refused
permission or a missing pool is one clear error (`ContainerCalls`, which the TPU slice pools of
`batchpilot.cluster.tpu_pool` share).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from batchpilot.cluster.readiness import PoolNodes, kube_api_client
from batchpilot.config import ClusterConfig
from batchpilot.credentials import google_credentials
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

GKE_REQUIRED = ("project", "location", "cluster_name", "node_pool", "image")
CONTAINER_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
"""The Container API client's own default scope."""


def require_gke_settings(cluster: ClusterConfig) -> None:
    """Raises naming the first gke setting the config lacks."""
    for name in GKE_REQUIRED:
        if not getattr(cluster, name):
            raise BatchpilotError(
                f"cluster.{name}", "is required when cluster.backend is gke", f"set cluster.{name}"
            )


@dataclass(frozen=True)
class PoolRef:
    """The resource names of one GKE node pool."""

    project: str
    location: str
    cluster: str
    node_pool: str

    @property
    def parent(self) -> str:
        """The cluster's full name (the parent of its node pools)."""
        return f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"

    @property
    def name(self) -> str:
        return f"{self.parent}/nodePools/{self.node_pool}"

    def operation_name(self, operation: str) -> str:
        """The full name of an operation that the API returned by its short id."""
        if operation.startswith("projects/"):
            return operation
        return f"projects/{self.project}/locations/{self.location}/operations/{operation}"


def container_client(*, api_endpoint: str | None = None) -> Any:
    """A Container API client: Google's endpoint with Application Default Credentials, or `api_endpoint`
    (`cluster.container_api_endpoint`).

    An endpoint URL goes through the REST transport, which takes a URL as it is (gRPC wants host:port).
    `https://` (a private or regional endpoint) keeps Application Default Credentials; `http://` is an
    emulator, which has no use for a Google token, and anonymous credentials need none on the machine.
    """
    container_v1 = _container_v1()
    if api_endpoint and api_endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials

        return container_v1.ClusterManagerClient(
            transport="rest",
            client_options={"api_endpoint": api_endpoint},
            credentials=AnonymousCredentials(),
        )
    # Checked here, token included: a client left to find them fails only in its first call, after minutes of
    # retries when the token endpoint is unreachable (a key file of another machine, no network).
    credentials = google_credentials(field="cluster.project", scopes=CONTAINER_SCOPES)
    if not api_endpoint:
        return container_v1.ClusterManagerClient(credentials=credentials)
    return container_v1.ClusterManagerClient(
        transport="rest", client_options={"api_endpoint": api_endpoint}, credentials=credentials
    )


def _container_v1() -> Any:
    """google.cloud.container_v1, imported by name: a static `from google.cloud import ...` of this
    typed package makes mypy resolve `google.cloud` to it alone and lose the untyped siblings
    (google.cloud.storage) that other modules import."""
    return importlib.import_module("google.cloud.container_v1")


def gke_node_pool(cluster: ClusterConfig) -> GkeNodePool:
    """The pool of `cluster` with real clients: Container API (`container_client`) and Kubernetes
    (in-cluster, else kubeconfig)."""
    require_gke_settings(cluster)
    assert cluster.project and cluster.location and cluster.cluster_name and cluster.node_pool
    return GkeNodePool(
        client=container_client(api_endpoint=cluster.container_api_endpoint),
        pool=PoolRef(cluster.project, cluster.location, cluster.cluster_name, cluster.node_pool),
        pool_mode=cluster.pool_mode,
        idle_nodes=cluster.idle_nodes,
        nodes=PoolNodes(
            api_client=kube_api_client(),
            node_pool=cluster.node_pool,
            gpus_per_node=cluster.devices_per_node if cluster.accelerator_type else 0,
        ),
        operation_timeout_s=cluster.operation_timeout_s,
        provisioning=cluster.provisioning,
    )


def is_concurrent_operation(error: BaseException) -> bool:
    """True for the errors GKE returns while another operation holds the cluster (worth retrying)."""
    from google.api_core import exceptions

    if isinstance(error, exceptions.TooManyRequests):
        return True  # the per-cluster concurrent operations quota
    # gRPC raises FAILED_PRECONDITION as FailedPrecondition; REST maps its HTTP 400 to BadRequest.
    retryable = (
        exceptions.FailedPrecondition | exceptions.BadRequest | exceptions.Aborted | exceptions.Conflict
    )
    if not isinstance(error, retryable):
        return False
    message = str(error).lower()
    return "incompatible operation" in message or ("operation" in message and "try again" in message)


class _OperationRunning(Exception):
    """Raised by one poll while the operation is not DONE, so that a google-api-core Retry polls again."""


class GkeNodePool:
    """A GKE node pool behind the `NodePool` interface (see the module docstring for the modes)."""

    def __init__(
        self,
        *,
        client: Any,
        pool: PoolRef,
        pool_mode: str,
        idle_nodes: int,
        nodes: PoolNodes,
        operation_timeout_s: float,
        retry_initial_s: float = 5.0,
        retry_maximum_s: float = 60.0,
        poll_initial_s: float = 2.0,
        poll_maximum_s: float = 15.0,
        ready_poll_interval_s: float = 10.0,
        provisioning: str = "resize",
    ) -> None:
        self.client = client
        self.provisioning = provisioning
        """`cluster.provisioning`: with flex-start the launch's ProvisioningRequest brings the nodes, not a resize."""
        self.pool = pool
        self.pool_mode = pool_mode
        self.idle_nodes = idle_nodes
        self.nodes = nodes
        self.operation_timeout_s = operation_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_maximum_s = retry_maximum_s
        self.poll_initial_s = poll_initial_s
        self.poll_maximum_s = poll_maximum_s
        self.ready_poll_interval_s = ready_poll_interval_s

    def node_pool(self) -> Any:
        """The pool as the Container API describes it (zones, autoscaling, conditions)."""
        return self._call("get node pool", self.client.get_node_pool, {"name": self.pool.name})

    def zones(self, node_pool: Any = None) -> list[str]:
        """The zones the pool's nodes live in (node counts in setSize are per zone)."""
        node_pool = node_pool or self.node_pool()
        if not node_pool.locations:
            raise BatchpilotError("cluster.node_pool", f"GKE reports no zones for {self.pool.name}")
        return list(node_pool.locations)

    def current_size(self) -> int:
        """Nodes of the pool registered with Kubernetes, whatever their state."""
        return len(self.nodes.states())

    def resize(self, num_nodes: int) -> None:
        """Sets the size (resize), the autoscaler bounds (autoscale), or checks capacity (static)."""
        if num_nodes < 0:
            raise BatchpilotError("--nodes", f"{num_nodes} is negative", "give 0 or more nodes")
        if self.provisioning == "flex-start":
            self._check_queued_provisioning(num_nodes)
        elif self.pool_mode == "resize":
            self._set_size(num_nodes)
        elif self.pool_mode == "autoscale":
            self._set_autoscaling(num_nodes)
        elif self.pool_mode == "static":
            self._check_static(num_nodes)
        else:
            raise BatchpilotError("cluster.pool_mode", f"unknown mode {self.pool_mode!r}")

    def wait_ready(self, num_nodes: int, *, timeout_s: float) -> None:
        """Waits for `num_nodes` usable nodes; in autoscale mode checks the bounds admit them instead.

        An autoscaled pool only grows when pods are pending, so waiting for nodes before the job
        exists would wait for ever; the launcher's pods wait for their nodes instead. With flex-start there
        is nothing to wait for yet: the launch waits for its ProvisioningRequest.
        """
        if self.provisioning == "flex-start":
            if num_nodes:
                logger.info(
                    "%s: flex-start: %d node(s) come with the launch's ProvisioningRequest; the launch waits "
                    "for it", self.pool.node_pool, num_nodes,
                )  # fmt: skip
            return
        if self.pool_mode == "autoscale":
            self._check_autoscaling_admits(num_nodes)
            logger.info(
                "%s: autoscaling admits %d node(s); the cluster autoscaler adds them when the job's pods "
                "are pending",
                self.pool.node_pool, num_nodes,
            )  # fmt: skip
            return
        if num_nodes == 0:
            return
        self.nodes.wait(
            num_nodes,
            timeout_s=timeout_s,
            poll_interval_s=self.ready_poll_interval_s,
            pool_conditions=self.conditions,
        )

    def conditions(self) -> list[str]:
        """What GKE reports against the pool's size (`NodePool.conditions`: a stockout, a quota), one
        line each, e.g. `GCE_STOCKOUT: ZONE_RESOURCE_POOL_EXHAUSTED: The zone ...`."""
        return [f"{condition.code.name}: {condition.message}" for condition in self.node_pool().conditions]

    def resource_labels(self) -> dict[str, str]:
        """The pool's GCP resource labels (`NodePool.config.resourceLabels`): which run resized it."""
        return dict(self.node_pool().config.resource_labels)

    def set_resource_labels(self, labels: dict[str, str]) -> None:
        """Replaces the pool's resource labels (updateNodePool with only `resourceLabels`)."""
        container_v1 = _container_v1()
        request = container_v1.UpdateNodePoolRequest(
            name=self.pool.name, resource_labels=container_v1.ResourceLabels(labels=labels)
        )
        operation = self._call("label node pool", self.client.update_node_pool, request)
        self._wait_operation(operation, what="resource labels")

    def describe(self) -> str:
        """Pool name, mode, zones and node states."""
        usable, problems = self.nodes.usable()
        zones = self.zones()
        return (
            f"gke pool {self.pool.name} (mode {self.pool_mode}"
            + (", nodes by flex-start ProvisioningRequests" if self.provisioning == "flex-start" else "")
            + f", zones {', '.join(zones)}): "
            f"{len(usable) + len(problems)} node(s), {len(usable)} usable"
            + (f"; {'; '.join(problems)}" if problems else "")
        )

    def _set_size(self, num_nodes: int) -> None:
        node_pool = self.node_pool()
        if node_pool.autoscaling.enabled:
            # The cluster autoscaler owns an autoscaled pool's size: a set size would be undone (and
            # GKE refuses it), so this is a config error, not a retry.
            raise BatchpilotError(
                "cluster.pool_mode",
                f"resize mode sets the size of {self.pool.node_pool}, but its autoscaling is enabled",
                "set cluster.pool_mode: autoscale, or disable the pool's autoscaling "
                f"(`gcloud container node-pools update {self.pool.node_pool} --no-enable-autoscaling`)",
            )
        zones = self.zones(node_pool)
        if num_nodes % len(zones):
            raise BatchpilotError(
                "cluster.node_pool",
                f"{num_nodes} node(s) cannot be spread over the pool's {len(zones)} zones "
                f"({', '.join(zones)}): GKE sizes a pool per zone",
                "use a single-zone pool, node counts that are multiples of the zone count, or pool_mode autoscale",
            )
        container_v1 = _container_v1()
        request = container_v1.SetNodePoolSizeRequest(name=self.pool.name, node_count=num_nodes // len(zones))
        operation = self._call("resize", self.client.set_node_pool_size, request)
        self._wait_operation(operation, what=f"resize to {num_nodes} node(s)")

    def _set_autoscaling(self, num_nodes: int) -> None:
        container_v1 = _container_v1()
        low = min(self.idle_nodes, num_nodes)
        # total_* bounds count the whole pool, so no per-zone arithmetic is needed here.
        autoscaling = container_v1.NodePoolAutoscaling(
            enabled=True, total_min_node_count=low, total_max_node_count=num_nodes
        )
        request = container_v1.SetNodePoolAutoscalingRequest(name=self.pool.name, autoscaling=autoscaling)
        operation = self._call("set autoscaling", self.client.set_node_pool_autoscaling, request)
        self._wait_operation(operation, what=f"autoscaling bounds [{low}, {num_nodes}]")

    def _check_autoscaling_admits(self, num_nodes: int) -> None:
        node_pool = self._call("get node pool", self.client.get_node_pool, {"name": self.pool.name})
        scaling = node_pool.autoscaling
        zones = max(len(node_pool.locations), 1)
        maximum = scaling.total_max_node_count or scaling.max_node_count * zones
        if not scaling.enabled or maximum < num_nodes:
            raise BatchpilotError(
                "cluster.pool_mode",
                f"{self.pool.node_pool} autoscaling is {'on' if scaling.enabled else 'off'} with at most "
                f"{maximum} node(s); {num_nodes} are needed",
                f"run `batchpilot pool resize --nodes {num_nodes}` (autoscale mode sets the bounds)",
            )

    def _check_queued_provisioning(self, num_nodes: int) -> None:
        """Flex-start changes nothing on the pool: GKE's autoscaler adds nodes for each ProvisioningRequest
        and removes them when the request is deleted. Checks that the pool can serve a request for
        `num_nodes` (queued provisioning on, autoscaling that admits them: GKE "Run a large-scale workload
        with flex-start with queued provisioning")."""
        from batchpilot.cluster.provisioning import HOW_TO_CREATE_POOL

        if num_nodes == 0:
            logger.info(
                "%s: flex-start: not resized; its nodes go when their ProvisioningRequests are deleted",
                self.pool.node_pool,
            )
            return
        node_pool = self.node_pool()
        scaling = node_pool.autoscaling
        maximum = scaling.total_max_node_count or scaling.max_node_count * max(len(node_pool.locations), 1)
        problem = None
        if not node_pool.queued_provisioning.enabled:
            problem = "has no queued provisioning"
        elif not scaling.enabled or maximum < num_nodes:
            state = f"at most {maximum} node(s)" if scaling.enabled else "off"
            problem = f"has autoscaling {state}; {num_nodes} are needed"
        if problem:
            raise BatchpilotError(
                "cluster.provisioning",
                f"flex-start needs a node pool with queued provisioning and autoscaling, but {self.pool.node_pool} "
                f"{problem}",
                HOW_TO_CREATE_POOL,
            )
        logger.info(
            "%s: flex-start: not resized; the %d node(s) come with the launch's ProvisioningRequest",
            self.pool.node_pool, num_nodes,
        )  # fmt: skip

    def _check_static(self, num_nodes: int) -> None:
        have = self.current_size()
        if have < num_nodes:
            raise BatchpilotError(
                "cluster.pool_mode",
                f"static pool {self.pool.node_pool} has {have} node(s), {num_nodes} are needed; "
                "static mode never resizes",
                "resize the pool yourself, or use pool_mode resize or autoscale",
            )
        logger.info(
            "%s: static pool not resized; it has %d node(s) for %d needed",
            self.pool.node_pool,
            have,
            num_nodes,
        )

    def _calls(self) -> ContainerCalls:
        return ContainerCalls(
            client=self.client,
            operation_timeout_s=self.operation_timeout_s,
            retry_initial_s=self.retry_initial_s,
            retry_maximum_s=self.retry_maximum_s,
            poll_initial_s=self.poll_initial_s,
            poll_maximum_s=self.poll_maximum_s,
        )

    def _call(self, what: str, method: Any, request: Any) -> Any:
        """Calls the Container API, retrying while another operation holds the cluster."""
        return self._calls().call(what, method, request, target=self.pool.name)

    def _wait_operation(self, operation: Any, *, what: str) -> None:
        """Polls the operation until DONE; raises on its error."""
        self._calls().wait_operation(
            self.pool.operation_name(operation.name), what=what, subject=self.pool.node_pool
        )


# --- Container API calls, shared by GkeNodePool and tpu_pool.TpuSlicePool ---------------------------


@dataclass(frozen=True)
class ContainerCalls:
    """Container API calls with retries while another operation holds the cluster, operation polling
    until DONE, and one-line errors for a refused permission, a missing resource or a timeout.

    Attributes:
        client: a `ClusterManagerClient` (`container_client`).
        operation_timeout_s: how long retries of one call, or the polls of one operation, may take.
        retry_initial_s: first backoff of a call that met another operation (doubles up to
            `retry_maximum_s`).
        poll_initial_s: first wait between polls of a running operation (x1.5 up to `poll_maximum_s`).
    """

    client: Any
    operation_timeout_s: float
    retry_initial_s: float = 5.0
    retry_maximum_s: float = 60.0
    poll_initial_s: float = 2.0
    poll_maximum_s: float = 15.0

    def call(
        self, what: str, method: Any, request: Any, *, target: str, missing_field: str = "cluster.node_pool"
    ) -> Any:
        """Calls `method(request=...)`, retrying while another operation holds the cluster.

        Args:
            what: the action, for messages ("resize", "create node pool").
            target: the resource's full name, for messages.
            missing_field: the setting a NotFound error names.
        """
        from google.api_core import exceptions
        from google.api_core.retry import Retry

        def note(error: BaseException) -> None:
            logger.warning("%s: %s; retrying", what, error)

        retry = Retry(
            predicate=is_concurrent_operation,
            initial=self.retry_initial_s,
            maximum=self.retry_maximum_s,
            multiplier=2.0,
            timeout=self.operation_timeout_s,
            on_error=note,
        )
        try:
            return method(request=request, retry=retry)
        except (exceptions.PermissionDenied, exceptions.Forbidden) as error:  # gRPC, REST
            if "quota" in str(error.message).lower():
                raise BatchpilotError(
                    "cluster.max_nodes",
                    f"GKE refused to {what} {target}: {error.message}",
                    "request more of that quota for the region (Cloud console, IAM & Admin > Quotas), or "
                    "lower cluster.max_nodes",
                ) from None
            raise BatchpilotError(
                "cluster.project",
                f"GKE refused to {what} {target}: {error.message}",
                "give the caller's service account container.clusters.get/update "
                "(e.g. roles/container.clusterAdmin) on the project",
            ) from None
        except exceptions.NotFound as error:
            raise BatchpilotError(missing_field, f"{target} was not found: {error.message}") from None
        except exceptions.RetryError as error:
            raise BatchpilotError(
                "cluster.operation_timeout_s",
                f"{what} {target}: another operation kept the cluster busy for "
                f"{self.operation_timeout_s:g}s ({error.cause})",
                "wait for the cluster's operations to finish, or raise cluster.operation_timeout_s",
            ) from None

    def wait_operation(self, name: str, *, what: str, subject: str) -> None:
        """Polls operation `name` (its full name) until DONE (google-api-core Retry with backoff);
        raises on its error. `subject` (the node pool) and `what` name it in messages."""
        from google.api_core import exceptions
        from google.api_core.retry import Retry, if_exception_type

        done_status = _container_v1().Operation.Status.DONE

        def poll() -> Any:
            current = self.client.get_operation(name=name)
            if current.status != done_status:
                raise _OperationRunning(current.status.name)
            return current

        retry = Retry(
            predicate=if_exception_type(_OperationRunning, exceptions.ServiceUnavailable),
            initial=self.poll_initial_s,
            maximum=self.poll_maximum_s,
            multiplier=1.5,
            timeout=self.operation_timeout_s,
        )
        try:
            done = retry(poll)()
        except exceptions.RetryError:
            raise BatchpilotError(
                "cluster.operation_timeout_s",
                f"{what} of {subject}: operation {name} not done after {self.operation_timeout_s:g}s",
                "check the operation in the console, or raise cluster.operation_timeout_s",
            ) from None
        message = done.error.message if done.error and done.error.code else done.status_message
        if message:
            raise BatchpilotError("cluster.node_pool", f"{what} of {subject} failed: {message} ({name})")
        logger.info("%s: %s done (%s)", subject, what, name)
