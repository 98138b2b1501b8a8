"""The trainer pod's GPUDirect networking on A3 and A4 nodes: config in, pod-spec fragments out (pure).

Without it NCCL crosses nodes over the primary NIC alone (200 Gbps on A3), a fraction of the GPU NICs'
800 to 3,200 Gbps. `cluster.gpudirect: auto` renders, from `cluster.machine_type`
(`batchpilot.planning.gpudirect.MACHINE_STACKS`):

- the multi-network annotations: eth0 on the primary network, one interface per GPU NIC on the GKE Network
  objects `cluster.gpudirect_networks` names;
- TCPX (A3 High) and TCPXO (A3 Mega): the receive-path daemon as a native sidecar (an init container with
  restartPolicy Always: it starts before the trainer and runs beside it), the NRI device annotation that
  gives it the GPUs, and the host folders it and NCCL share;
- the trainer container's host mounts (the NCCL plugin the node pool's installer DaemonSet put under
  /home/kubernetes/bin), its environment and the NCCL settings script to source before torchrun.

Every name, image, path and variable below is from GKE's guides: "Maximize GPU network bandwidth in Standard
mode clusters" (cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx) and "Run AI
workloads with GPUDirect RDMA" (.../how-to/gpu-bandwidth-gpudirect-rdma), with the values of the public
manifests they apply (GoogleCloudPlatform/container-engine-accelerators: gpudirect-tcpx/nccl-test-latest.yaml
and nccl-config.yaml, gpudirect-tcpxo/nccl-test-latest.yaml and README.md, gpudirect-rdma/nccl-test.yaml).
/dev/shm (a memory-backed emptyDir, which the guides mount) comes with every torchx pod already, and the
guides' LD_LIBRARY_PATH=/usr/local/nvidia/lib64 with the image (the Dockerfile's LD_LIBRARY_PATH starts
with it; setting it here would drop the rest).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from batchpilot.config import ClusterConfig
from batchpilot.planning.gpudirect import RDMA, TCPX, TCPXO, GPUDirectStack, gpudirect_stack

DEFAULT_INTERFACE_ANNOTATION = "networking.gke.io/default-interface"
INTERFACES_ANNOTATION = "networking.gke.io/interfaces"
# The NRI device injector (container-engine-accelerators/nri_device_injector) gives the named container
# these device files; the daemon needs the GPUs without asking the device plugin for them.
DEVICES_ANNOTATION_PREFIX = "devices.gke.io/container."
GPU_DEVICE_FILES = (*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidiactl", "/dev/nvidia-uvm")

# Host folders the installers fill, and where the guides mount them.
NVIDIA_HOST_DIR = "/home/kubernetes/bin/nvidia"
NVIDIA_DIR = "/usr/local/nvidia"
NVIDIA_LIB_DIR = f"{NVIDIA_DIR}/lib64"
GIB_HOST_DIR = "/home/kubernetes/bin/gib"
GIB_DIR = "/usr/local/gib"
TCPX_SOCKET_DIR = "/run/tcpx"
APERTURE_DIR = "/dev/aperture_devices"

TCPX_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
TCPXO_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21"

# The NCCL settings GKE lists for GPUDirect-TCPX (nccl-config.yaml's run-nccl.sh), except the interface
# list, which follows the NICs. The CPU bindings are A3 High's (208 vCPUs, the NICs' NUMA nodes).
TCPX_NCCL_ENV = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_ALGO": "Ring,Tree",
    "NCCL_PROTO": "Simple",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_PXN_LEVEL": "0",
    "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
    "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_BUFFSIZE": "4194304",
    "NCCL_NSOCKS_PERTHREAD": "4",
    "NCCL_SOCKET_NTHREADS": "1",
    "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177",
    "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191",
    "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
    # The plugin looks for the daemon's sockets here. GKE's example mounts the socket folder over the
    # workload's /tmp instead (the plugin's default); the trainer keeps its own /tmp (HOME, the run document).
    "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET_DIR,
}


@dataclass(frozen=True)
class GPUDirectPod:
    """What a trainer pod needs for one GPUDirect stack.

    Attributes:
        stack: the stack (tcpx, tcpxo, rdma) and its NIC count.
        annotations: pod annotations (multi-networking; the daemon's devices).
        sidecars: init containers with restartPolicy Always (the receive-path daemon), or none.
        volumes: pod volumes the sidecars mount.
        trainer_mounts: (host path, container path, read-only) of the trainer container's host mounts.
        trainer_env: the trainer container's environment.
        setup_script: the NCCL settings script the trainer's command sources before torchrun ("": none).
    """

    stack: GPUDirectStack
    annotations: dict[str, str]
    sidecars: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    trainer_mounts: tuple[tuple[str, str, bool], ...] = ()
    trainer_env: dict[str, str] = field(default_factory=dict)
    setup_script: str = ""

    def setup_command(self) -> str:
        """The start of the trainer's bash line: the settings script sourced, or one line and exit 1 when
        the node lacks it (the plugin's installer DaemonSet is not on the pool); "" without a script."""
        if not self.setup_script:
            return ""
        missing = (
            f"batchpilot: {self.setup_script} is missing on this node: {self.stack.title} needs the NCCL plugin "
            "installer DaemonSet of GKE on the node pool (docs/cluster.md, GPUDirect networking)"
        )
        return f"{{ [ -r {self.setup_script} ] || {{ echo '{missing}' >&2; exit 1; }}; }} && source {self.setup_script} && "


def gpudirect_pod(cluster: ClusterConfig) -> GPUDirectPod | None:
    """The GPUDirect pod fragments for `cluster`, or None (`gpudirect: off`, or a machine type without GPU
    NICs). Assumes a checked config (`planning.gpudirect.gpudirect_problems`)."""
    stack = gpudirect_stack(gpudirect=cluster.gpudirect, machine_type=cluster.machine_type)
    if stack is None:
        return None
    networks = tuple(cluster.gpudirect_networks or stack.default_networks)
    annotations = network_annotations(networks, first_interface=stack.first_interface)
    if stack is TCPX:
        return _tcpx(annotations, networks)
    if stack is TCPXO:
        return _tcpxo(annotations)
    assert stack is RDMA, stack
    return GPUDirectPod(
        stack=RDMA,
        annotations=annotations,
        trainer_mounts=((NVIDIA_HOST_DIR, NVIDIA_DIR, True), (GIB_HOST_DIR, GIB_DIR, True)),
        setup_script=f"{GIB_DIR}/scripts/set_nccl_env.sh",
    )


def network_annotations(networks: tuple[str, ...], *, first_interface: int) -> dict[str, str]:
    """eth0 on the primary network (the pod's default route), then one interface per GPU NIC's Network."""
    interfaces = [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{first_interface + i}", "network": name} for i, name in enumerate(networks)
    ]
    return {DEFAULT_INTERFACE_ANNOTATION: "eth0", INTERFACES_ANNOTATION: json.dumps(interfaces)}


def _devices_annotation(container: str, extra: tuple[str, ...] = ()) -> dict[str, str]:
    paths = GPU_DEVICE_FILES + extra
    return {DEVICES_ANNOTATION_PREFIX + container: "".join(f"- path: {path}\n" for path in paths)}


def _host_volume(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path}}


def _daemon(
    *, name: str, image: str, capabilities: list[str], mounts: list[dict[str, str]], **command: Any
) -> dict[str, Any]:
    """The receive-path daemon as a native sidecar. It runs as root with only the capabilities GKE's guide
    adds: the image's user in GKE's manifests, while the pod's securityContext asks for the trainer's
    non-root user, which would not hold the capabilities."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "Always",
        "restartPolicy": "Always",
        **command,
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "capabilities": {"add": capabilities},
        },
        "volumeMounts": mounts,
        "env": [{"name": "LD_LIBRARY_PATH", "value": NVIDIA_LIB_DIR}],
    }


# The daemons read the host's sysfs and /proc/sys through these mounts (the guides' unprivileged variant).
_SYS_VOLUMES = [_host_volume("gpudirect-sys", "/sys"), _host_volume("gpudirect-proc-sys", "/proc/sys")]
_SYS_MOUNTS = [
    {"name": "gpudirect-sys", "mountPath": "/hostsysfs"},
    {"name": "gpudirect-proc-sys", "mountPath": "/hostprocsysfs"},
]
_LIB_VOLUME = _host_volume("gpudirect-nvidia-lib", f"{NVIDIA_HOST_DIR}/lib64")
_LIB_MOUNT = {"name": "gpudirect-nvidia-lib", "mountPath": NVIDIA_LIB_DIR}


def _tcpx(annotations: dict[str, str], networks: tuple[str, ...]) -> GPUDirectPod:
    daemon = _daemon(
        name="tcpx-daemon",
        image=TCPX_DAEMON_IMAGE,
        capabilities=["NET_ADMIN"],
        mounts=[_LIB_MOUNT, {"name": "gpudirect-tcpx-socket", "mountPath": TCPX_SOCKET_DIR}, *_SYS_MOUNTS],
        command=[
            "/tcpgpudmarxd/build/app/tcpgpudmarxd",
            "--gpu_nic_preset", "a3vm",
            "--gpu_shmem_type", "fd",
            "--uds_path", TCPX_SOCKET_DIR,
            "--setup_param", "\"--verbose 128 2 0 \"",
        ],
    )  # fmt: skip
    gpu_nics = ",".join(f"eth{TCPX.first_interface + i}" for i in range(len(networks)))
    return GPUDirectPod(
        stack=TCPX,
        annotations={**annotations, **_devices_annotation("tcpx-daemon")},
        sidecars=[daemon],
        volumes=[_LIB_VOLUME, _host_volume("gpudirect-tcpx-socket", TCPX_SOCKET_DIR), *_SYS_VOLUMES],
        # The trainer reads the plugin and connects to the daemon's sockets.
        trainer_mounts=(
            (f"{NVIDIA_HOST_DIR}/lib64", NVIDIA_LIB_DIR, True),
            (TCPX_SOCKET_DIR, TCPX_SOCKET_DIR, False),
        ),
        trainer_env={
            **TCPX_NCCL_ENV,
            "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": gpu_nics,
        },
    )


def _tcpxo(annotations: dict[str, str]) -> GPUDirectPod:
    daemon = _daemon(
        name="tcpxo-daemon",
        image=TCPXO_DAEMON_IMAGE,
        capabilities=["NET_ADMIN", "NET_BIND_SERVICE"],
        mounts=[_LIB_MOUNT, *_SYS_MOUNTS],
        command=["/bin/sh", "-c"],
        args=[
            "set -ex\nchmod 755 /fts/entrypoint_rxdm_container.sh\n"
            "/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8"
        ],
    )
    return GPUDirectPod(
        stack=TCPXO,
        annotations={**annotations, **_devices_annotation("tcpxo-daemon", ("/dev/dmabuf_import_helper",))},
        sidecars=[daemon],
        volumes=[_LIB_VOLUME, *_SYS_VOLUMES],
        trainer_mounts=(
            (f"{NVIDIA_HOST_DIR}/lib64", NVIDIA_LIB_DIR, True),
            (APERTURE_DIR, APERTURE_DIR, False),
        ),
        # The guide's NCCL settings come from the installer's nccl-env-profile.sh (sourced at start), so they
        # follow the installed plugin's version.
        trainer_env={
            "NCCL_LIB_DIR": NVIDIA_LIB_DIR,
            "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": APERTURE_DIR,
        },
        setup_script=f"{NVIDIA_LIB_DIR}/nccl-env-profile.sh",
    )


def add_to_pod_overlay(overlay: dict[str, Any], direct: GPUDirectPod) -> None:
    """Adds the pod-level fragments (annotations, sidecars, their volumes) to a torchx V1Pod overlay."""
    overlay.setdefault("metadata", {}).setdefault("annotations", {}).update(direct.annotations)
    spec = overlay.setdefault("spec", {})
    if direct.sidecars:
        spec.setdefault("initContainers", []).extend(copy.deepcopy(direct.sidecars))
    spec.setdefault("volumes", []).extend(copy.deepcopy(direct.volumes))
