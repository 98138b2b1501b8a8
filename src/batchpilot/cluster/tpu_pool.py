"""TPU slices on GKE as a `NodePool`: one node pool per slice shape, created and deleted whole.

A multi-host TPU slice node pool is atomic and immutable on GKE (GKE docs "About TPUs in GKE": nodes
cannot be added to a multi-host slice pool once it exists, and its hosts are provisioned, repaired and
removed as one unit), so a ramp-up cannot grow one pool from 2 to 8 hosts. Each node count of a plan is
instead the host count of one slice shape (`batchpilot.planning.tpu`: hosts = chips of the topology /
chips per host), and each shape gets a node pool of its own, `slice_pool_name(cluster.node_pool,
topology)` (e.g. `v6e-4x8`), created through the Container API with the machine type,
`placement_policy.tpu_topology` and a node count equal to the hosts, in one zone (GKE docs "Deploy TPU
workloads in GKE Standard").

`resize(hosts)`:
1. finds the shape of `hosts` (none: refused, naming the nearest valid host counts);
2. deletes the other slice pools batchpilot created for `cluster.node_pool` (`cluster.tpu_slice_change:
   delete-first`, the default: the previous stage's checkpoint is in the bucket, and the TPU quota then
   never has to cover two slices at once);
3. creates its pool unless one of that name and shape exists (a re-run or a KFP retry creates nothing);
4. waits until its hosts are Ready with `google.com/tpu` allocatable = chips per host;
5. with `tpu_slice_change: create-first`, deletes the other slice pools only now (the next slice comes
   up while the previous one still exists: faster, but the quota must hold both). With it the next
   launch's slice may also be brought up while the current launch trains (`create_ahead`,
   `cluster.capacity_ahead`): its resize then finds the slice up and only deletes the previous one.

`resize(0)` (the exit handler, `batchpilot pool scale-down`) deletes every slice pool batchpilot created.
batchpilot marks the pools it creates with the node label `batchpilot.dev/slice-of: <cluster.node_pool>`
and only ever deletes pools that carry it; a pool of the right name and shape without it (made by hand)
is used as it is and left in place.

That is `cluster.pool_mode: resize`. The other modes use slice pools made beforehand, one per shape,
named the same way, and never create or delete one:
- `autoscale`: `resize(hosts)` sets the shape's pool's autoscaling to 0..hosts (`setAutoscaling` with
  the per-zone `max_node_count` = hosts: GKE's autoscaler gives a multi-host slice pool either none or
  all of its hosts, "About TPUs in GKE"); its hosts come when the launch's pods are pending and go when
  they are idle, so `wait_ready` checks the bounds instead of waiting, and `resize(0)` writes nothing;
- `static`: nothing is written; `resize(hosts)` checks that the shape's pool has its hosts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from batchpilot.cluster.gke import (
    ContainerCalls,
    PoolRef,
    _container_v1,
    container_client,
    require_gke_settings,
)
from batchpilot.cluster.labels import CREATED_BY_LABEL, IDLE_POOL_LABEL, RUN_POOL_LABEL, label_value
from batchpilot.cluster.readiness import TPU_RESOURCE, PoolNodes, kube_api_client
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import TpuSlice, TpuSlices, is_zone, slice_pool_name, tpu_slices

logger = logging.getLogger(__name__)


def run_labels(run: str) -> dict[str, str]:
    """The resource labels of a slice pool created for `run` (a slice's idle size is 0: it is deleted)."""
    return {RUN_POOL_LABEL: label_value(run), IDLE_POOL_LABEL: "0"}


_REQUEST_PREFIX = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) \S+: ")


@dataclass(frozen=True)
class SlicePoolState:
    """One slice node pool as the Container API reports it.

    Attributes:
        name: the node pool's short name, e.g. `v6e-4x8`.
        topology: its `placement_policy.tpu_topology`.
        machine_type: its `config.machine_type`.
        node_count: its node count (hosts).
        created_by_batchpilot: it carries `CREATED_BY_LABEL` with this `cluster.node_pool`.
        autoscaling_max_nodes: the autoscaler's per-zone maximum (0: autoscaling off).
    """

    name: str
    topology: str
    machine_type: str
    node_count: int
    created_by_batchpilot: bool
    autoscaling_max_nodes: int = 0


def tpu_zone(cluster: ClusterConfig) -> str:
    """The zone of the slice pools: `cluster.tpu_zone` when the config has it, else `cluster.location`
    when that is a zone.

    Raises:
        BatchpilotError: the location is a region and no zone is set (a slice lives in one zone).
    """
    zone = cluster.tpu_zone
    if zone:
        return str(zone)
    location = str(cluster.location)
    if is_zone(location):
        return location
    raise BatchpilotError(
        "cluster.tpu_zone",
        f"a TPU slice node pool lives in one zone and cluster.location {location!r} is a region",
        f"set cluster.tpu_zone to a zone of {location} that offers {cluster.accelerator_type}",
    )


def tpu_node_pool(cluster: ClusterConfig, *, run: str | None = None) -> TpuSlicePool:
    """The slice pools of a TPU `cluster` with real clients: Container API (`container_client`) and
    Kubernetes (in-cluster, else kubeconfig).

    Raises:
        BatchpilotError: a missing gke setting, an unknown TPU or machine type, `devices_per_node` other
            than the chips per host, or no zone to create slices in (resize mode).
    """
    require_gke_settings(cluster)
    assert cluster.project and cluster.location and cluster.cluster_name and cluster.node_pool
    assert cluster.accelerator_type
    slices = tpu_slices(
        accelerator_type=cluster.accelerator_type,
        machine_type=cluster.machine_type,
        devices_per_node=cluster.devices_per_node,
    )
    return TpuSlicePool(
        calls=ContainerCalls(
            client=container_client(api_endpoint=cluster.container_api_endpoint),
            operation_timeout_s=cluster.operation_timeout_s,
        ),
        pool=PoolRef(cluster.project, cluster.location, cluster.cluster_name, cluster.node_pool),
        slices=slices,
        # Only resize mode creates pools; the other modes name the zone in their messages alone.
        zone=tpu_zone(cluster)
        if cluster.pool_mode == "resize"
        else str(cluster.tpu_zone or cluster.location),
        api_client=kube_api_client(),
        ready_timeout_s=cluster.ready_timeout_s,
        pool_mode=cluster.pool_mode,
        slice_change=cluster.tpu_slice_change,
        run=run,
    )


class TpuSlicePool:
    """TPU slice node pools of one `cluster.node_pool` behind the `NodePool` interface (see the module
    docstring).

    Args:
        calls: Container API calls (retries, operation polling, one-line errors).
        pool: the cluster, and `cluster.node_pool` as the base of every slice pool's name.
        slices: the TPU type and machine type, and the shapes they can form.
        zone: the zone the slice pools are created in.
        api_client: a Kubernetes ApiClient, to read the slice pools' nodes.
        ready_timeout_s: how long `resize` waits for a new slice's hosts.
        pool_mode: `cluster.pool_mode` (see the module docstring).
        slice_change: `cluster.tpu_slice_change`: delete the previous slice pool before creating the next
            (`delete-first`: quota for one slice suffices), or after the next one is ready (`create-first`:
            the next slice comes up sooner, but the quota must cover both).
        run: the run that creates slice pools: they carry it as the resource label `batchpilot-run`, so a
            slice left behind by a run whose exit hook never ran is found and deleted
            (`batchpilot.cluster.ownership`).
    """

    def __init__(
        self,
        *,
        calls: ContainerCalls,
        pool: PoolRef,
        slices: TpuSlices,
        zone: str,
        api_client: Any,
        ready_timeout_s: float,
        ready_poll_interval_s: float = 10.0,
        pool_mode: str = "resize",
        slice_change: str = "delete-first",
        run: str | None = None,
    ) -> None:
        if pool_mode not in ("resize", "autoscale", "static"):
            raise BatchpilotError("cluster.pool_mode", f"unknown mode {pool_mode!r}")
        if slice_change not in ("delete-first", "create-first"):
            raise BatchpilotError("cluster.tpu_slice_change", f"unknown order {slice_change!r}")
        self.pool_mode = pool_mode
        self.slice_change = slice_change
        self.run = run
        self.calls = calls
        self.pool = pool
        self.slices = slices
        self.zone = zone
        self.api_client = api_client
        self.ready_timeout_s = ready_timeout_s
        self.ready_poll_interval_s = ready_poll_interval_s

    def slice_pools(self) -> list[SlicePoolState]:
        """The cluster's slice pools of `cluster.node_pool`: every pool batchpilot created for it, and
        any pool named as one of its shapes would be (`slice_pool_name`)."""
        response = self.calls.call(
            "list node pools",
            self.calls.client.list_node_pools,
            {"parent": self.pool.parent},
            target=self.pool.parent,
            missing_field="cluster.cluster_name",
        )
        shape_names = {slice_pool_name(self.pool.node_pool, shape.topology) for shape in self.slices.slices}
        found = []
        for node_pool in response.node_pools:
            ours = node_pool.config.labels.get(CREATED_BY_LABEL) == self.pool.node_pool
            if ours or node_pool.name in shape_names:
                scaling = node_pool.autoscaling
                found.append(
                    SlicePoolState(
                        name=node_pool.name,
                        topology=node_pool.placement_policy.tpu_topology,
                        machine_type=node_pool.config.machine_type,
                        node_count=node_pool.initial_node_count,
                        created_by_batchpilot=ours,
                        autoscaling_max_nodes=scaling.max_node_count if scaling.enabled else 0,
                    )
                )
        return sorted(found, key=lambda state: state.name)

    def current_size(self) -> int:
        """Nodes of the slice pools registered with Kubernetes, whatever their state (0 if none; two
        slices only while a resize is under way)."""
        return sum(len(self._nodes(state.name).states()) for state in self.slice_pools())

    def resize(self, num_nodes: int) -> None:
        """resize mode: brings up the slice of `num_nodes` hosts, waits for its nodes, then deletes the
        other slice pools batchpilot created; 0 deletes them all. autoscale mode: sets the autoscaling
        bounds of the shape's pool. static mode: checks the shape's pool has the hosts."""
        if num_nodes < 0:
            raise BatchpilotError("--nodes", f"{num_nodes} is negative", "give 0 or more nodes")
        if self.pool_mode == "autoscale":
            self._set_autoscaling(num_nodes)
            return
        if self.pool_mode == "static":
            self._check_static(num_nodes)
            return
        pools = self.slice_pools()
        if num_nodes == 0:
            self._delete(state for state in pools if state.created_by_batchpilot)
            return
        shape = self.slices.for_hosts(num_nodes)
        name = slice_pool_name(self.pool.node_pool, shape.topology)
        existing = next((state for state in pools if state.name == name), None)
        others = [state for state in pools if state.created_by_batchpilot and state.name != name]
        if self.slice_change == "delete-first":
            # The previous stage checkpointed to the bucket: its slice is idle, and deleting it first means
            # the project's TPU quota never has to cover two slices at once.
            self._delete(others)
        self._bring_up(shape, name, existing)
        if self.slice_change == "create-first":
            self._delete(others)

    def create_ahead(self, num_nodes: int) -> int:
        """resize mode with `create-first`: brings up the slice of `num_nodes` hosts for the next launch while
        the current one trains on its own slice, which stays (the next launch's `resize` deletes it, once its
        slice is up: here it already is). Returns the hosts of every slice pool then up."""
        if self.pool_mode != "resize" or self.slice_change != "create-first":
            raise BatchpilotError(
                "cluster.tpu_slice_change",
                f"is {self.slice_change} (pool_mode {self.pool_mode}): a slice asked for ahead would stand "
                "beside the current one",
                "set cluster.tpu_slice_change: create-first (the TPU quota must hold both slices), or "
                "cluster.capacity_ahead: off",
            )
        shape = self.slices.for_hosts(num_nodes)
        name = slice_pool_name(self.pool.node_pool, shape.topology)
        self._bring_up(shape, name, next((state for state in self.slice_pools() if state.name == name), None))
        return self.current_size()

    def _bring_up(self, shape: TpuSlice, name: str, existing: SlicePoolState | None) -> None:
        """Creates the pool of `shape` unless it exists (`existing`, checked against the shape), then waits
        until its hosts are Ready with their chips."""
        if existing is None:
            existing = self._create(shape, name)
        if existing is not None:
            self._check_shape(existing, shape)
        self._nodes(name).wait(
            shape.hosts, timeout_s=self.ready_timeout_s, poll_interval_s=self.ready_poll_interval_s
        )

    def wait_ready(self, num_nodes: int, *, timeout_s: float) -> None:
        """Waits until the slice of `num_nodes` hosts has them Ready with their chips allocatable; in
        autoscale mode checks that the autoscaler may bring them up instead (it does when the launch's
        pods are pending, so nothing can be waited for before the launch)."""
        if num_nodes == 0:
            return
        shape = self.slices.for_hosts(num_nodes)
        name = slice_pool_name(self.pool.node_pool, shape.topology)
        if self.pool_mode == "autoscale":
            state = self._precreated(shape, name)
            if state.autoscaling_max_nodes != shape.hosts:
                raise BatchpilotError(
                    "cluster.pool_mode",
                    f"{name} autoscales to at most {state.autoscaling_max_nodes} node(s); its slice needs "
                    f"{shape.hosts}",
                    f"run `batchpilot pool resize --nodes {num_nodes}` (autoscale mode sets the bounds)",
                )
            logger.info(
                "%s: autoscaling admits its %d host(s); they come when the pods are pending", name, num_nodes
            )
            return
        self._nodes(name).wait(num_nodes, timeout_s=timeout_s, poll_interval_s=self.ready_poll_interval_s)

    def describe(self) -> str:
        """The TPU type, zone and every slice pool with its node states."""
        parts = []
        for state in self.slice_pools():
            usable, problems = self._nodes(state.name).usable()
            owner = "batchpilot's" if state.created_by_batchpilot else "not batchpilot's"
            parts.append(
                f"{state.name} ({state.topology}, {state.node_count} host(s), {owner}): "
                f"{len(usable) + len(problems)} node(s), {len(usable)} usable"
                + (f"; {'; '.join(problems)}" if problems else "")
            )
        return (
            f"gke tpu slices {self.pool.parent}/nodePools/{self.pool.node_pool}-* "
            f"(mode {self.pool_mode}, {self.slices.tpu.label} {self.slices.machine.name}, zone {self.zone}): "
            + (", ".join(parts) if parts else "no slice pool")
        )

    def _nodes(self, name: str) -> PoolNodes:
        return PoolNodes(
            api_client=self.api_client,
            node_pool=name,
            gpus_per_node=self.slices.chips_per_host,
            device_resource=TPU_RESOURCE,
        )

    def _create(self, shape: TpuSlice, name: str) -> SlicePoolState | None:
        """Creates the pool of `shape`; returns the pool found instead when another attempt created it
        first (None: created here)."""
        from google.api_core import exceptions

        container_v1 = _container_v1()
        node_pool = container_v1.NodePool(
            name=name,
            initial_node_count=shape.hosts,
            locations=[self.zone],
            config=container_v1.NodeConfig(
                machine_type=shape.machine_type,
                labels={CREATED_BY_LABEL: self.pool.node_pool},
                resource_labels=run_labels(self.run) if self.run else {},
            ),
            placement_policy=container_v1.NodePool.PlacementPolicy(tpu_topology=shape.topology),
        )
        request = container_v1.CreateNodePoolRequest(parent=self.pool.parent, node_pool=node_pool)
        what = f"create node pool {name}"
        try:
            operation = self.calls.call(
                what, self.calls.client.create_node_pool, request, target=self.pool.parent
            )
        except (exceptions.AlreadyExists, exceptions.Conflict):
            logger.info("%s: created meanwhile by another attempt; using it", name)
            return next((state for state in self.slice_pools() if state.name == name), None)
        except (exceptions.BadRequest, exceptions.InvalidArgument) as error:
            raise _refused(what, error.message, pool_name=name) from None
        self.calls.wait_operation(
            self.pool.operation_name(operation.name),
            what=f"create {shape.topology} slice ({shape.hosts} {shape.machine_type} host(s))",
            subject=name,
        )
        return None

    def _precreated(self, shape: TpuSlice, name: str) -> SlicePoolState:
        """The pre-made pool of `shape` (autoscale and static modes), checked against it."""
        state = next((state for state in self.slice_pools() if state.name == name), None)
        if state is None:
            raise BatchpilotError(
                "cluster.pool_mode",
                f"{self.pool_mode} mode uses a slice pool made beforehand for each shape, and {name} "
                f"(the {shape.topology} slice of {shape.hosts} {shape.machine_type} host(s)) does not exist",
                f"create it (machine type {shape.machine_type}, TPU topology {shape.topology}, zone "
                f"{self.zone}{', autoscaling 0..' + str(shape.hosts) if self.pool_mode == 'autoscale' else ''}), "
                "or use pool_mode resize to let batchpilot create each slice",
            )
        if (state.topology, state.machine_type) != (shape.topology, shape.machine_type):
            raise BatchpilotError(
                "cluster.node_pool",
                f"node pool {name} has machine type {state.machine_type} and topology "
                f"{state.topology or 'none'}, not the {shape.topology} slice of {shape.machine_type}",
                f"recreate node pool {name} with that shape, or set another cluster.node_pool",
            )
        return state

    def _set_autoscaling(self, num_nodes: int) -> None:
        if num_nodes == 0:
            logger.info(
                "%s-*: autoscale mode: the cluster autoscaler removes each slice once it is idle; nothing "
                "to set",
                self.pool.node_pool,
            )
            return
        shape = self.slices.for_hosts(num_nodes)
        name = slice_pool_name(self.pool.node_pool, shape.topology)
        self._precreated(shape, name)
        container_v1 = _container_v1()
        # GKE checks a slice's autoscaling by the per-zone maximum (a slice pool has one zone): the
        # autoscaler then keeps 0 or all of its hosts.
        autoscaling = container_v1.NodePoolAutoscaling(
            enabled=True, min_node_count=0, max_node_count=shape.hosts
        )
        ref = replace(self.pool, node_pool=name)
        request = container_v1.SetNodePoolAutoscalingRequest(name=ref.name, autoscaling=autoscaling)
        operation = self.calls.call(
            "set autoscaling", self.calls.client.set_node_pool_autoscaling, request, target=ref.name
        )
        self.calls.wait_operation(
            self.pool.operation_name(operation.name),
            what=f"autoscaling bounds [0, {shape.hosts}]",
            subject=name,
        )

    def _check_static(self, num_nodes: int) -> None:
        if num_nodes == 0:
            logger.info("%s-*: static mode: slice pools are never changed", self.pool.node_pool)
            return
        shape = self.slices.for_hosts(num_nodes)
        name = slice_pool_name(self.pool.node_pool, shape.topology)
        self._precreated(shape, name)
        have = len(self._nodes(name).states())
        if have < shape.hosts:
            raise BatchpilotError(
                "cluster.pool_mode",
                f"static slice pool {name} has {have} node(s), its slice needs {shape.hosts}; static mode "
                "never resizes",
                "bring the slice up yourself, or use pool_mode resize or autoscale",
            )
        logger.info("%s: static slice pool not changed; it has its %d host(s)", name, shape.hosts)

    def _check_shape(self, state: SlicePoolState, shape: TpuSlice) -> None:
        if (state.topology, state.machine_type, state.node_count) != (
            shape.topology,
            shape.machine_type,
            shape.hosts,
        ):
            raise BatchpilotError(
                "cluster.node_pool",
                f"node pool {state.name} exists as {state.node_count} {state.machine_type} host(s) with "
                f"topology {state.topology or 'none'}, not the {shape.topology} slice of {shape.hosts} "
                f"{shape.machine_type} host(s)",
                f"delete node pool {state.name}, or set another cluster.node_pool",
            )
        if not state.created_by_batchpilot:
            logger.info("%s: using this existing pool; batchpilot did not create it and keeps it", state.name)

    def _delete(self, states: Iterable[SlicePoolState]) -> None:
        container_v1 = _container_v1()
        for state in states:
            ref = replace(self.pool, node_pool=state.name)
            request = container_v1.DeleteNodePoolRequest(name=ref.name)
            operation = self.calls.call(
                "delete node pool", self.calls.client.delete_node_pool, request, target=ref.name
            )
            self.calls.wait_operation(
                self.pool.operation_name(operation.name),
                what=f"delete {state.topology} slice ({state.node_count} host(s))",
                subject=state.name,
            )


def _refused(what: str, message: str, *, pool_name: str) -> BatchpilotError:
    """GKE's refusal of a create request as one line naming the setting to change."""
    # The REST transport prefixes GKE's message with the request ("POST https://...: ").
    text = " ".join(_REQUEST_PREFIX.sub("", message).split())
    if "node_pool.name" in text:
        return BatchpilotError(
            "cluster.node_pool",
            f"GKE refused to {what}: {text}",
            f"use a shorter cluster.node_pool: a slice pool's name is it plus -<topology> ({pool_name})",
        )
    return BatchpilotError(
        "cluster",
        f"GKE refused to {what}: {text}",
        "check cluster.accelerator_type, machine_type and the zone against GKE's TPU availability",
    )
