"""Which GPUDirect networking stack a GPU machine type needs, and the settings it cannot work with.

Pure: the planner calls `gpudirect_problems` for `config check`, `plan` and `compile`;
`batchpilot.cluster.gpudirect` renders the pod spec from the same table.

GKE's "Maximize GPU network bandwidth in Standard mode clusters" (kubernetes-engine/docs/how-to/
gpu-bandwidth-gpudirect-tcpx) gives an A3 High node four GPU NICs driven by GPUDirect-TCPX and an A3 Mega
node eight driven by GPUDirect-TCPXO; "Run AI workloads with GPUDirect RDMA" (kubernetes-engine/docs/
how-to/gpu-bandwidth-gpudirect-rdma) gives A3 Ultra and A4 nodes eight RDMA NICs. A pod reaches them only
through GKE's multi-networking: it names one GKE `Network` object per NIC in its
`networking.gke.io/interfaces` annotation. The guides create those objects as vpc1..vpc4 (TCPX),
vpc1..vpc8 (TCPXO) and rdma-0..rdma-7 (RDMA); those are the defaults here, and
`cluster.gpudirect_networks` names others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchpilot.errors import BatchpilotError
from batchpilot.planning.names import is_dns1123_label

StackName = Literal["tcpx", "tcpxo", "rdma"]


@dataclass(frozen=True)
class GPUDirectStack:
    """One GPUDirect stack as GKE documents it.

    Attributes:
        name: tcpx, tcpxo or rdma.
        title: the name GKE's guides use.
        default_networks: the GKE Network objects the guide creates, in NIC order.
        first_interface: the pod interface (ethN) of the first GPU NIC; eth0 is the primary network.
    """

    name: StackName
    title: str
    default_networks: tuple[str, ...]
    first_interface: int

    @property
    def num_nics(self) -> int:
        return len(self.default_networks)


TCPX = GPUDirectStack("tcpx", "GPUDirect-TCPX", tuple(f"vpc{i}" for i in range(1, 5)), 1)
TCPXO = GPUDirectStack("tcpxo", "GPUDirect-TCPXO", tuple(f"vpc{i}" for i in range(1, 9)), 1)
# The RDMA guide's pods take eth2..eth9 for rdma-0..rdma-7: the node's second gVNIC (GKE Network gvnic-1)
# is eth1 on the node and is not attached to the pod.
RDMA = GPUDirectStack("rdma", "GPUDirect RDMA", tuple(f"rdma-{i}" for i in range(8)), 2)

MACHINE_STACKS: dict[str, GPUDirectStack] = {
    "a3-highgpu-8g": TCPX,
    "a3-megagpu-8g": TCPXO,
    "a3-ultragpu-8g": RDMA,
    "a4-highgpu-8g": RDMA,
}
"""The machine types with GPU NICs; any other type (the smaller A3 High types included, which have no GPU
NICs) trains over the primary network alone."""


PRIMARY_NIC_GBPS: dict[str, int] = {"a3-highgpu-8g": 200, "a3-megagpu-8g": 200}
"""The primary NIC's bandwidth (GKE's GPUDirect guide: up to 200 Gbps on A3's primary NIC): what crosses
nodes with `gpudirect: off`. A3 Ultra and A4 are absent: the guides give no figure for their primary NIC."""


def gpudirect_stack(*, gpudirect: str, machine_type: str | None) -> GPUDirectStack | None:
    """The stack the trainers' pods use: the machine type's with `gpudirect: auto`, none with `off`."""
    if gpudirect == "off" or machine_type is None:
        return None
    return MACHINE_STACKS.get(machine_type)


def gpudirect_problems(
    *, backend: str, gpudirect: str, machine_type: str | None, gpudirect_networks: list[str] | None
) -> list[BatchpilotError]:
    """Every GPUDirect setting that cannot work, one error each naming the field and the fix. The
    arguments are the `cluster.` fields of the same names."""
    if gpudirect_networks is None:
        return []
    stack = gpudirect_stack(gpudirect=gpudirect, machine_type=machine_type)
    field = "cluster.gpudirect_networks"
    if backend != "gke" or stack is None:
        why = (
            f"cluster.backend is {backend}"
            if backend != "gke"
            else "cluster.gpudirect is off"
            if gpudirect == "off"
            else f"machine type {machine_type} has no GPU NICs (GPUDirect is for {', '.join(MACHINE_STACKS)})"
        )
        return [BatchpilotError(field, f"is set but no GPUDirect networking is used: {why}", "remove it")]
    problems: list[BatchpilotError] = []
    if len(gpudirect_networks) != stack.num_nics:
        problems.append(
            BatchpilotError(
                field,
                f"{machine_type} has {stack.num_nics} GPU NICs ({stack.title}) but {len(gpudirect_networks)} "
                "network names are given",
                f"list the {stack.num_nics} GKE Network objects of the node pool's GPU NICs in NIC order "
                f"(GKE's guide names them {', '.join(stack.default_networks)}), or remove the setting to use "
                "those names",
            )
        )
    bad = [name for name in gpudirect_networks if not is_dns1123_label(name) or name == "default"]
    if bad:
        problems.append(
            BatchpilotError(
                field,
                f"{', '.join(repr(name) for name in bad)} cannot name a GPU NIC's GKE Network ('default' is "
                "the primary network; names are lower case letters, digits and '-')",
                "use the names of the Network objects made for the GPU NICs (`kubectl get networks`)",
            )
        )
    if len(set(gpudirect_networks)) != len(gpudirect_networks):
        problems.append(
            BatchpilotError(field, "names a network twice", "give each GPU NIC its own GKE Network object")
        )
    return problems
