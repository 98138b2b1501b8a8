"""The trainer pods batchpilot renders for a GPU machine type, placed by the simulated cluster's scheduler.

The JobSet is the one `batchpilot launch --dryrun` prints; the simulator's nodes carry GKE's labels,
GPU taint and allocatable (capacity minus GKE's reservations), so a pod asking for more than a node
can give, or for the wrong labels, stays Pending with the scheduler's reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot.cli import main
from helpers import tiny_config, write_plan

NS = "batchpilot"


def rendered_jobset(folder: Path, capsys: pytest.CaptureFixture[str], *, stage: str) -> dict[str, Any]:
    config = tiny_config(data_uri="gs://unused/data", checkpoint_uri="gs://unused/ckpt")  # gke: no file://
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="gpu",
        image="batchpilot:0.1.0", machine_type="a3-highgpu-8g", accelerator_type="nvidia-h100-80gb",
        devices_per_node=8,
    )  # fmt: skip
    config["batch"]["micro_batch_size"] = 2
    plan = write_plan(folder, config)
    capsys.readouterr()
    assert main(["launch", "--plan", plan, "--stage", stage, "--dryrun"]) == 0
    text = capsys.readouterr().out
    return next(
        d for d in yaml.safe_load_all(text[text.index("apiVersion:") :]) if d and d.get("kind") == "JobSet"
    )


def create(cluster: Any, jobset: dict[str, Any]) -> None:
    from kubernetes import client

    client.CustomObjectsApi(cluster.kube.api_client()).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", jobset
    )


def test_the_trainer_pod_for_a3_highgpu_8g_fits_one_such_node(simulated_cluster, tmp_path, capsys):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    create(simulated_cluster, rendered_jobset(tmp_path, capsys, stage="0"))
    (pod,) = simulated_cluster.sim.pods.values()
    reasons = [e["message"] for e in simulated_cluster.sim.events if e["reason"] == "FailedScheduling"]
    assert pod["spec"].get("nodeName"), reasons


def test_a_stage_needing_more_nodes_than_the_pool_has_leaves_a_pod_pending_with_the_reason(
    simulated_cluster, tmp_path, capsys
):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    create(simulated_cluster, rendered_jobset(tmp_path, capsys, stage="1"))  # stage 1 runs on 2 nodes
    pending = [p for p in simulated_cluster.sim.pods.values() if not p["spec"].get("nodeName")]
    assert len(pending) == 1
    (condition,) = pending[0]["status"]["conditions"]
    assert condition["message"].startswith("0/1 nodes are available: 1 Insufficient ")
