"""The cluster autoscaler of the simulated cluster, for pools with autoscaling enabled.

Rules (kubernetes/autoscaler cluster-autoscaler/FAQ.md "How does scale-up work?" / "How does
scale-down work?"; GKE docs "About GKE cluster autoscaling" and the NodePoolAutoscaling reference):
- scale-up: pods the scheduler marked unschedulable (PodScheduled False, Unschedulable) that would
  fit a node built from the pool's template add nodes, one node per such pod here (trainer
  pods fill a node), up to the maximum; nodes still starting count as capacity already coming. The
  template is what a node of the machine type offers as the autoscaler predicts it (`gke_nodes.template_node`:
  cloudprovider/gce/reserved.go and templates.go), with the DaemonSets it would run already on it
  (`gke_nodes.template_pods`); a pod that does not fit it triggers no scale-up at all;
- scale-down: a node without pods for `scale_down_unneeded_s` (the autoscaler's
  --scale-down-unneeded-time, 10 minutes by default) is removed, down to the minimum;
- bounds: `totalMinNodeCount` / `totalMaxNodeCount` count the whole pool, `minNodeCount` /
  `maxNodeCount` count each zone; the BALANCED location policy adds to the zone with fewest nodes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import gke_nodes
import k8s_rules

if TYPE_CHECKING:
    from cluster_sim import ClusterSim


def bounds(autoscaling: dict[str, Any], zones: int) -> tuple[int, int]:
    """(minimum, maximum) total nodes of a pool with these autoscaling settings."""
    if "totalMaxNodeCount" in autoscaling or "totalMinNodeCount" in autoscaling:
        return int(autoscaling.get("totalMinNodeCount", 0)), int(autoscaling.get("totalMaxNodeCount", 0))
    return int(autoscaling.get("minNodeCount", 0)) * zones, int(autoscaling.get("maxNodeCount", 0)) * zones


def autoscale(sim: ClusterSim, *, scale_down_unneeded_s: float) -> None:
    """One autoscaler pass over every pool with autoscaling enabled (called under the sim's lock)."""
    now = time.monotonic()
    for name, pool in sim.pools.items():
        if not pool.autoscaling.get("enabled") or name in getattr(sim.provisioning, "queued_pools", ()):
            continue  # a queued-provisioning pool grows only for ProvisioningRequests (provisioning_controller.py)
        low, high = bounds(pool.autoscaling, len(pool.zones))
        members = [n for n, where in sim.nodes.items() if where["pool"] == name]
        template = gke_nodes.template_node(pool=name, zone=pool.zones[0], machine_type=pool.machine_type)
        system = template_requests(pool.machine_type)
        waiting = [
            p for p in sim.pods.values()
            if _unschedulable(p) and not k8s_rules.unfit_reasons(p, template, system)
        ]  # fmt: skip
        starting = [n for n in members if now - sim.node_born[n] < sim.ready_delay_s + sim.gpu_delay_s]
        wanted = min(high, len(members) + max(len(waiting) - len(starting), 0))
        while len(members) < max(wanted, low):
            zone = min(pool.zones, key=lambda z: sum(1 for n in members if sim.nodes[n]["zone"] == z))
            count = sum(1 for n in members if sim.nodes[n]["zone"] == zone)
            sim._resize_zone(name, zone, count + 1)
            members = [n for n, where in sim.nodes.items() if where["pool"] == name]
        busy = {p["spec"].get("nodeName") for p in sim.pods.values()}
        for node in members:
            idle_since = sim.idle_since.setdefault(node, now) if node not in busy else None
            if node in busy:
                sim.idle_since.pop(node, None)
            elif len(members) > low and idle_since is not None and now - idle_since >= scale_down_unneeded_s:
                sim._remove_node(node)
                members.remove(node)


def template_requests(machine_type: str) -> dict[str, Any]:
    """What the system pods the autoscaler puts on a template node of `machine_type` request, summed."""
    used: dict[str, Any] = {}
    for pod in gke_nodes.template_pods(machine_type):
        for resource, amount in k8s_rules.pod_requests(pod["spec"]).items():
            used[resource] = used.get(resource, 0) + amount
    return used


def _unschedulable(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in pod["status"]["conditions"]
    ) and not pod["spec"].get("nodeName")
