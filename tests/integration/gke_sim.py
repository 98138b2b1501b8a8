"""One simulated GKE cluster behind both fake APIs, for tests: `simulated_gke()`.

    with simulated_gke(ready_delay_s=0.2) as gke:
        gke.add_pool("gpu", machine_type="a3-highgpu-8g", zones=["us-central1-a"])
        gke.container.client()      # the real google-cloud-container client (REST) on the Container API
        gke.kube.api_client()       # the real kubernetes ApiClient on the Kubernetes API
        gke.write_kubeconfig(path)  # for code that reads KUBECONFIG
        gke.sim.node_objects(), gke.sim.pods, gke.sim.events   # inspect the cluster directly
        gke.sim.pool_history        # (pool, node count) after every setSize, from the start
        gke.sim.provisioning        # ProvisioningRequests and PodTemplates (provisioning_controller.py)

Node pools created through the Container API (TPU slice pools among them) join the simulated cluster
with their nodes, and leave it with them when deleted.

The control loop runs in a thread while the block lasts (`ClusterSim.running`). With
`simulated_gke(run_pods_in=folder)` bound pods run as local processes (`pod_runner.LocalKubelet`);
without it they stay Running until `gke.sim.finish_pod(namespace, name, exit_code=...)`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from container_api_server import ContainerServer, GkeClusterSim, container_server_running
from kube_api_server import KubeServer, kube_server_running
from pod_runner import LocalKubelet
from provisioning_controller import ProvisioningController

PROJECT, LOCATION, CLUSTER = "proj", "us-central1", "train"


@dataclass
class SimulatedGke:
    sim: GkeClusterSim
    container: ContainerServer
    kube: KubeServer

    def pool_path(self, pool: str) -> str:
        return f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}/nodePools/{pool}"

    def add_pool(
        self,
        pool: str,
        *,
        machine_type: str,
        zones: list[str] | None = None,
        per_zone: int = 0,
        queued_provisioning: bool = False,
        autoscaling: dict[str, Any] | None = None,
    ) -> None:
        """A node pool of `machine_type` in both APIs, with `per_zone` nodes in each zone; with
        `queued_provisioning` (and its `autoscaling`), a flex-start pool whose nodes ProvisioningRequests bring."""
        with self.container.state.lock:
            self.container.state.add_pool(
                self.pool_path(pool),
                locations=zones or [f"{LOCATION}-a"],
                node_count=per_zone,
                machine_type=machine_type,
                queued_provisioning=queued_provisioning,
                autoscaling=autoscaling,
            )

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig pointing at the Kubernetes API stand-in (set KUBECONFIG to it)."""
        return self.kube.write_kubeconfig(path)


@contextlib.contextmanager
def simulated_gke(
    *,
    ready_delay_s: float = 0.0,
    gpu_delay_s: float = 0.0,
    scale_down_unneeded_s: float = 600.0,
    run_pods_in: Path | None = None,
    kueue: Any = None,
    trainer: Any = None,
) -> Iterator[SimulatedGke]:
    """The simulated cluster; with `run_pods_in` (a folder) bound pods run there as local processes."""
    kubelet = LocalKubelet(workdir=run_pods_in) if run_pods_in else None
    sim = GkeClusterSim(
        cluster=CLUSTER,
        ready_delay_s=ready_delay_s,
        gpu_delay_s=gpu_delay_s,
        scale_down_unneeded_s=scale_down_unneeded_s,
        kubelet=kubelet,
        provisioning=ProvisioningController(),
        kueue=kueue,
        trainer=trainer,
    )
    with (
        container_server_running(sim=sim) as container,
        kube_server_running(sim=sim) as kube,
        sim.running(),
    ):
        # Queued provisioning finds a zone's room where the Container API keeps it (its stockout knob).
        sim.provisioning.zone_capacity = lambda: container.state.zone_capacity
        try:
            yield SimulatedGke(sim, container, kube)
        finally:
            if kubelet:
                kubelet.stop_all()


def start_launch(gke: SimulatedGke, plan: str, folder: Path, *, stage: str = "0") -> subprocess.Popen[str]:
    """`batchpilot launch --plan PLAN --stage STAGE` as a process against the simulated cluster (its kubeconfig
    written to `folder`), its output piped."""
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(folder / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", stage],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
