"""The trainer pods batchpilot renders for a GPU machine type, placed by the simulated cluster's scheduler.

The JobSet is the one a launch creates (sized from the pool's ready nodes, as `batchpilot launch` does
after the resize); the simulator's nodes carry GKE's labels, GPU taint and allocatable (the kernel's
capacity minus GKE's reservations) and run system DaemonSet pods, so a pod asking for more than a node
can give, or for the wrong labels, stays Pending with the scheduler's reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchpilot.cluster import launch, launch_spec
from batchpilot.plan.rundoc import read_run_document
from batchpilot.workflow.stage import select_launch
from helpers import gke_a3_config, write_plan

NS = "batchpilot"


def rendered_jobset(
    cluster: Any, folder: Path, monkeypatch: pytest.MonkeyPatch, *, stage: str
) -> dict[str, Any]:
    """The JobSet a launch of `stage` would create on `cluster`'s pool, without creating it."""
    document = read_run_document(write_plan(folder, gke_a3_config()))
    monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(folder / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    spec = launch_spec.cluster_launch_spec(
        run_name="tiny",
        launch=select_launch(document, stage),
        devices_per_node=8,
        plan_text=document.to_json(),
    )
    cluster_config = document.config.cluster
    appdef = launch.cluster_appdef(spec, cluster=cluster_config, read_nodes=True)
    info = launch.render_cluster_job(
        launch.cluster_runner(), appdef, cluster=cluster_config, labels=spec.labels
    )
    return info.request.resource


def create(cluster: Any, jobset: dict[str, Any]) -> None:
    from kubernetes import client

    client.CustomObjectsApi(cluster.kube.api_client()).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", jobset
    )


def test_the_trainer_pod_for_a3_highgpu_8g_fits_one_such_node(simulated_cluster, tmp_path, monkeypatch):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    create(simulated_cluster, rendered_jobset(simulated_cluster, tmp_path, monkeypatch, stage="0"))
    (pod,) = simulated_cluster.sim.pods.values()
    reasons = [e["message"] for e in simulated_cluster.sim.events if e["reason"] == "FailedScheduling"]
    assert pod["spec"].get("nodeName"), reasons


def test_a_stage_needing_more_nodes_than_the_pool_has_leaves_a_pod_pending_with_the_reason(
    simulated_cluster, tmp_path, monkeypatch
):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    create(
        simulated_cluster, rendered_jobset(simulated_cluster, tmp_path, monkeypatch, stage="1")
    )  # stage 1 runs on 2 nodes
    pending = [p for p in simulated_cluster.sim.pods.values() if not p["spec"].get("nodeName")]
    assert len(pending) == 1
    (condition,) = pending[0]["status"]["conditions"]
    assert condition["message"].startswith("0/1 nodes are available: 1 Insufficient ")
