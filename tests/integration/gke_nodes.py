"""The Node objects a GKE node pool registers, as the cluster simulator creates them on a resize.

Sources for each fact:
- machine shapes: Compute Engine docs "GPU machine types" / "Accelerator-optimized machine family"
  (a3-highgpu-8g: 208 vCPU, 1872 GB, 8 x H100 80GB; a2-highgpu-1g: 12 vCPU, 85 GB, 1 x A100 40GB; ...)
  and "General-purpose machine family" (e2, n1); GB there are GiB;
- capacity is what the node's kernel reports, below the machine type's nominal memory: the kubelet
  reads MemTotal (cAdvisor's MachineInfo), which the Linux kernel documents as "total usable RAM
  (i.e. physical RAM minus a few reserved bits and the kernel binary code)" (Documentation/filesystems/
  proc.rst). How much is missing depends on the machine and is not published; the simulator takes
  `KERNEL_RESERVED_FRACTION` of it, an assumption, so code that sizes pods from the nominal figure fails
  here as it would on a real node;
- DaemonSet pods: every node runs GKE's system DaemonSets (`SYSTEM_DAEMONSETS`; on GPU nodes the NVIDIA
  device plugin too, GKE docs "Run GPUs in GKE Standard node pools"), and the scheduler counts their
  requests against the node like any pod's (kube-scheduler NodeResourcesFit sums the requests of the
  pods bound to a node). Which DaemonSets GKE runs and their requests vary by version; the figures here
  are illustrative, not GKE's;
- allocatable = capacity - GKE's reservations, GKE docs "Plan node sizes" / "Node allocatable
  resources": memory 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6% of the next
  112, 2% above 128 GiB, plus a 100 MiB eviction threshold; CPU 6% of the first core, 1% of the
  next, 0.5% of the next 2, 0.25% of the rest;
- labels: GKE docs "About node labels" (cloud.google.com/gke-nodepool, cloud.google.com/machine-family,
  cloud.google.com/gke-accelerator on GPU nodes, cloud.google.com/gke-os-distribution) and the
  well-known labels (node.kubernetes.io/instance-type, topology.kubernetes.io/zone and region,
  kubernetes.io/hostname, kubernetes.io/os, kubernetes.io/arch: kubernetes.io docs "Well-Known Labels,
  Annotations and Taints");
- the GPU taint `nvidia.com/gpu=present:NoSchedule`: GKE docs "Run GPUs in GKE Standard node pools"
  (GKE adds it to GPU node pools so that pods without a GPU request stay off them);
- `node.kubernetes.io/not-ready:NoSchedule` while the node is not Ready: the node lifecycle
  controller's taint (Well-Known Taints; TaintNodesByCondition);
- a GPU node is Ready before the device plugin publishes `nvidia.com/gpu` (GKE docs "Run GPUs":
  the driver installer runs after the node registers), so its GPUs appear after `gpu_delay_s`;
- TPU slice nodes (`TPU_MACHINES`; GKE docs "About TPUs in GKE" and "Plan TPUs in GKE"): the labels
  `cloud.google.com/gke-tpu-accelerator` (the TPU type, e.g. tpu-v6e-slice) and
  `cloud.google.com/gke-tpu-topology` (the slice's topology, which only the node pool knows: the
  caller adds it), `google.com/tpu` capacity and allocatable = the VM's chips, and the taint
  `google.com/tpu=present:NoSchedule` that GKE puts on TPU slice nodes ("About TPUs in GKE", how TPUs
  work). `google.com/tpu` is an extended resource published by a device plugin after the node
  registers (kubernetes.io docs "Device Plugins"), so the chips appear after `gpu_delay_s` like GPUs.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Machine:
    cpus: int
    memory_gib: float
    gpus: int = 0
    accelerator: str | None = None  # the GKE accelerator type, the gke-accelerator label's value
    tpu_chips: int = 0  # TPU chips on the VM (a TPU machine type: `accelerator` is the TPU type)


@dataclass(frozen=True)
class TpuMachine:
    """A GKE TPU machine type: its VM shape and the slice topologies a node pool of it can have.

    `topologies` lists them; None means the 3D rule of `v5p_topology_problem`.
    """

    accelerator: str  # the cloud.google.com/gke-tpu-accelerator label
    chips: int
    cpus: int
    memory_gib: float
    single_host: str  # the topology of one VM (a pool created without placementPolicy.tpuTopology)
    topologies: tuple[str, ...] | None


# GKE docs "Plan TPUs in GKE" (machine types, chips per VM, topologies, single- or multi-host) and Cloud
# TPU docs "TPU v5e", "TPU v5p", "TPU v6e" (vCPUs and memory of each TPU VM).
_V5E_V6E_4_CHIPS = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
TPU_MACHINES = {
    "ct5lp-hightpu-1t": TpuMachine("tpu-v5-lite-podslice", 1, 24, 48, "1x1", ("1x1",)),
    "ct5lp-hightpu-4t": TpuMachine("tpu-v5-lite-podslice", 4, 112, 192, "2x2", _V5E_V6E_4_CHIPS),
    "ct5lp-hightpu-8t": TpuMachine("tpu-v5-lite-podslice", 8, 224, 384, "2x4", ("2x4",)),
    "ct6e-standard-1t": TpuMachine("tpu-v6e-slice", 1, 44, 176, "1x1", ("1x1",)),
    "ct6e-standard-4t": TpuMachine("tpu-v6e-slice", 4, 180, 720, "2x2", _V5E_V6E_4_CHIPS),
    "ct6e-standard-8t": TpuMachine("tpu-v6e-slice", 8, 180, 1440, "2x4", ("2x4",)),
    "ct5p-hightpu-4t": TpuMachine("tpu-v5p-slice", 4, 208, 448, "2x2x1", None),
}


def v5p_topology_problem(topology: str) -> str | None:
    """Cloud TPU docs "TPU v5p" (topologies): three dimensions A x B x C with A <= B <= C, all at most 4
    or all multiples of 4, up to 16x16x24."""
    dims = [int(d) for d in topology.split("x")] if re.fullmatch(r"\d+x\d+x\d+", topology) else []
    if not dims or dims != sorted(dims) or min(dims) < 1:
        return "must be AxBxC with A <= B <= C"
    if not (max(dims) <= 4 or all(d % 4 == 0 for d in dims)):
        return "A, B and C must all be at most 4 or all multiples of 4"
    if math.prod(dims) > 16 * 16 * 24:
        return "is larger than 16x16x24"
    return None


def tpu_topology_problem(machine_type: str, topology: str) -> str | None:
    """Why `topology` is no slice of `machine_type` (None: it is one)."""
    machine = TPU_MACHINES[machine_type]
    if machine.topologies is None:
        return v5p_topology_problem(topology)
    if topology not in machine.topologies:
        return f"is not a topology of {machine_type} (valid: {', '.join(machine.topologies)})"
    return None


def tpu_hosts(machine_type: str, topology: str) -> int:
    """TPU VMs (nodes) of one slice: chips of the topology / chips per VM (at least 1)."""
    chips = math.prod(int(d) for d in topology.split("x"))
    return max(chips // TPU_MACHINES[machine_type].chips, 1)


MACHINES = {
    "a3-highgpu-8g": Machine(208, 1872, 8, "nvidia-h100-80gb"),
    "a3-megagpu-8g": Machine(208, 1872, 8, "nvidia-h100-mega-80gb"),
    "a2-highgpu-1g": Machine(12, 85, 1, "nvidia-tesla-a100"),
    "a2-highgpu-8g": Machine(96, 680, 8, "nvidia-tesla-a100"),
    "a2-ultragpu-8g": Machine(96, 1360, 8, "nvidia-a100-80gb"),
    "g2-standard-8": Machine(8, 32, 1, "nvidia-l4"),
    "e2-standard-4": Machine(4, 16),
    "n1-standard-8": Machine(8, 30),
    **{
        name: Machine(tpu.cpus, tpu.memory_gib, accelerator=tpu.accelerator, tpu_chips=tpu.chips)
        for name, tpu in TPU_MACHINES.items()
    },
}


KERNEL_RESERVED_FRACTION = 0.015
"""Share of the nominal memory a node's kernel does not report as capacity (an assumption, see above)."""

# (name, CPU millicores, memory MiB) requested by each system DaemonSet pod on every node, and on GPU nodes.
SYSTEM_DAEMONSETS = (("fluentbit-gke", 100, 200), ("gke-metrics-agent", 8, 60), ("pdcsi-node", 10, 20),
                     ("netd", 2, 30))  # fmt: skip
GPU_DAEMONSETS = (("nvidia-gpu-device-plugin", 50, 20),)
# GKE's installers on GPU nodes request resources only in an init container (the driver and GPUDirect
# installers run once, then a pause container stays): the scheduler counts the larger of the init container
# and the app containers (`k8s_rules.pod_requests`), so a sum over app containers misses them.
GPU_INIT_DAEMONSETS = (("nvidia-driver-installer", 150, 300),)
# kube-proxy runs as a static pod on GKE nodes (the kubelet starts it from its manifest folder; the API shows
# a mirror pod owned by the Node, annotated kubernetes.io/config.mirror): no DaemonSet owns it, and the
# scheduler counts its requests like any pod's bound to the node.
STATIC_PODS = (("kube-proxy", 100, 0),)


def _system_pod(
    node: str, name: str, cpu_m: int, memory_mib: int, *, owner: dict[str, Any], init_only: bool = False,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    requests = {"cpu": f"{cpu_m}m", **({"memory": f"{memory_mib}Mi"} if memory_mib else {})}
    suffix = hashlib.sha256(f"{name}/{node}".encode()).hexdigest()[:5]
    container = {"name": name, "image": f"gke.gcr.io/{name}", "resources": {"requests": requests}}
    containers = [{"name": "pause", "image": "gke.gcr.io/pause"}] if init_only else [container]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-{suffix}", "namespace": "kube-system", "uid": f"sys-{name}-{node}",
                     "labels": {"k8s-app": name}, "ownerReferences": [owner],
                     **({"annotations": annotations} if annotations else {})},
        "spec": {"nodeName": node, "containers": containers, **({"initContainers": [container]} if init_only else {})},
        "status": {"phase": "Running"},
    }  # fmt: skip


def daemonset_pods(node: str, *, gpus: bool) -> list[dict[str, Any]]:
    """The system pods bound to `node` (namespace kube-system): GKE's DaemonSets' (owned by their DaemonSet),
    on GPU nodes one that requests only in its init container, and the static kube-proxy's mirror pod."""

    def owned(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": name,
            "uid": f"ds-{name}",
            "controller": True,
        }

    pods = [_system_pod(node, name, cpu_m, memory_mib, owner=owned(name))
            for name, cpu_m, memory_mib in SYSTEM_DAEMONSETS + (GPU_DAEMONSETS if gpus else ())]  # fmt: skip
    pods += [_system_pod(node, name, cpu_m, memory_mib, owner=owned(name), init_only=True)
             for name, cpu_m, memory_mib in (GPU_INIT_DAEMONSETS if gpus else ())]  # fmt: skip
    node_owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": f"node-{node}", "controller": True}
    pods += [_system_pod(node, name, cpu_m, memory_mib, owner=node_owner,
                         annotations={"kubernetes.io/config.mirror": f"mirror-{name}",
                                      "kubernetes.io/config.source": "file"})
             for name, cpu_m, memory_mib in STATIC_PODS]  # fmt: skip
    return pods


def reserved_memory_bytes(memory_bytes: int) -> int:
    """GKE's memory reservation for a node of `memory_bytes` (eviction threshold included)."""
    tiers = [(4 * GIB, 0.25), (4 * GIB, 0.20), (8 * GIB, 0.10), (112 * GIB, 0.06), (float("inf"), 0.02)]
    left, reserved = float(memory_bytes), 0.0
    for size, share in tiers:
        part = min(left, size)
        reserved += part * share
        left -= part
    return int(reserved) + 100 * 2**20


def reserved_cpu_millis(cpus: int) -> int:
    """GKE's CPU reservation in millicores for a node of `cpus` cores."""
    tiers = [(1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025)]
    left, reserved = float(cpus), 0.0
    for size, share in tiers:
        part = min(left, size)
        reserved += part * share
        left -= part
    return round(reserved * 1000)


# The cluster autoscaler's template of a node that does not exist yet (kubernetes/autoscaler
# cluster-autoscaler/cloudprovider/gce/reserved.go, GceReserved.CalculateKernelReserved for Linux on COS, amd64;
# templates.go, BuildCapacity and CalculateAllocatable): capacity is the machine's memory less what the kernel
# keeps, and allocatable takes kube-reserved (GKE sets it from the machine's memory; the bands of
# `reserved_memory_bytes`) and the 100 MiB eviction threshold off that capacity.
MIB = 2**20


def autoscaler_kernel_reserved(physical: int) -> int:
    """reserved.go: physical/64 + 16 MiB, + 64 MiB above 3 GiB (software IO TLB), + 8 MiB up to 8 GiB, + on COS
    min(0.00175 x physical, 248 MiB)."""
    reserved = physical // 64 + 16 * MIB
    if physical > 3 * GIB:
        reserved += 64 * MIB
    if physical <= 8 * GIB:
        reserved += 8 * MIB
    return reserved + int(min(0.00175 * physical, 248 * MIB))


def template_node(*, pool: str, zone: str, machine_type: str) -> dict[str, Any]:
    """The Node the autoscaler simulates a scale-up on: a pool member with the template's capacity and
    allocatable (ready, its GPUs published); `template_pods` are the DaemonSets it puts on it."""
    node = gke_node(
        name="template", pool=pool, zone=zone, machine_type=machine_type, ready=True, gpus_published=True
    )
    physical = int(MACHINES[machine_type].memory_gib * GIB)
    capacity = physical - autoscaler_kernel_reserved(physical)
    node["status"]["capacity"]["memory"] = f"{capacity // 1024}Ki"
    allocatable = capacity - reserved_memory_bytes(
        physical
    )  # kube-reserved of the machine, eviction included
    node["status"]["allocatable"]["memory"] = f"{allocatable // 1024}Ki"
    return node


def template_pods(machine_type: str) -> list[dict[str, Any]]:
    """The DaemonSet pods the autoscaler adds to a template node (cluster-autoscaler FAQ, "How can I scale a
    node group to 0?": the template's node info includes the DaemonSets that would run there); the static
    kube-proxy too, which every GKE node runs."""
    return daemonset_pods("template", gpus=bool(MACHINES[machine_type].gpus))


def node_name(cluster: str, pool: str, zone: str, index: int) -> str:
    """`gke-<cluster>-<pool>-<8 hex of the instance group>-<4 chars>`, GKE's instance naming."""
    group = hashlib.sha256(f"{cluster}/{pool}/{zone}".encode()).hexdigest()[:8]
    suffix = hashlib.sha256(f"{group}/{index}".encode()).hexdigest()[:4]
    return f"gke-{cluster}-{pool}-{group}-{suffix}"[:63]


def gke_node(
    *,
    name: str,
    pool: str,
    zone: str,
    machine_type: str,
    ready: bool,
    gpus_published: bool,
    spot: bool = False,
) -> dict[str, Any]:
    """The Node object of one pool member (a machine type missing from MACHINES is a test error)."""
    machine = MACHINES[machine_type]
    memory = int(machine.memory_gib * GIB * (1 - KERNEL_RESERVED_FRACTION))
    capacity = {"cpu": str(machine.cpus), "memory": f"{memory // 1024}Ki", "pods": "110"}
    allocatable = {
        "cpu": f"{machine.cpus * 1000 - reserved_cpu_millis(machine.cpus)}m",
        "memory": f"{(memory - reserved_memory_bytes(memory)) // 1024}Ki",
        "pods": "110",
    }
    labels = {
        "cloud.google.com/gke-nodepool": pool,
        "cloud.google.com/machine-family": machine_type.split("-", 1)[0],
        "cloud.google.com/gke-os-distribution": "cos",
        "node.kubernetes.io/instance-type": machine_type,
        "topology.kubernetes.io/zone": zone,
        "topology.kubernetes.io/region": zone.rsplit("-", 1)[0],
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
    }
    if spot:  # GKE "Spot VMs": both labels on every Spot node
        labels.update({"cloud.google.com/gke-spot": "true", "cloud.google.com/gke-provisioning": "spot"})
    taints = []
    if machine.gpus:
        labels["cloud.google.com/gke-accelerator"] = str(machine.accelerator)
        taints.append({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
        capacity["nvidia.com/gpu"] = str(machine.gpus)
        allocatable["nvidia.com/gpu"] = str(machine.gpus if gpus_published else 0)
    if machine.tpu_chips:
        labels["cloud.google.com/gke-tpu-accelerator"] = str(machine.accelerator)
        taints.append({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"})
        capacity["google.com/tpu"] = str(machine.tpu_chips)
        allocatable["google.com/tpu"] = str(machine.tpu_chips if gpus_published else 0)
    if not ready:
        taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints, "providerID": f"gce://proj/{zone}/{name}"},
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                            "reason": "KubeletReady" if ready else "KubeletNotReady"}],
        },
    }  # fmt: skip
