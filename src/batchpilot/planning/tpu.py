"""TPU slices on GKE: the TPU types, their machine types and the slice topologies each can form.

On GKE a TPU "node" is one TPU VM (a host) with a few chips; a stage runs on one *slice*, a set of hosts
joined by the chips' interconnect (ICI) in one of the topologies the type supports. A multi-host slice is
created whole by one node pool (`placement_policy.tpu_topology`) and cannot be resized node by node, so a
stage's node count must be the host count of a valid topology: hosts = chips of the topology / chips per
host of the machine type.

The tables come from Google's GKE and Cloud TPU documentation ("Plan TPUs in GKE", "TPU v5e", "TPU v5p",
"TPU v6e"): the label is the node label `cloud.google.com/gke-tpu-accelerator`, the topology the label
`cloud.google.com/gke-tpu-topology` and the node pool's `placement_policy.tpu_topology`. Memory is the
data sheet's HBM per chip (GB read as GiB, a slight overestimate the memory model's reserve covers);
peaks are the data sheets' bf16 per chip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from batchpilot.errors import BatchpilotError

_GIB = 2**30

TPU_RESOURCE_NAME = "google.com/tpu"
"""The extended resource a TPU node advertises, one per chip."""


@dataclass(frozen=True)
class TpuMachine:
    """A GKE TPU machine type: its chips per VM and the topologies a pool of it can form.

    Attributes:
        name: the GKE machine type, e.g. `ct6e-standard-4t`.
        chips_per_host: TPU chips on one VM (the `google.com/tpu` allocatable of the node).
        topologies: the slice topologies a node pool of this machine type can have, smallest first.
    """

    name: str
    chips_per_host: int
    topologies: tuple[str, ...]


@dataclass(frozen=True)
class TpuType:
    """A GKE TPU type (the `cloud.google.com/gke-tpu-accelerator` label).

    Attributes:
        label: e.g. `tpu-v6e-slice`.
        version: the Cloud TPU name, e.g. `v6e`.
        machines: its machine types; `multi_host` names the one whose pools form multi-host slices.
        multi_host: the machine type of multi-host slices (the default `cluster.machine_type`).
        memory_bytes: HBM of one chip.
        peak_bf16_flops: dense bf16 peak of one chip.
    """

    label: str
    version: str
    machines: tuple[TpuMachine, ...]
    multi_host: str
    memory_bytes: int
    peak_bf16_flops: float

    def machine(self, name: str | None) -> TpuMachine:
        """The machine type `name` (None: the multi-host one).

        Raises:
            BatchpilotError: `name` is not a machine type of this TPU type.
        """
        wanted = name or self.multi_host
        for machine in self.machines:
            if machine.name == wanted:
                return machine
        known = ", ".join(machine.name for machine in self.machines)
        raise BatchpilotError(
            "cluster.machine_type",
            f"{wanted!r} is not a machine type of {self.label} ({self.version})",
            f"use one of {known}",
        )


_2D_MULTI_HOST = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_V5P = (
    "2x2x1",
    "2x2x2",
    "2x2x4",
    "2x4x4",
    "4x4x4",
    "4x4x8",
    "4x8x8",
    "8x8x8",
    "8x8x16",
    "8x16x16",
    "16x16x16",
    "16x16x24",
)

TPU_TYPES: dict[str, TpuType] = {
    tpu.label: tpu
    for tpu in (
        # v5e: 197 TFLOPS bf16 and 16 GB HBM2 per chip; 1, 4 or 8 chips per VM; 2D slices up to 16x16.
        TpuType(
            label="tpu-v5-lite-podslice",
            version="v5e",
            machines=(
                TpuMachine("ct5lp-hightpu-1t", 1, ("1x1",)),
                TpuMachine("ct5lp-hightpu-4t", 4, _2D_MULTI_HOST),
                TpuMachine("ct5lp-hightpu-8t", 8, ("2x4",)),
            ),
            multi_host="ct5lp-hightpu-4t",
            memory_bytes=16 * _GIB,
            peak_bf16_flops=197e12,
        ),
        # v6e (Trillium): 918 TFLOPS bf16 and 32 GB HBM per chip; the same 2D shapes as v5e.
        TpuType(
            label="tpu-v6e-slice",
            version="v6e",
            machines=(
                TpuMachine("ct6e-standard-1t", 1, ("1x1",)),
                TpuMachine("ct6e-standard-4t", 4, _2D_MULTI_HOST),
                TpuMachine("ct6e-standard-8t", 8, ("2x4",)),
            ),
            multi_host="ct6e-standard-4t",
            memory_bytes=32 * _GIB,
            peak_bf16_flops=918e12,
        ),
        # v5p: 459 TFLOPS bf16 and 95 GB HBM2e per chip; 4 chips per VM; 3D slices (the documented shapes).
        TpuType(
            label="tpu-v5p-slice",
            version="v5p",
            machines=(TpuMachine("ct5p-hightpu-4t", 4, _V5P),),
            multi_host="ct5p-hightpu-4t",
            memory_bytes=95 * _GIB,
            peak_bf16_flops=459e12,
        ),
    )
}
"""The TPU types batchpilot can plan for, by GKE accelerator label."""


def is_tpu(accelerator_type: str | None) -> bool:
    """Whether `cluster.accelerator_type` names a TPU (GKE's TPU labels start with `tpu-`)."""
    return bool(accelerator_type) and str(accelerator_type).startswith("tpu-")


def tpu_type(accelerator_type: str) -> TpuType:
    """The TPU type of a `tpu-...` label.

    Raises:
        BatchpilotError: an unknown TPU label, naming the known ones.
    """
    found = TPU_TYPES.get(accelerator_type)
    if found is None:
        raise BatchpilotError(
            "cluster.accelerator_type",
            f"{accelerator_type!r} is not a TPU type batchpilot knows",
            f"use one of {', '.join(TPU_TYPES)}",
        )
    return found


def topology_chips(topology: str) -> int:
    """Chips in a topology such as `4x8` or `2x2x4` (the product of its dimensions)."""
    return math.prod(int(dimension) for dimension in topology.split("x"))


@dataclass(frozen=True)
class TpuSlice:
    """One slice shape a stage can run on.

    Attributes:
        topology: e.g. `4x8`.
        chips: chips in the slice (the stage's devices).
        hosts: TPU VMs, i.e. Kubernetes nodes (the stage's node count, pods of its JobSet).
        machine_type: the VMs' machine type.
    """

    topology: str
    chips: int
    hosts: int
    machine_type: str

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


@dataclass(frozen=True)
class TpuSlices:
    """The slices of one TPU type and machine type: what the node walk may choose from."""

    tpu: TpuType
    machine: TpuMachine

    @property
    def chips_per_host(self) -> int:
        return self.machine.chips_per_host

    @property
    def slices(self) -> tuple[TpuSlice, ...]:
        shapes = []
        for topology in self.machine.topologies:
            chips = topology_chips(topology)
            if chips % self.chips_per_host == 0:
                shapes.append(TpuSlice(topology, chips, chips // self.chips_per_host, self.machine.name))
        return tuple(shapes)

    def host_counts(self) -> list[int]:
        """Every node count a stage may have, ascending."""
        return sorted({shape.hosts for shape in self.slices})

    def for_hosts(self, hosts: int) -> TpuSlice:
        """The slice of `hosts` VMs (the first listed topology when two shapes have as many chips).

        Raises:
            BatchpilotError: no topology has that many hosts, naming the nearest that do.
        """
        for shape in self.slices:
            if shape.hosts == hosts:
                return shape
        raise BatchpilotError(
            "cluster",
            f"{hosts} {self.machine.name} host(s) ({hosts * self.chips_per_host} chips) form no "
            f"{self.tpu.label} slice",
            f"use {self.nearest(hosts)}",
        )

    def nearest(self, hosts: int) -> str:
        """The valid slices just below and above `hosts` hosts, as `N hosts (topology)` text."""
        below = [shape for shape in self.slices if shape.hosts < hosts]
        above = [shape for shape in self.slices if shape.hosts > hosts]
        picked = ([below[-1]] if below else []) + ([above[0]] if above else [])
        return " or ".join(
            f"{shape.hosts} host(s) ({shape.topology}, {shape.chips} chips)" for shape in picked
        )


def tpu_slices(*, accelerator_type: str, machine_type: str | None, devices_per_node: int) -> TpuSlices:
    """The slices a `cluster` section's TPU type and machine type can form.

    Raises:
        BatchpilotError: an unknown TPU type or machine type, or `devices_per_node` that is not the machine
            type's chips per VM.
    """
    tpu = tpu_type(accelerator_type)
    machine = tpu.machine(machine_type)
    if devices_per_node != machine.chips_per_host:
        raise BatchpilotError(
            "cluster.devices_per_node",
            f"{devices_per_node} is not the chips per host of {machine.name} ({machine.chips_per_host})",
            f"set cluster.devices_per_node to {machine.chips_per_host}",
        )
    return TpuSlices(tpu, machine)


def check_host_range(slices: TpuSlices, *, min_nodes: int, max_nodes: int) -> list[int]:
    """The host counts in [min_nodes, max_nodes] that are whole slices.

    Raises:
        BatchpilotError: none is, or `max_nodes` itself is not one (the final stage would never get it):
            names the nearest valid host counts and their topologies.
    """
    counts = [hosts for hosts in slices.host_counts() if min_nodes <= hosts <= max_nodes]
    if max_nodes not in slices.host_counts():
        raise BatchpilotError(
            "cluster.max_nodes",
            f"{max_nodes} {slices.machine.name} hosts ({max_nodes * slices.chips_per_host} chips) form no "
            f"{slices.tpu.label} slice (valid: "
            + ", ".join(f"{shape.topology}={shape.hosts}" for shape in slices.slices)
            + ")",
            f"use {slices.nearest(max_nodes)}",
        )
    if not counts:
        raise BatchpilotError(
            "cluster.min_nodes",
            f"no {slices.tpu.label} slice has between {min_nodes} and {max_nodes} hosts",
            f"use {slices.nearest(min_nodes)}",
        )
    return counts


def slice_pool_name(node_pool: str, topology: str) -> str:
    """The GKE node pool of one slice shape: `cluster.node_pool` and the topology, e.g. `v6e-4x8` (GKE
    pool names allow lower-case letters, digits and dashes; `x` is a letter)."""
    return f"{node_pool}-{topology}"


_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")  # us-central2-b; a region (us-central2) has no zone letter


def is_zone(location: str | None) -> bool:
    """Whether a GKE location is a zone (a multi-host slice lives in one zone), not a region."""
    return bool(location) and bool(_ZONE.match(str(location)))
