"""A local server speaking the few routes of the GKE Container API (REST, v1) that batchpilot uses.

Routes: nodePools list, create, get, delete, `:setSize`, `:setAutoscaling`, and operations get. Each
write starts an operation that reports RUNNING for `polls_until_done` polls, then DONE. Faults are
scripted: `conflicts` writes answer 400 FAILED_PRECONDITION as GKE does while another operation runs,
and `deny` answers 403 PERMISSION_DENIED. Every request is recorded (method, path, query, JSON body) so
tests can check what the real client sent.

With `ContainerState.sim` (a `cluster_sim.ClusterSim`; `container_server_running(sim=...)`), a pool
added with a `machine_type` is a pool of the simulated cluster: `:setSize` (nodes per zone) creates
and deletes its Node objects there, and `:setAutoscaling` hands its bounds to the simulated cluster
autoscaler. The pool's `config.machineType` (and `config.accelerators`) is served as GKE does. A pool
created through the API gets its nodes there at once, and deleting a pool removes them.

TPU slice node pools (machine types in `gke_nodes.TPU_MACHINES`) follow GKE's rules; the wording of
the refusals is GKE's where a real message was seen (quoted below), else modelled on it:
- create (GKE docs "Deploy TPU workloads in GKE Standard", "Plan TPUs in GKE"):
  `placementPolicy.tpuTopology` must be a topology of the machine type; a multi-host slice (more than
  one VM) needs a node count of zero or chips of the topology / chips per VM, and one zone (inferred,
  not quoted: the docs create every multi-host slice pool with a single `--node-locations` zone);
- a multi-host slice pool cannot be resized (GKE docs "About TPUs in GKE": once a multi-host slice
  node pool exists, nodes cannot be added to it, and its hosts are one atomic unit; another shape
  takes a new node pool): `:setSize` is refused, to 0 as well (inferred: the docs do not say whether
  GKE accepts a resize of a slice to 0, so the stand-in takes the stricter reading and batchpilot
  deletes slice pools instead of resizing them);
- autoscaling of a multi-host slice goes between 0 and the whole slice ("About TPUs in GKE":
  the autoscaler gives such a pool exactly 0 or all of its hosts), and GKE checks the per-zone
  maximum: "Maximum node count 0 is not a valid size of TPU pod slice with topology 2x2x2" (GKE's
  answer when only totalMaxNodeCount was set, quoted in vllm-project/ci-infra pull request 545);
- node pool names: GKE's own refusal, `Invalid value for field "node_pool.name": ... Must be a match
  of regex '(?:[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?)' ...` (quoted in pulumi/pulumi-gcp issue 1510);
  a second pool of one name: 409 ALREADY_EXISTS.
Capacity (`zone_capacity`, `accelerator_quota`), the rules of Compute Engine under a node pool:
- a stockout: the pool's instance group asks for the target size but a zone has only so many VMs of
  the machine type; the rest are never created (Compute Engine's ZONE_RESOURCE_POOL_EXHAUSTED, worded
  "The zone 'projects/P/zones/Z' does not have enough resources available to fulfill the request. Try a
  different zone, or try again later." as quoted in googlefonts/fontbakery-dashboard issue 81), and
  the node pool reports it as a `conditions` entry with code GCE_STOCKOUT (the Container API's
  `StatusCondition.Code`, with canonical code RESOURCE_EXHAUSTED); `:setSize` itself succeeds;
- a regional accelerator quota: a create or `:setSize` that would take the region's GPUs or TPU chips
  of one type above the quota is refused with 403 "Insufficient regional quota to satisfy request:
  resource ..." (GKE's wording for node pool and cluster creation, e.g. "resource "NVIDIA_T4_GPUS":
  request requires '1.0' and is short '1.0'. project has a quota of '0.0' with '0.0' available");
- `:setSize` on a pool whose autoscaling is enabled is refused (FAILED_PRECONDITION): the cluster
  autoscaler owns that pool's size. This rule is the #20 review's reading of GKE, not a quote: no
  public GKE error text for it was found, so the wording here is the stand-in's own.
Queued provisioning (GKE "Run a large-scale workload with flex-start with queued provisioning"): a pool
created with it serves `queuedProvisioning.enabled: true`; its creation needs no reservation affinity
(GKE's 400 "Queued_provisioning requires reservation affinity to be set to none", quoted in
hashicorp/terraform-provider-google issue 18341); such a pool is autoscaled, so `:setSize` is refused
by the autoscaling rule above; its nodes come and go with ProvisioningRequests (`provisioning_controller.py`).
Nodes of TPU pools carry the TPU labels, `google.com/tpu` and the TPU taint (`gke_nodes.py`); their
topology label and a created pool's own labels need the simulated cluster to be a `GkeClusterSim`
(`gke_sim.simulated_gke` makes one).

Compute Engine's `regions.get` (`GET /compute/v1/projects/P/regions/R`, Compute Engine API v1 reference)
is served here too, for code that reads a region's quotas from the same emulator: a `compute#region`
with `quotas[]` of `{metric, limit, usage}`, one GPU metric per type in `accelerator_quota` (the name in
`COMPUTE_GPU_METRICS`, usage counted from the pools, `region_usage` adding GPUs used elsewhere), and the
same name prefixed `PREEMPTIBLE_` per type in `preemptible_quota`, which Spot, preemptible and flex-start VMs
count against (Compute Engine "Preemptible quotas"; GKE "About flex-start provisioning mode").

Point `google.cloud.container_v1.ClusterManagerClient` at it with `transport="rest"`,
`client_options={"api_endpoint": server.endpoint}` and anonymous credentials.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cluster_sim import ClusterSim
from gke_nodes import MACHINES, TPU_MACHINES, tpu_hosts, tpu_topology_problem
from loopback_http import QuietHandler, serving

POOLS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)/nodePools$")
POOL = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)/nodePools/([^/:]+)(:\w+)?$")
OPERATION = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/operations/([^/]+)$")
REGION = re.compile(r"^/compute/v1/projects/([^/]+)/regions/([^/]+)$")
# regions.get's GPU quota metric per GKE accelerator type: the names of the Compute Engine v1 API's
# Quota.Metric enum (NVIDIA_H100_GPUS for nvidia-h100-80gb, NVIDIA_A100_80GB_GPUS for nvidia-a100-80gb, ...).
COMPUTE_GPU_METRICS = {
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
}
# The client asks for `$alt=json;enum-encoding=int`, so enums go out as their numbers
# (Operation.Status RUNNING/DONE, NodePool.Status RUNNING, Operation.Type values).
STATUS_RUNNING, STATUS_DONE = 2, 3
TYPE_CREATE_NODE_POOL, TYPE_DELETE_NODE_POOL = 7, 8
TYPE_SET_NODE_POOL_MANAGEMENT, TYPE_SET_NODE_POOL_SIZE = 9, 14
POOL_NAME = re.compile(r"(?:[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?)")  # GKE's own pattern, see above
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"


@dataclass
class GkeClusterSim(ClusterSim):
    """The simulated cluster plus node labels that only GKE's node pools know: a pool's own Kubernetes
    labels (`config.labels`; GKE docs "About node labels": GKE applies them to the pool's nodes) and a
    TPU slice pool's topology as `cloud.google.com/gke-tpu-topology` (GKE docs "About TPUs in GKE")."""

    pool_labels: dict[str, dict[str, str]] = field(default_factory=dict)  # node pool -> its labels

    def node_objects(self) -> list[dict[str, Any]]:
        nodes = super().node_objects()
        for node in nodes:
            labels = node["metadata"]["labels"]
            labels.update(self.pool_labels.get(labels["cloud.google.com/gke-nodepool"], {}))
        return nodes


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: dict[str, Any] | None


@dataclass
class ContainerState:
    """The fake's world: one cluster's node pools, operations, scripted faults and the request log."""

    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)
    polls: dict[str, int] = field(default_factory=dict)
    polls_until_done: int = 2
    conflicts: int = 0
    deny: bool = False
    fail_operation: str | None = None
    zone_capacity: dict[str, int] = field(default_factory=dict)  # zone -> VMs it can still create per pool
    accelerator_quota: dict[str, int] = field(default_factory=dict)  # accelerator type -> region's devices
    preemptible_quota: dict[str, int] = field(default_factory=dict)  # the same, for Spot/flex-start VMs
    region_usage: dict[str, int] = field(default_factory=dict)  # accelerator type -> devices used elsewhere
    requests: list[Request] = field(default_factory=list)
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)
    sim: ClusterSim | None = None

    def add_pool(
        self,
        name: str,
        *,
        locations: list[str],
        node_count: int = 0,
        machine_type: str | None = None,
        queued_provisioning: bool = False,
        autoscaling: dict[str, Any] | None = None,
    ) -> None:
        """Adds `projects/P/locations/L/clusters/C/nodePools/NAME`-style pool named by its full name.

        With a simulator, `machine_type` (a key of `gke_nodes.MACHINES`) makes it a simulated pool
        with `node_count` nodes per zone. `queued_provisioning` makes it a pool created with
        `--flex-start --enable-queued-provisioning` (`NodePool.queuedProvisioning.enabled`, GKE "Run a
        large-scale workload with flex-start with queued provisioning"), whose nodes only ProvisioningRequests
        bring (`provisioning_controller.py`); `autoscaling` is its NodePoolAutoscaling (REST field names).
        """
        short = name.rsplit("/", 1)[-1]
        self.pools[name] = {
            "name": short,
            "locations": locations,
            "initialNodeCount": node_count,
            "status": STATUS_RUNNING,
            "autoscaling": {},
            "nodeCountPerZone": node_count,
        }
        if machine_type is not None:
            machine = MACHINES[machine_type]
            config: dict[str, Any] = {"machineType": machine_type}
            if machine.gpus:
                config["accelerators"] = [
                    {"acceleratorCount": str(machine.gpus), "acceleratorType": machine.accelerator}
                ]
            self.pools[name]["config"] = config
            if self.sim is not None:
                self.sim.add_pool(short, zones=locations, machine_type=machine_type)
                self.sim.resize_pool(short, per_zone=node_count)
        if queued_provisioning:
            self.pools[name]["queuedProvisioning"] = {"enabled": True}
            if self.sim is not None and self.sim.provisioning is not None:
                self.sim.provisioning.queued_pools.add(short)
        if autoscaling is not None:
            self.pools[name]["autoscaling"] = dict(autoscaling)
            if self.sim is not None and short in self.sim.pools:
                self.sim.set_autoscaling(short, dict(autoscaling))


def _error(code: int, status: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "status": status}}


def _invalid(message: str) -> tuple[int, dict[str, Any]]:
    return _error(400, "INVALID_ARGUMENT", message)


def _slice(pool: dict[str, Any]) -> tuple[str, int] | None:
    """(topology, hosts) of a TPU pool (None: not a TPU pool)."""
    machine_type = pool.get("config", {}).get("machineType", "")
    if machine_type not in TPU_MACHINES:
        return None
    topology = pool.get("placementPolicy", {}).get("tpuTopology") or TPU_MACHINES[machine_type].single_host
    return topology, tpu_hosts(machine_type, topology)


def tpu_create_problem(pool: dict[str, Any]) -> str | None:
    """Why GKE refuses to create this TPU pool (None: it does not, or it is no TPU pool)."""
    machine_type = pool.get("config", {}).get("machineType", "")
    topology = pool.get("placementPolicy", {}).get("tpuTopology")
    if machine_type not in TPU_MACHINES:
        if topology:
            return (
                f'Invalid value for field "node_pool.placement_policy.tpu_topology": "{topology}". '
                f"Machine type {machine_type} has no TPU."
            )
        return None
    if topology and (problem := tpu_topology_problem(machine_type, topology)):
        return f'Invalid value for field "node_pool.placement_policy.tpu_topology": "{topology}" {problem}.'
    found = _slice(pool)
    assert found is not None
    topology, hosts = found
    count = int(pool.get("initialNodeCount", 0))
    if hosts > 1 and count not in (0, hosts):
        return f"Node count {count} is not a valid size of TPU pod slice with topology {topology}"
    if hosts > 1 and len(pool.get("locations", [])) != 1:
        return (
            f'Invalid value for field "node_pool.locations": {pool.get("locations", [])}. A multi-host TPU '
            f"slice node pool (topology {topology}) must be in exactly one zone."
        )
    return None


def tpu_resize_problem(pool: dict[str, Any]) -> str | None:
    """Why GKE refuses `:setSize` on this pool (None: it does not)."""
    found = _slice(pool)
    if found is None or found[1] == 1:
        return None
    topology, hosts = found
    return (
        f"Node pool {pool['name']} is a multi-host TPU slice (topology {topology}, {hosts} nodes) and cannot "
        "be resized; create a node pool of another topology instead."
    )


def tpu_autoscaling_problem(pool: dict[str, Any], autoscaling: dict[str, Any]) -> str | None:
    """Why GKE refuses these autoscaling settings on this pool (None: it does not)."""
    found = _slice(pool)
    if found is None or found[1] == 1 or not autoscaling.get("enabled"):
        return None
    topology, hosts = found
    maximum = int(autoscaling.get("maxNodeCount", 0))
    if maximum != hosts:
        return f"Maximum node count {maximum} is not a valid size of TPU pod slice with topology {topology}"
    return None


def _accelerator(pool: dict[str, Any]) -> tuple[str, int] | None:
    """(accelerator type, devices per node) of a pool's machine type (None: no GPU or TPU)."""
    machine = MACHINES.get(pool.get("config", {}).get("machineType", ""))
    if machine is None or not machine.accelerator:
        return None
    return machine.accelerator, machine.gpus or machine.tpu_chips


def _quota_resource(accelerator: str) -> str:
    """The quota's name as Compute Engine spells it: a GPU's regions.get metric (NVIDIA_H100_GPUS for
    nvidia-h100-80gb), else e.g. TPU_V6E_SLICE_CHIPS."""
    if accelerator in COMPUTE_GPU_METRICS:
        return COMPUTE_GPU_METRICS[accelerator]
    unit = "CHIPS" if accelerator.startswith("tpu-") else "GPUS"
    return f"{accelerator.upper().replace('-', '_')}_{unit}"


def quota_problem(state: ContainerState, pool: dict[str, Any], *, nodes: int, replacing: bool) -> str | None:
    """GKE's refusal when `nodes` nodes of `pool` would take the region's accelerators above the quota
    (`replacing`: the pool's own nodes are counted at the new size, not added to the old one)."""
    found = _accelerator(pool)
    if found is None or found[0] not in state.accelerator_quota:
        return None
    accelerator, per_node = found
    quota = state.accelerator_quota[accelerator]
    used = sum(
        (_accelerator(other) or ("", 0))[1]
        * other.get("nodeCountPerZone", 0)
        * len(other.get("locations", []))
        for other in state.pools.values()
        if (_accelerator(other) or ("",))[0] == accelerator and not (replacing and other is pool)
    )
    required = nodes * per_node
    if used + required <= quota:
        return None
    available = max(quota - used, 0)
    return (
        f'Insufficient regional quota to satisfy request: resource "{_quota_resource(accelerator)}": request '
        f"requires '{required:.1f}' and is short '{required - available:.1f}'. project has a quota of "
        f"'{quota:.1f}' with '{available:.1f}' available."
    )


def region(state: ContainerState, name: str) -> tuple[int, dict[str, Any]]:
    """regions.get: the region with the GPU quotas of `accelerator_quota` (limit) and their usage."""
    quotas = []
    for accelerator, limit in state.accelerator_quota.items():
        if accelerator not in COMPUTE_GPU_METRICS:
            continue
        used = state.region_usage.get(accelerator, 0) + sum(
            found[1] * other.get("nodeCountPerZone", 0) * len(other.get("locations", []))
            for other in state.pools.values()
            if (found := _accelerator(other)) and found[0] == accelerator
        )
        metric = COMPUTE_GPU_METRICS[accelerator]
        quotas.append({"metric": metric, "limit": float(limit), "usage": float(used)})
    for accelerator, limit in state.preemptible_quota.items():
        if accelerator in COMPUTE_GPU_METRICS:
            metric = f"PREEMPTIBLE_{COMPUTE_GPU_METRICS[accelerator]}"
            quotas.append({"metric": metric, "limit": float(limit), "usage": 0.0})
    return 200, {"kind": "compute#region", "name": name, "status": "UP", "quotas": quotas}


def stockout(state: ContainerState, pool: dict[str, Any], *, per_zone: int) -> dict[str, int]:
    """The nodes each zone can create for `pool` (its `zone_capacity`); sets or clears the pool's
    GCE_STOCKOUT condition (`StatusCondition`: code 1 GCE_STOCKOUT, canonical code 8 RESOURCE_EXHAUSTED)."""
    granted = {zone: min(per_zone, state.zone_capacity.get(zone, per_zone)) for zone in pool["locations"]}
    short = [zone for zone, count in granted.items() if count < per_zone]
    pool["conditions"] = [
        {
            "code": 1,
            "canonicalCode": 8,
            "message": f"ZONE_RESOURCE_POOL_EXHAUSTED: The zone 'projects/proj/zones/{zone}' does not have enough "
            "resources available to fulfill the request. Try a different zone, or try again later.",
        }
        for zone in short
    ]
    return granted


def autoscaled_resize_problem(pool: dict[str, Any]) -> str:
    return (
        f"Node pool {pool['name']} has autoscaling enabled; its size is set by the cluster autoscaler. "
        "Disable autoscaling to resize it."
    )


class _Handler(QuietHandler):
    state: ContainerState  # set on the subclass made per server

    def _record(self) -> Request:
        parts = urlsplit(self.path)
        data = self.read_body()
        body = json.loads(data) if data else None
        request = Request(self.command, parts.path, parse_qs(parts.query), body)
        with self.state.lock:
            self.state.requests.append(request)
        return request

    def do_GET(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = self._get(request.path)
        self.reply(code, payload)

    def do_POST(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = self._post(request.path, request.body or {})
        self.reply(code, payload)

    def do_DELETE(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = self._delete(request.path)
        self.reply(code, payload)

    def do_PUT(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = update_node_pool(self, request.path, request.body or {})
        self.reply(code, payload)

    def _get(self, path: str) -> tuple[int, dict[str, Any]]:
        state = self.state
        if match := REGION.match(path):
            return region(state, match.group(2))
        if POOLS.match(path):
            parent = path.removeprefix("/v1/").removesuffix("/nodePools")
            pools = [_served(pool) for full, pool in state.pools.items() if full.startswith(f"{parent}/")]
            return 200, {"nodePools": pools} if pools else {}
        if match := POOL.match(path):
            if match.group(5):
                return _error(404, "NOT_FOUND", "no such method")
            full = path.removeprefix("/v1/")
            if full not in state.pools:
                return _error(404, "NOT_FOUND", f"Not found: {full}.")
            return 200, _served(state.pools[full])
        if match := OPERATION.match(path):
            name = match.group(3)
            if name not in state.operations:
                return _error(404, "NOT_FOUND", f"Not found: operation {name}.")
            state.polls[name] = state.polls.get(name, 0) + 1
            operation = dict(state.operations[name])
            if state.polls[name] >= state.polls_until_done:
                operation["status"] = STATUS_DONE
                if state.fail_operation:
                    operation["error"] = {"code": 9, "message": state.fail_operation}
            return 200, operation
        return _error(404, "NOT_FOUND", f"no route {path}")

    def _refused(self, full: str, cluster: str, *, must_exist: bool) -> tuple[int, dict[str, Any]] | None:
        """The scripted faults and a missing pool, in the order GKE checks them."""
        state = self.state
        if state.deny:
            return _error(
                403,
                "PERMISSION_DENIED",
                f'Required "container.clusters.update" permission(s) for "{full.rsplit("/nodePools", 1)[0]}".',
            )
        if must_exist and full not in state.pools:
            return _error(404, "NOT_FOUND", f"Not found: {full}.")
        if state.conflicts > 0:
            state.conflicts -= 1
            return _error(
                400,
                "FAILED_PRECONDITION",
                f"Operation operation-9999 is currently upgrading cluster {cluster}. "
                "Please wait and try again once it is done.",
            )
        return None

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if match := POOLS.match(path):
            parent = path.removeprefix("/v1/").removesuffix("/nodePools")
            name = str(body.get("nodePool", {}).get("name", ""))
            if refused := self._refused(f"{parent}/nodePools/{name}", match.group(3), must_exist=False):
                return refused
            return self._create(parent, dict(body.get("nodePool", {})), location=match.group(2))
        match = POOL.match(path)
        if not match or match.group(5) not in (":setSize", ":setAutoscaling"):
            return _error(404, "NOT_FOUND", f"no route {path}")
        full = path.removeprefix("/v1/").rsplit(":", 1)[0]
        if refused := self._refused(full, match.group(3), must_exist=True):
            return refused
        state = self.state
        pool = state.pools[full]
        simulated = state.sim is not None and pool["name"] in state.sim.pools
        if match.group(5) == ":setSize":
            if problem := tpu_resize_problem(pool):
                return _invalid(problem)
            if (pool.get("autoscaling") or {}).get("enabled"):
                return _error(400, "FAILED_PRECONDITION", autoscaled_resize_problem(pool))
            count = int(body.get("nodeCount", 0))
            if short := quota_problem(state, pool, nodes=count * len(pool["locations"]), replacing=True):
                return _error(403, "FORBIDDEN", short)
            pool["nodeCountPerZone"] = count
            kind = TYPE_SET_NODE_POOL_SIZE
            granted = stockout(state, pool, per_zone=count)
            if simulated:
                assert state.sim is not None
                state.sim.resize_pool(pool["name"], per_zone=count, granted=granted)
        else:
            if problem := tpu_autoscaling_problem(pool, body.get("autoscaling", {})):
                return _invalid(problem)
            pool["autoscaling"] = body.get("autoscaling", {})
            kind = TYPE_SET_NODE_POOL_MANAGEMENT
            if simulated:
                assert state.sim is not None
                state.sim.set_autoscaling(pool["name"], pool["autoscaling"])
        return 200, self._operation(kind, location=match.group(2), target=full)

    def _create(self, parent: str, pool: dict[str, Any], *, location: str) -> tuple[int, dict[str, Any]]:
        state = self.state
        name = str(pool.get("name", ""))
        full = f"{parent}/nodePools/{name}"
        if not POOL_NAME.fullmatch(name):
            return _invalid(
                f'Invalid value for field "node_pool.name": "{name}". Must be a match of regex '
                "'(?:[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?)' (only lowercase alphanumerics and '-' allowed, "
                "must start with a letter and end with an alphanumeric, and must be no longer than 40 "
                "characters)."
            )
        if full in state.pools:
            return _error(409, "ALREADY_EXISTS", f"Already exists: {full}.")
        if problem := tpu_create_problem(pool):
            return _invalid(problem)
        affinity = pool.get("config", {}).get("reservationAffinity", {}).get("consumeReservationType")
        if pool.get("queuedProvisioning", {}).get("enabled") and affinity not in ("NO_RESERVATION", 1):
            return _invalid("Queued_provisioning requires reservation affinity to be set to none")
        count = int(pool.get("initialNodeCount", 0))
        if short := quota_problem(state, pool, nodes=count * len(pool.get("locations", [])), replacing=False):
            return _error(403, "FORBIDDEN", short)
        pool.update(status=STATUS_RUNNING, nodeCountPerZone=count)
        pool.setdefault("autoscaling", {})
        state.pools[full] = pool
        machine_type = pool.get("config", {}).get("machineType")
        if state.sim is not None and machine_type in MACHINES:
            sim = state.sim
            sim.add_pool(name, zones=list(pool.get("locations", [])), machine_type=machine_type)
            labels = dict(pool.get("config", {}).get("labels", {}))
            if (found := _slice(pool)) is not None:
                labels[TOPOLOGY_LABEL] = found[0]
            if labels:
                assert isinstance(sim, GkeClusterSim), "pools with node labels need a GkeClusterSim"
                sim.pool_labels[name] = labels
            sim.resize_pool(name, per_zone=count)
            if pool.get("queuedProvisioning", {}).get("enabled") and sim.provisioning is not None:
                sim.provisioning.queued_pools.add(name)
            if pool["autoscaling"]:
                sim.set_autoscaling(name, pool["autoscaling"])
        return 200, self._operation(TYPE_CREATE_NODE_POOL, location=location, target=full)

    def _delete(self, path: str) -> tuple[int, dict[str, Any]]:
        state = self.state
        match = POOL.match(path)
        if not match or match.group(5):
            return _error(404, "NOT_FOUND", f"no route {path}")
        full = path.removeprefix("/v1/")
        if refused := self._refused(full, match.group(3), must_exist=True):
            return refused
        name = state.pools.pop(full)["name"]
        if state.sim is not None and name in state.sim.pools:
            sim = state.sim
            with sim.lock:  # the pool's nodes go with it, and their pods with them
                sim.resize_pool(name, per_zone=0)
                del sim.pools[name]
                if isinstance(sim, GkeClusterSim):
                    sim.pool_labels.pop(name, None)
        return 200, self._operation(TYPE_DELETE_NODE_POOL, location=match.group(2), target=full)

    def _operation(self, kind: int, *, location: str, target: str) -> dict[str, Any]:
        """A new operation on `target`, RUNNING until polled `polls_until_done` times."""
        state = self.state
        name = f"operation-{next(state.ids)}"
        state.operations[name] = {
            "name": name,
            "operationType": kind,
            "status": STATUS_RUNNING,
            "location": location,
            "targetLink": f"https://container.example/v1/{target}",
        }
        return state.operations[name]


# --- updateNodePool: resource labels -------------------------------------------------------------
# Container API v1 reference, projects.locations.clusters.nodePools.update: `PUT
# /v1/{name=projects/*/locations/*/clusters/*/nodePools/*}` with an UpdateNodePoolRequest body, answered
# with an Operation; `resourceLabels` (ResourceLabels: "Collection of GCP labels", a `labels` map) are
# "the resource labels for the node pool to use to annotate any related Google Compute Engine
# resources", and the pool serves them as `config.resourceLabels` (NodeConfig). The request's
# nodeVersion and imageType are marked Required there, but an update that changes only resourceLabels
# is made without them (inferred, not quoted: gcloud's `node-pools update --resource-labels` and
# Terraform's node pool resource_labels update send only the name and resourceLabels); the stand-in
# accepts exactly that and refuses an update that changes nothing it models.
# Label rules (Compute Engine docs "Labels", "Requirements for labels"): keys and values at most 63
# characters of lowercase letters, digits, underscores and dashes, a key starts with a lowercase
# letter, at most 64 labels per resource.
LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
TYPE_UPDATE_NODE_POOL = 4  # Operation.Type UPGRADE_NODES: what GKE reports for a node pool update


def resource_label_problem(labels: dict[str, Any]) -> str | None:
    """GCP's label rules (see above); None when the labels are valid."""
    if len(labels) > 64:
        return f"too many labels: {len(labels)} (at most 64)"
    for key, value in labels.items():
        if not LABEL_KEY.fullmatch(key):
            return f'Invalid value for field "resource_labels.key": "{key}"'
        if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            return f'Invalid value for field "resource_labels.value": "{value}" (key {key})'
    return None


def update_node_pool(handler: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """`PUT .../nodePools/NAME`: sets the pool's resource labels (the only update modelled)."""
    match = POOL.match(path)
    if not match or match.group(5):
        return _error(404, "NOT_FOUND", f"no route {path}")
    full = path.removeprefix("/v1/")
    if refused := handler._refused(full, match.group(3), must_exist=True):
        return refused
    if "resourceLabels" not in body:
        return _invalid("the stand-in models only updates of resourceLabels")
    labels = dict((body["resourceLabels"] or {}).get("labels") or {})
    if problem := resource_label_problem(labels):
        return _invalid(problem)
    handler.state.pools[full].setdefault("config", {})["resourceLabels"] = labels
    return 200, handler._operation(TYPE_UPDATE_NODE_POOL, location=match.group(2), target=full)


def _served(pool: dict[str, Any]) -> dict[str, Any]:
    """A pool as GET answers it (without the fake's own bookkeeping)."""
    return {key: value for key, value in pool.items() if key != "nodeCountPerZone"}


@dataclass
class ContainerServer:
    """A running fake Container API server."""

    server: ThreadingHTTPServer
    state: ContainerState

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def client(self) -> Any:
        """The real google-cloud-container client, REST transport, pointed at this server."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import container_v1

        return container_v1.ClusterManagerClient(
            transport="rest",
            client_options={"api_endpoint": self.endpoint},
            credentials=AnonymousCredentials(),
        )


@contextlib.contextmanager
def container_server_running(*, sim: ClusterSim | None = None) -> Iterator[ContainerServer]:
    state = ContainerState(sim=sim)
    with serving(_Handler, state) as server:
        yield ContainerServer(server, state)
