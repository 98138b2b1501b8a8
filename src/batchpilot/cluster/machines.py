"""GKE accelerator machine types and how much of a node a trainer pod may request.

Sources (Google's documentation; memory there is given in "GB" meaning 2^30 bytes, the unit of the
Compute Engine API's `memoryMb`):

- "Accelerator-optimized machine family" and "GPU machine types" (Compute Engine): vCPUs, memory,
  GPU count and model of each A2, A3 and G2 machine type.
- TPU VMs: Cloud TPU "TPU v5p" (a 4-chip VM: 208 vCPUs, 448 GB RAM) and GKE "About TPUs in GKE" (v5e
  machine types: ct5lp-hightpu-1t 24 vCPUs / 48 GB, -4t 112 / 192 GB, -8t 224 / 384 GB, as Compute Engine
  lists them). The v6e types (ct6e-standard-*) are not here: batchpilot found no source it could cite for
  their vCPUs and memory, so a v6e config sets cluster.cpu_per_node and memory_per_node_bytes.
- "About GKE node sizing" (Plan GKE Standard node sizes, "Memory and CPU reservations"): what GKE
  reserves on every node (kube-reserved), and the kubelet's 100 MiB memory eviction threshold.

A trainer is one pod per node, so it asks for the node's allocatable resources less what GKE's own
DaemonSets request (`DAEMONSET_RESERVE_*`). Nothing here talks to an API: sizing is a pure function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from batchpilot.errors import BatchpilotError
from batchpilot.planning.devices import nearest_names

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class MachineType:
    """One Compute Engine machine type as GKE nodes of a pool have it."""

    vcpus: int
    memory_bytes: int
    num_gpus: int
    """GPUs of the node, or on a TPU VM its TPU chips (the node's `google.com/tpu` allocatable)."""
    gpu_label: str
    """The node's `cloud.google.com/gke-accelerator` label, or on a TPU VM its
    `cloud.google.com/gke-tpu-accelerator` label: what `cluster.accelerator_type` names."""


def _machine(vcpus: int, memory_gb: int, num_gpus: int, gpu_label: str) -> MachineType:
    return MachineType(vcpus, memory_gb * GIB, num_gpus, gpu_label)


# "Accelerator-optimized machine family": A2 Standard (A100 40GB), A2 Ultra (A100 80GB),
# A3 High / Mega (H100 80GB), A3 Ultra (H200 141GB), G2 (L4). The a3-highgpu-1g/2g/4g types are
# offered through Spot and flex-start (Dynamic Workload Scheduler) only, which GKE node pools support.
MACHINE_TYPES: dict[str, MachineType] = {
    "a2-highgpu-1g": _machine(12, 85, 1, "nvidia-tesla-a100"),
    "a2-highgpu-2g": _machine(24, 170, 2, "nvidia-tesla-a100"),
    "a2-highgpu-4g": _machine(48, 340, 4, "nvidia-tesla-a100"),
    "a2-highgpu-8g": _machine(96, 680, 8, "nvidia-tesla-a100"),
    "a2-megagpu-16g": _machine(96, 1360, 16, "nvidia-tesla-a100"),
    "a2-ultragpu-1g": _machine(12, 170, 1, "nvidia-a100-80gb"),
    "a2-ultragpu-2g": _machine(24, 340, 2, "nvidia-a100-80gb"),
    "a2-ultragpu-4g": _machine(48, 680, 4, "nvidia-a100-80gb"),
    "a2-ultragpu-8g": _machine(96, 1360, 8, "nvidia-a100-80gb"),
    "a3-highgpu-1g": _machine(26, 234, 1, "nvidia-h100-80gb"),
    "a3-highgpu-2g": _machine(52, 468, 2, "nvidia-h100-80gb"),
    "a3-highgpu-4g": _machine(104, 936, 4, "nvidia-h100-80gb"),
    "a3-highgpu-8g": _machine(208, 1872, 8, "nvidia-h100-80gb"),
    "a3-megagpu-8g": _machine(208, 1872, 8, "nvidia-h100-mega-80gb"),
    # The page's A3 series summary: "up to 224 vCPUs, and 2,944 GB of memory" (A3 Ultra).
    "a3-ultragpu-8g": _machine(224, 2944, 8, "nvidia-h200-141gb"),
    "g2-standard-4": _machine(4, 16, 1, "nvidia-l4"),
    "g2-standard-8": _machine(8, 32, 1, "nvidia-l4"),
    "g2-standard-12": _machine(12, 48, 1, "nvidia-l4"),
    "g2-standard-16": _machine(16, 64, 1, "nvidia-l4"),
    "g2-standard-24": _machine(24, 96, 2, "nvidia-l4"),
    "g2-standard-32": _machine(32, 128, 1, "nvidia-l4"),
    "g2-standard-48": _machine(48, 192, 4, "nvidia-l4"),
    "g2-standard-96": _machine(96, 384, 8, "nvidia-l4"),
    # TPU VMs (see the module docstring): chips per VM in place of GPUs, the TPU type's label.
    "ct5lp-hightpu-1t": _machine(24, 48, 1, "tpu-v5-lite-podslice"),
    "ct5lp-hightpu-4t": _machine(112, 192, 4, "tpu-v5-lite-podslice"),
    "ct5lp-hightpu-8t": _machine(224, 384, 8, "tpu-v5-lite-podslice"),
    "ct5p-hightpu-4t": _machine(208, 448, 4, "tpu-v5p-slice"),
}

# "Networking and GPU machines" (Compute Engine, gpu-network-bandwidth): the bandwidth in Gbps a node has for
# GPU-to-GPU traffic across nodes. A3 types have NICs dedicated to it beside a general-purpose one, and the
# page's "max total" counts both: A3 Ultra 8 CX-7 NICs, 3,200 of 3,600; A3 Mega 8 x 200, 1,600 of 1,800;
# A3 High 4 x 200, 800 of 1,000. A2 and G2 have one network of up to 100 Gbps by machine type (the smaller
# types' figures are the page's per-type table as we read it; check yours). Types the page gives no figure
# for are absent; the canary then compares with nothing.
NETWORK_GBPS: dict[str, int] = {
    "a2-highgpu-1g": 24, "a2-highgpu-2g": 32, "a2-highgpu-4g": 50, "a2-highgpu-8g": 100,
    "a2-megagpu-16g": 100,
    "a2-ultragpu-1g": 24, "a2-ultragpu-2g": 32, "a2-ultragpu-4g": 50, "a2-ultragpu-8g": 100,
    "a3-highgpu-8g": 800, "a3-megagpu-8g": 1600, "a3-ultragpu-8g": 3200,
    "g2-standard-4": 10, "g2-standard-8": 16, "g2-standard-12": 16, "g2-standard-16": 32,
    "g2-standard-24": 32, "g2-standard-32": 32, "g2-standard-48": 50, "g2-standard-96": 100,
}  # fmt: skip


def expected_bus_bandwidth_bytes_per_s(*, machine_type_name: str | None, num_nodes: int) -> float | None:
    """What an all-reduce across `num_nodes` nodes of `machine_type_name` should reach as bus bandwidth
    (the nccl-tests figure: bytes x 2(n-1)/n / time): about one node's network bandwidth, since every node
    sends and receives that share of the buffer through its NICs. None: one node (the all-reduce stays on
    the node's own links) or a type without a documented figure."""
    gbps = NETWORK_GBPS.get(machine_type_name or "")
    if gbps is None or num_nodes < 2:
        return None
    return gbps * 1e9 / 8


# "About GKE node sizing", memory and CPU reservations: (upper bound of the band, share reserved in it).
# Memory: 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6% of the next 112, 2% above 128.
_MEMORY_BANDS_GIB = ((4, Fraction(25, 100)), (8, Fraction(20, 100)), (16, Fraction(10, 100)),
                     (128, Fraction(6, 100)), (None, Fraction(2, 100)))  # fmt: skip
# CPU: 6% of the first core, 1% of the next, 0.5% of the next 2, 0.25% of any cores above 4.
_CPU_BANDS_CORES = ((1, Fraction(6, 100)), (2, Fraction(1, 100)), (4, Fraction(5, 1000)),
                    (None, Fraction(25, 10000)))  # fmt: skip
SMALL_MACHINE_MEMORY_RESERVE_BYTES = 255 * MIB  # machines with less than 1 GiB (none of the above)
EVICTION_THRESHOLD_BYTES = 100 * MIB  # the kubelet's hard eviction threshold, memory.available<100Mi

# GKE's own DaemonSets on a GPU node request CPU and memory out of the allocatable resources too:
# kube-proxy, fluentbit-gke, gke-metrics-agent, gke-metadata-server (Workload Identity), pdcsi-node,
# netd or anetd, nvidia-gpu-device-plugin, and on A3 the GPUDirect TCPX/TCPXO daemon. GKE documents no
# total for them. Our estimate of their default requests is about half a CPU and under 1 GiB (an
# estimate, not a measurement on every node version: read yours in `kubectl describe node NODE`,
# "Allocated resources"); the reserve is twice that, so optional add-ons (DCGM exporter,
# node-local-dns) still fit. Set cluster.cpu_per_node / memory_per_node_bytes when a pool runs more.
DAEMONSET_RESERVE_MILLICORES = 1000
DAEMONSET_RESERVE_BYTES = 2 * GIB


def _banded(total: Fraction, bands: tuple[tuple[int | None, Fraction], ...]) -> Fraction:
    reserved, floor = Fraction(0), Fraction(0)
    for upper, share in bands:
        top = total if upper is None else min(total, Fraction(upper))
        if top > floor:
            reserved += (top - floor) * share
        if upper is None or total <= upper:
            break
        floor = Fraction(upper)
    return reserved


@dataclass(frozen=True)
class Allocatable:
    """CPU and memory a node offers to pods (or, for a trainer, what it asks for)."""

    cpu_millicores: int
    memory_bytes: int

    def describe(self) -> str:
        return f"{self.cpu_millicores}m CPU, {self.memory_bytes / GIB:.1f} GiB"


def gke_allocatable(machine: MachineType) -> Allocatable:
    """What a GKE Standard node of `machine` offers to pods: capacity less kube-reserved (less the
    eviction threshold for memory), rounded in the node's favour."""
    if machine.memory_bytes < GIB:
        memory_reserved = Fraction(SMALL_MACHINE_MEMORY_RESERVE_BYTES)
    else:
        memory_reserved = _banded(Fraction(machine.memory_bytes, GIB), _MEMORY_BANDS_GIB) * GIB
    cpu_reserved = _banded(Fraction(machine.vcpus), _CPU_BANDS_CORES) * 1000
    return Allocatable(
        cpu_millicores=machine.vcpus * 1000 - _ceil(cpu_reserved),
        memory_bytes=machine.memory_bytes - _ceil(memory_reserved) - EVICTION_THRESHOLD_BYTES,
    )


# The cluster autoscaler's node template (kubernetes/autoscaler cluster-autoscaler/cloudprovider/gce/reserved.go,
# GceReserved.CalculateKernelReserved, Linux on COS, amd64): before the first node of a pool exists, a scale-up
# (a pending pod, a ProvisioningRequest) simulates the pods on a template node whose memory capacity is the
# machine's less what the kernel keeps, and whose allocatable takes kube-reserved and the eviction threshold off
# that (templates.go, CalculateAllocatable). A pod that does not fit the template never triggers a scale-up.
KERNEL_RESERVED_RATIO = 64
"""physical / 64 of a node's memory is the kernel's."""
KERNEL_RESERVED_BYTES = 16 * MIB
SWIOTLB_RESERVED_BYTES = 64 * MIB
"""Software IO TLB, on machines with more than `SWIOTLB_THRESHOLD_BYTES`."""
SWIOTLB_THRESHOLD_BYTES = 3 * GIB
LOW_MEMORY_OFFSET_BYTES = 8 * MIB
"""On machines with at most `LOW_MEMORY_THRESHOLD_BYTES`."""
LOW_MEMORY_THRESHOLD_BYTES = 8 * GIB
KERNEL_CORRECTION_RATIO = Fraction(175, 100_000)
"""The autoscaler's statistically fitted correction on COS: 0.175% of the memory, at most 248 MiB."""
KERNEL_CORRECTION_MAX_BYTES = 248 * MIB


def kernel_reserved_bytes(physical_bytes: int) -> int:
    """Memory the cluster autoscaler expects a new node's kernel to keep (see the comment above)."""
    reserved = physical_bytes // KERNEL_RESERVED_RATIO + KERNEL_RESERVED_BYTES
    if physical_bytes > SWIOTLB_THRESHOLD_BYTES:
        reserved += SWIOTLB_RESERVED_BYTES
    if physical_bytes <= LOW_MEMORY_THRESHOLD_BYTES:
        reserved += LOW_MEMORY_OFFSET_BYTES
    correction = min(KERNEL_CORRECTION_RATIO * physical_bytes, Fraction(KERNEL_CORRECTION_MAX_BYTES))
    return reserved + int(correction)


def template_allocatable(machine: MachineType) -> Allocatable:
    """What the cluster autoscaler's template node of `machine` offers to pods: the kernel's share off the
    memory first (`kernel_reserved_bytes`), then GKE's kube-reserved and the eviction threshold (as
    `gke_allocatable`). A real node reports at least this much, so a pod sized to it fits both the scale-up
    simulation and the node that comes."""
    documented = gke_allocatable(machine)
    return Allocatable(
        cpu_millicores=documented.cpu_millicores,
        memory_bytes=documented.memory_bytes - kernel_reserved_bytes(machine.memory_bytes),
    )


def _ceil(value: Fraction) -> int:
    return -(-value.numerator // value.denominator)


def machine_type(name: str) -> MachineType:
    """The table's entry for `name`; an unknown type is an error naming the nearest known ones."""
    try:
        return MACHINE_TYPES[name]
    except KeyError:
        raise unknown_machine_type(name) from None


def unknown_machine_type(name: str) -> BatchpilotError:
    nearest = ", ".join(nearest_names(name, tuple(MACHINE_TYPES)))
    return BatchpilotError(
        "cluster.machine_type",
        f"{name!r} is not a machine type batchpilot knows (nearest: {nearest})",
        "use one of those, or for another machine set cluster.cpu_per_node and cluster.memory_per_node_bytes",
    )


GKE_MACHINE_TYPE = re.compile(r"^[a-z][a-z0-9]*-(?:[a-z]+(?:-[0-9]+[a-z]?)?|custom-[0-9]+-[0-9]+(?:-ext)?)$")
"""A Compute Engine machine type's shape: `<series>-<type>[-<vCPUs>[g|t]]` (e2-standard-4, a3-highgpu-8g,
ct5lp-hightpu-4t, e2-medium) or a custom type (n2-custom-4-16384)."""


def machine_type_problem(
    *,
    machine_type_name: str | None,
    accelerator_type: str | None,
    cpu_per_node: int | None,
    memory_per_node_bytes: int | None,
) -> BatchpilotError | None:
    """A machine type the trainer pods cannot be sized for: a GPU or TPU pool's type must be in the table (a
    dry run and the autoscaler's template size pods from it); a CPU pool's may be any Compute Engine type
    (its pods are sized from the ready nodes), but not a name no machine type has. None: fine, or sized
    explicitly (`cpu_per_node` and `memory_per_node_bytes`)."""
    if not machine_type_name or machine_type_name in MACHINE_TYPES:
        return None
    if cpu_per_node is not None and memory_per_node_bytes is not None:
        return None
    if not accelerator_type and GKE_MACHINE_TYPE.match(machine_type_name):
        return None
    return unknown_machine_type(machine_type_name)


def check_accelerators(
    *, machine_type_name: str | None, accelerator_type: str | None, devices_per_node: int
) -> None:
    """With a known machine type, its GPUs must be the ones the config asks for: a node selector for
    another GPU model matches no node of the pool, and more devices than the node has never schedule."""
    machine = MACHINE_TYPES.get(machine_type_name or "")
    if machine is None or not accelerator_type:
        return  # an unknown type is reported by trainer_resources where it matters
    if accelerator_type != machine.gpu_label:
        raise BatchpilotError(
            "cluster.accelerator_type",
            f"{accelerator_type!r} is not the GPU of {machine_type_name} nodes ({machine.gpu_label})",
            f"set cluster.accelerator_type to {machine.gpu_label}, or correct cluster.machine_type",
        )
    if devices_per_node > machine.num_gpus:
        raise BatchpilotError(
            "cluster.devices_per_node",
            f"{devices_per_node} exceeds the {machine.num_gpus} GPU(s) of machine type {machine_type_name}",
            f"set at most {machine.num_gpus}, or use a larger machine type",
        )


@dataclass(frozen=True)
class TrainerResources:
    """What one trainer pod asks for: whole CPU cores and memory in bytes (requests and limits)."""

    cpu: int
    memory_bytes: int
    source: str
    """Where the numbers came from, for the launch log: explicit, the machine type, or the nodes."""


def trainer_resources(
    *,
    machine_type_name: str | None,
    cpu_per_node: int | None,
    memory_per_node_bytes: int | None,
    node_free: Allocatable | None,
) -> TrainerResources:
    """CPU and memory of a trainer pod, from the first of these that says:

    1. `node_free`: what the pool's ready nodes offer a pod (allocatable less their DaemonSet pods'
       requests, read when launching); `cluster.cpu_per_node` / `memory_per_node_bytes` are checked
       against it and otherwise it is taken whole;
    2. `cluster.cpu_per_node` / `memory_per_node_bytes`, each checked against the machine type's
       allocatable when the type is known;
    3. `cluster.machine_type`: the cluster autoscaler's template node of that type (`template_allocatable`:
       the kernel's share, GKE's kube-reserved and the eviction threshold off the nominal memory) less the
       DaemonSet reserve: what sizes the pods of a flex-start launch and of an autoscaled pool that starts
       from zero nodes (a pod larger than the template never triggers a scale-up), and dry runs.

    Raises when none does: torchx would substitute 2 CPUs and 1024 MB, and every stage would be
    OOMKilled.
    """
    if node_free is not None:
        where = "the pool's ready nodes (allocatable less their DaemonSet pods' requests)"
        _check_fits(
            node_free, where=where, cpu_per_node=cpu_per_node, memory_per_node_bytes=memory_per_node_bytes
        )
        cpu = cpu_per_node if cpu_per_node is not None else node_free.cpu_millicores // 1000
        memory = memory_per_node_bytes if memory_per_node_bytes is not None else node_free.memory_bytes
        if cpu < 1 or memory < GIB:
            raise BatchpilotError(
                "cluster.node_pool",
                f"{where} leave {node_free.describe()}, less than 1 CPU and 1 GiB for a trainer",
                "use a larger machine type",
            )
        return TrainerResources(cpu, memory, where)
    explicit = cpu_per_node is not None and memory_per_node_bytes is not None
    # With both sizes given, a machine type the table lacks (a CPU pool, a newer series) is no obstacle.
    if machine_type_name and (machine_type_name in MACHINE_TYPES or not explicit):
        allocatable = template_allocatable(machine_type(machine_type_name))
        where = f"a node of machine type {machine_type_name} (the cluster autoscaler's template of a new one)"
    elif explicit:
        assert cpu_per_node is not None and memory_per_node_bytes is not None
        return TrainerResources(
            cpu_per_node, memory_per_node_bytes, "cluster.cpu_per_node/memory_per_node_bytes"
        )
    else:
        raise BatchpilotError(
            "cluster.machine_type",
            "is needed to size the trainer pods; without it torchx gives each pod 2 CPUs and 1024 MB",
            "set cluster.machine_type to the node pool's machine type, e.g. a3-highgpu-8g, or set both "
            "cluster.cpu_per_node and cluster.memory_per_node_bytes",
        )
    _check_fits(
        allocatable, where=where, cpu_per_node=cpu_per_node, memory_per_node_bytes=memory_per_node_bytes
    )
    derived = _less_reserve(allocatable, where=where)
    return TrainerResources(
        cpu=derived.cpu_millicores // 1000 if cpu_per_node is None else cpu_per_node,
        memory_bytes=derived.memory_bytes if memory_per_node_bytes is None else memory_per_node_bytes,
        source=where,
    )


def _check_fits(
    allocatable: Allocatable, *, where: str, cpu_per_node: int | None, memory_per_node_bytes: int | None
) -> None:
    """An explicit size larger than the node's allocatable would leave the pods Pending for ever."""
    if cpu_per_node is not None and cpu_per_node * 1000 > allocatable.cpu_millicores:
        raise BatchpilotError(
            "cluster.cpu_per_node",
            f"{cpu_per_node} CPUs do not fit {where} ({allocatable.cpu_millicores}m allocatable)",
            f"set at most {allocatable.cpu_millicores // 1000}",
        )
    if memory_per_node_bytes is not None and memory_per_node_bytes > allocatable.memory_bytes:
        raise BatchpilotError(
            "cluster.memory_per_node_bytes",
            f"{memory_per_node_bytes} bytes do not fit {where} "
            f"({allocatable.memory_bytes / GIB:.2f} GiB allocatable)",
            f"set at most {allocatable.memory_bytes}",
        )


def _less_reserve(allocatable: Allocatable, *, where: str) -> Allocatable:
    cpu = allocatable.cpu_millicores - DAEMONSET_RESERVE_MILLICORES
    memory = allocatable.memory_bytes - DAEMONSET_RESERVE_BYTES
    if cpu < 1000 or memory < GIB:
        raise BatchpilotError(
            "cluster.machine_type",
            f"{where} ({allocatable.describe()} allocatable) leaves less than 1 CPU and 1 GiB for a "
            "trainer after GKE's DaemonSets",
            "use a larger machine type, or set cluster.cpu_per_node and cluster.memory_per_node_bytes",
        )
    return Allocatable(cpu, memory)
