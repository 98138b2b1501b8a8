"""Trainer pods sized from the nodes the cluster really has, and a launch whose pods cannot start ends.

The simulated nodes report less memory than their machine type's nominal figure (a kernel keeps some)
and run GKE's system DaemonSets, whose requests the scheduler counts (gke_nodes.py), as real nodes do.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from kubernetes import client

from batchpilot.cluster.launch import trainer_pod_resources
from batchpilot.cluster.machines import DAEMONSET_RESERVE_BYTES, MACHINE_TYPES, gke_allocatable
from batchpilot.cluster.pending import PendingWatch
from batchpilot.config import parse_config
from helpers import gke_a3_config, tiny_config, write_plan

pytestmark = pytest.mark.slow  # a simulated cluster, and in the last test real processes

NS = "batchpilot"


def trainer_pod(cpu: int, memory_bytes: int) -> dict[str, Any]:
    """A pod asking for what a trainer pod of these sizes asks for (requests == limits), on the gpu pool."""
    resources = {"cpu": str(cpu), "memory": str(memory_bytes), "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "labels": {"app": "trainer"}},
        "spec": {
            "nodeSelector": {"cloud.google.com/gke-nodepool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "t", "image": "batchpilot:0.1.0",
                            "resources": {"requests": resources, "limits": resources}}],
        },
    }  # fmt: skip


def scheduled(cluster: Any, pod: dict[str, Any]) -> tuple[bool, str]:
    client.CoreV1Api(cluster.kube.api_client()).create_namespaced_pod(NS, pod)
    found = cluster.sim.pods[(NS, pod["metadata"]["name"])]
    message = (found["status"].get("conditions") or [{}])[0].get("message", "")
    return bool(found["spec"].get("nodeName")), message


def test_a_launch_sizes_its_pods_from_the_ready_nodes_and_they_fit(simulated_cluster, tmp_path, monkeypatch):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    monkeypatch.setenv("KUBECONFIG", str(simulated_cluster.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cluster = parse_config(gke_a3_config()).cluster
    launched = trainer_pod_resources(cluster, read_nodes=True)  # what a launch asks for
    assert launched.source.startswith("the pool's ready nodes")
    # The machine type's nominal allocatable (the documented reservations on its whole memory) less the
    # DaemonSet reserve: more than the node's kernel and its system pods leave.
    machine = MACHINE_TYPES["a3-highgpu-8g"]
    nominal = gke_allocatable(machine).memory_bytes - DAEMONSET_RESERVE_BYTES
    assert launched.memory_bytes < nominal  # the kernel and the system pods took their share
    # The nominal figure would leave the pod Pending on the real node; the nodes' figure fits it.
    fits, message = scheduled(simulated_cluster, trainer_pod(launched.cpu, nominal))
    assert not fits and message.startswith("0/1 nodes are available: 1 Insufficient memory.")
    simulated_cluster.sim.delete_pod(NS, "trainer")
    fits, message = scheduled(simulated_cluster, trainer_pod(launched.cpu, launched.memory_bytes))
    assert fits, message
    # Without nodes to read (flex-start, an autoscaled pool from zero), the pods are sized from the cluster
    # autoscaler's template of a new node, which a real node of the type offers too.
    simulated_cluster.sim.delete_pod(NS, "trainer")
    planned = trainer_pod_resources(cluster, read_nodes=False)
    assert planned.memory_bytes < launched.memory_bytes
    fits, message = scheduled(simulated_cluster, trainer_pod(planned.cpu, planned.memory_bytes))
    assert fits, message


def test_an_explicit_size_larger_than_the_nodes_offer_is_refused_at_launch(
    simulated_cluster, tmp_path, monkeypatch
):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    monkeypatch.setenv("KUBECONFIG", str(simulated_cluster.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cluster = parse_config(gke_a3_config(memory_per_node_bytes="1820GiB")).cluster  # < the table's 1824.7 GiB
    with pytest.raises(
        ValueError, match=r"^cluster.memory_per_node_bytes: .* do not fit the pool's ready nodes"
    ):
        trainer_pod_resources(cluster, read_nodes=True)


def test_a_pod_pending_past_the_bound_is_one_line_with_the_schedulers_reason(simulated_cluster):
    simulated_cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
    fits, _ = scheduled(simulated_cluster, trainer_pod(300, 8 * 2**30))  # more CPUs than a node has
    assert not fits
    clock = [time.time()]
    watch = PendingWatch(
        api_client=simulated_cluster.kube.api_client(), namespace=NS, selector="app=trainer", bound_s=300,
        clock=lambda: clock[0],
    )  # fmt: skip
    assert watch.problem() is None  # within the bound
    clock[0] += 301
    problem = watch.problem()
    assert problem is not None and problem.startswith("pod trainer has been Pending for 30")
    assert "FailedScheduling: 0/1 nodes are available: 1 Insufficient cpu." in problem


def test_a_launch_whose_pod_never_schedules_ends_with_the_reason_and_deletes_its_jobset(
    simulated_cluster, tmp_path
):
    # A node selector no node of the pool carries: the scheduler says so, and the launch must not wait
    # for days.
    simulated_cluster.add_pool("cpu", machine_type="e2-standard-4", per_zone=1)
    config = tiny_config(data_uri="gs://bucket/data", checkpoint_uri="gs://bucket/ckpt")
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="cpu",
        image="batchpilot:0.1.0", cpu_per_node=1, memory_per_node_bytes=2**30,
        node_selector={"example.com/team": "nlp"}, pending_timeout_s=2,
    )  # fmt: skip
    plan = write_plan(tmp_path, config)
    env = {"KUBECONFIG": str(simulated_cluster.write_kubeconfig(tmp_path / "kubeconfig")), "PATH": "/usr/bin"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "0"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    errors = [line for line in result.stderr.splitlines() if line.startswith("batchpilot: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith("batchpilot: error: cluster.pending_timeout_s: tiny-")
    assert (
        "FailedScheduling: 0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector"
        in (errors[0])
    )
    assert "Traceback" not in result.stderr
    assert not simulated_cluster.sim.jobsets  # deleted, not left holding the pool
