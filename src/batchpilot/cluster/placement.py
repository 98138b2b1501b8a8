"""Where trainer pods go on GKE: node selector, tolerations and the pod settings every launcher shares.

The pipeline reuses `gpu_node_selector` and `gpu_tolerations` to place KFP tasks on the same pool. TPU
trainers (`tpu_node_selector`, `tpu_tolerations`) go to the node pool of their launch's slice shape.
"""

from __future__ import annotations

from typing import Any

from batchpilot.cluster.gpudirect import add_to_pod_overlay, gpudirect_pod
from batchpilot.cluster.readiness import GKE_NODE_POOL_LABEL, GPU_RESOURCE
from batchpilot.config import ClusterConfig, Config
from batchpilot.planning.tpu import TPU_RESOURCE_NAME, slice_pool_name

GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
# The node labels of a TPU slice node (GKE "Deploy TPU workloads in GKE Standard": a workload selects the
# TPU type and the slice topology with these two labels; the topology is the node pool's tpu_topology).
GKE_TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
# Trainers checkpoint on SIGTERM (exit 75); a scale-down must not evict them to save a node.
SAFE_TO_EVICT_ANNOTATION = "cluster-autoscaler.kubernetes.io/safe-to-evict"
# The image's non-root user (see the Dockerfile).
TRAINER_UID = 1000
# Seconds between SIGTERM and SIGKILL: room to finish the micro batch and write a checkpoint when a pod is
# evicted, its JobSet deleted or its GPU node drained for maintenance (GKE "Manage GKE node disruption for
# GPUs and TPUs": GPU VMs are not live-migrated, GKE terminates the node and its pods). A Spot VM's
# preemption leaves non-system pods 15 s whatever this says (GKE "Spot VMs": graceful node shutdown), so
# `train.checkpoint_every_s` bounds what such a preemption loses.
TERMINATION_GRACE_S = 120


FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
"""On the nodes flex-start brings; GKE's queued-provisioning guide selects it in the pods of its Standard
example ("Run a large-scale workload with flex-start with queued provisioning")."""


def _cluster(config: Config | ClusterConfig) -> ClusterConfig:
    return config.cluster if isinstance(config, Config) else config


def gpu_node_selector(config: Config | ClusterConfig) -> dict[str, str]:
    """Node labels a trainer pod requires: the pool, its accelerator type, then `cluster.node_selector`."""
    cluster = _cluster(config)
    selector: dict[str, str] = {}
    if cluster.node_pool:
        selector[GKE_NODE_POOL_LABEL] = cluster.node_pool
    if cluster.accelerator_type:
        selector[GKE_ACCELERATOR_LABEL] = cluster.accelerator_type
    if cluster.provisioning == "flex-start":
        selector[FLEX_START_LABEL] = "true"
    selector.update(cluster.node_selector)
    return selector


def gpu_tolerations(config: Config | ClusterConfig) -> list[dict[str, Any]]:
    """The GPU taint GKE puts on accelerator nodes (when the pool has GPUs), then `cluster.tolerations`."""
    cluster = _cluster(config)
    tolerations: list[dict[str, Any]] = []
    if cluster.accelerator_type:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    tolerations.extend(dict(item) for item in cluster.tolerations)
    return tolerations


def tpu_node_selector(cluster: ClusterConfig, *, topology: str) -> dict[str, str]:
    """Node labels a TPU trainer pod requires: the node pool of its slice shape (`slice_pool_name`), the TPU
    type and the slice topology, then `cluster.node_selector`."""
    if not cluster.accelerator_type:
        raise ValueError("a TPU node selector needs cluster.accelerator_type")
    selector: dict[str, str] = {}
    if cluster.node_pool:
        selector[GKE_NODE_POOL_LABEL] = slice_pool_name(cluster.node_pool, topology)
    selector[GKE_TPU_ACCELERATOR_LABEL] = cluster.accelerator_type
    selector[GKE_TPU_TOPOLOGY_LABEL] = topology
    selector.update(cluster.node_selector)
    return selector


def tpu_tolerations(cluster: ClusterConfig) -> list[dict[str, Any]]:
    """The `google.com/tpu` taint GKE puts on TPU nodes (GKE "Deploy TPU workloads in GKE Standard"), then
    `cluster.tolerations`."""
    tolerations: list[dict[str, Any]] = [
        {"key": TPU_RESOURCE_NAME, "operator": "Exists", "effect": "NoSchedule"}
    ]
    tolerations.extend(dict(item) for item in cluster.tolerations)
    return tolerations


def trainer_pod_overlay(cluster: ClusterConfig, *, tpu_topology: str | None = None) -> dict[str, Any]:
    """Pod-level fields of a trainer (torchx `kubernetes`/`V1Pod` overlay, honoured by both launchers);
    `tpu_topology`: a TPU trainer on the node pool of that slice shape."""
    if tpu_topology is None:
        node_selector, tolerations = gpu_node_selector(cluster), gpu_tolerations(cluster)
    else:
        node_selector, tolerations = (
            tpu_node_selector(cluster, topology=tpu_topology),
            tpu_tolerations(cluster),
        )
    overlay: dict[str, Any] = {
        "metadata": {"annotations": {SAFE_TO_EVICT_ANNOTATION: "false"}},
        "spec": {
            "nodeSelector": node_selector,
            "tolerations": tolerations,
            "serviceAccountName": cluster.service_account,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": TRAINER_UID,
                "runAsGroup": TRAINER_UID,
                "fsGroup": TRAINER_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }
    # GPU NICs' networks and the receive-path daemon (cluster/gpudirect.py); the trainer container's part
    # of it is in launch.cluster_appdef.
    if tpu_topology is None and (direct := gpudirect_pod(cluster)) is not None:
        add_to_pod_overlay(overlay, direct)
    return overlay


def _requests_equal_limits(container: dict[str, Any]) -> None:
    """CPU, memory and TPU requests equal to their limits (torchx asks for 100m CPU and 1024 MB less).

    A pod whose containers request what they limit is in the Guaranteed QoS class: the kubelet evicts it
    last under node memory pressure, and the scheduler reserves all the memory the trainer may use.
    """
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.setdefault("requests", {})
    # torchx writes extended resources other than nvidia.com/gpu (here google.com/tpu) as limits only.
    for name in ("cpu", "memory", TPU_RESOURCE_NAME):
        if name in limits:
            requests[name] = limits[name]


def harden_containers(pod_spec: dict[str, Any]) -> None:
    """Container-level settings torchx leaves open: requests equal to limits, no privilege escalation,
    read-only root, a writable /tmp.

    Applied to rendered pod specs (camelCase dicts) because torchx names containers per replica,
    which a name-keyed overlay cannot address.
    """
    for container in pod_spec.get("containers", []):
        _requests_equal_limits(container)
        context = container.setdefault("securityContext", {})
        if context.get("privileged"):
            continue  # a device mount asked for it explicitly; do not contradict it
        context.update(
            {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }
        )
        mounts = container.setdefault("volumeMounts", [])
        if not any(mount.get("mountPath") == "/tmp" for mount in mounts):
            mounts.append({"name": "tmp", "mountPath": "/tmp"})
