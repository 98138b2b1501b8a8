"""Issue #37: flex-start capacity through Kueue's ProvisioningRequest admission check
(`cluster.provisioning: flex-start` with `cluster.kueue_queue`). batchpilot writes no request of its own: Kueue
(kueue_controller.py) reserves quota, creates the request, and admits the Workload once GKE's queued provisioning
(provisioning_controller.py) has provisioned it; the pods carry Kueue's consume annotation.

`batchpilot launch` runs as a process against the simulated cluster, as in test_kueue_sim.py; the pods run no
process here: the test ends them as a trainer would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke, start_launch
from kueue_controller import MANAGED_LABEL, KueueController
from test_kueue_sim import H100, NS, QUEUE, pods_of, wait_for, workload_of

from batchpilot.cluster.provisioning import CLASS_ANNOTATION, CONSUME_ANNOTATION, PROVISIONING_CLASS
from helpers import gke_a3_config, write_plan

CHECK = "dws"


def kueue_with_check(**check: Any) -> KueueController:
    """A ClusterQueue of one node's GPUs whose Workloads pass the ProvisioningRequest admission check `dws`
    (GKE's class); `check` overrides `add_provisioning_check`'s settings."""
    kueue = KueueController()
    kueue.add_flavor("h100", node_labels=H100)
    kueue.add_cluster_queue(
        "team", quota={"h100": {"cpu": "1000", "memory": "10000Gi", "nvidia.com/gpu": "8"}},
        admission_checks=(CHECK,),
    )  # fmt: skip
    kueue.add_local_queue(NS, QUEUE, cluster_queue="team")
    kueue.add_provisioning_check(CHECK, config="dws-config", **{"backoff_base_s": 1, **check})
    return kueue


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    """Pool `gpu` made for flex-start (queued provisioning, autoscaling up to 2 nodes, none yet)."""
    with simulated_gke(kueue=kueue_with_check(backoff_limit_count=1)) as cluster:
        cluster.add_pool(
            "gpu", machine_type="a3-highgpu-8g", queued_provisioning=True,
            autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2},
        )  # fmt: skip
        yield cluster


def launch(gke: SimulatedGke, folder: Path, **cluster: object):  # type: ignore[no-untyped-def]
    config = gke_a3_config(
        namespace=NS, kueue_queue=QUEUE, provisioning="flex-start", cpu_per_node=200,
        memory_per_node_bytes="1700GiB", stage_timeout_s=7200, **cluster,
    )  # fmt: skip
    proc = start_launch(gke, write_plan(folder, config), folder)
    (ours,) = wait_for(lambda: [k[1] for k in gke.sim.jobsets], proc=proc)
    return proc, ours


def posts(gke: SimulatedGke, suffix: str) -> list[dict[str, Any]]:
    return [b for m, p, _, b in list(gke.kube.state.requests) if m == "POST" and p.endswith(suffix)]


def test_a_launch_is_admitted_through_the_check_and_its_pods_consume_kueues_request(gke, tmp_path):
    gke.container.state.zone_capacity = {"us-central1-a": 0}  # GKE keeps the request waiting at first
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=120)
    waiting = "no queued-provisioning node pool 'gpu' can take 1 node(s) in one zone now"
    wait_for(lambda: waiting in str(workload_of(gke, ours)["status"].get("admissionChecks")), proc=proc)
    assert gke.sim.jobsets[(NS, ours)]["spec"]["suspend"] is True  # quota reserved, the check not Ready
    time.sleep(6.0)  # the launch reads its Workload every 5 s
    gke.container.state.zone_capacity = {}  # the zone has the VMs again
    running = wait_for(lambda: pods_of(gke, ours), proc=proc)
    workload = workload_of(gke, ours)["metadata"]["name"]
    request = f"{workload}-{CHECK}-1"  # Kueue's name: <workload>-<check>-<attempt>
    with gke.sim.lock:
        pod = gke.sim.pods[running[0]]
        annotations = pod["metadata"].get("annotations") or {}
        assert (
            annotations[CONSUME_ANNOTATION] == request and annotations[CLASS_ANNOTATION] == PROVISIONING_CLASS
        )
        assert gke.sim.provisioning.brought[pod["spec"]["nodeName"]] == (NS, request)  # the node it brought
    (created,) = gke.sim.kueue.requests_created
    assert created["metadata"]["name"] == request and created["metadata"]["labels"] == {MANAGED_LABEL: "true"}
    assert created["spec"]["parameters"] == {"maxRunDurationSeconds": "7200"}  # the JobSet's annotation
    (pod_set,) = workload_of(gke, ours)["spec"]["podSets"]
    template = f"ppt-{request}-{pod_set['name']}"
    assert created["spec"]["podSets"] == [{"podTemplateRef": {"name": template}, "count": 1}]
    # Kueue's PodTemplate: its label only, no warden label (GKE provisioned it all the same).
    with gke.sim.lock:
        assert gke.sim.provisioning.templates[(NS, template)]["metadata"]["labels"] == {MANAGED_LABEL: "true"}
    time.sleep(2.0)  # the launch follows the pod
    for key in running:
        gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    # batchpilot wrote no request or PodTemplate of its own, and never asked the Container API to resize.
    assert not posts(gke, "/provisioningrequests") and not posts(gke, "/podtemplates")
    assert not [r for r in gke.container.state.requests if r.method != "GET"]
    lines = [line for line in output.splitlines() if f"Kueue, JobSet {ours} in LocalQueue {QUEUE}: " in line]
    assert any(
        "Admitted=False (UnsatisfiedChecks: " in line and f"check {CHECK}: Pending ({waiting})" in line
        for line in lines
    ), output
    assert (
        f"Admitted=True (Admitted: The workload is admitted); check {CHECK}: Ready (1 node(s) of pool gpu"
        in lines[-1]
    )
    wait_for(lambda: not gke.sim.provisioning.requests and not gke.sim.provisioning.templates, 10)  # finished


def test_a_request_failing_past_the_retry_limit_ends_the_launch_with_the_reason_and_leaves_nothing_queued(
    gke, tmp_path
):
    gke.sim.provisioning.fail_with = ("OutOfResources", "the zones of pool gpu cannot create a3 VMs")
    started = time.monotonic()
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=600)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2 and time.monotonic() - started < 60, output  # not the 600 s bound
    (line,) = [line for line in output.splitlines() if line.startswith("batchpilot: error:")]
    assert line.startswith(f"batchpilot: error: cluster.kueue_queue: Kueue will not admit JobSet {ours} in "
                           f"LocalQueue {QUEUE}: ")  # fmt: skip
    assert f'AdmissionCheck in Rejected state: "{CHECK}" (the zones of pool gpu cannot create a3 VMs)' in line
    # Attempt 1 failed and was retried (backoffLimitCount 1); attempt 2 failed too: Rejected.
    workload = [r["metadata"]["name"] for r in gke.sim.kueue.requests_created]
    assert [n.rsplit("-", 1)[1] for n in workload] == ["1", "2"], workload
    assert not posts(gke, "/provisioningrequests") and not posts(gke, "/podtemplates")
    wait_for(lambda: not gke.sim.kueue.objects["workloads"] and not gke.sim.provisioning.requests
             and not gke.sim.provisioning.templates, 10)  # fmt: skip
    assert not gke.sim.jobsets and not gke.sim.nodes  # its JobSet deleted: nothing of it stays queued


def test_a_request_gke_does_not_provision_in_time_ends_with_the_checks_last_message(gke, tmp_path):
    gke.container.state.zone_capacity = {"us-central1-a": 0}  # a stockout: the request waits
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=4)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2, output
    (line,) = [line for line in output.splitlines() if line.startswith("batchpilot: error:")]
    assert f"Kueue did not admit JobSet {ours} in LocalQueue {QUEUE} within 4 s: " in line
    assert (
        f"check {CHECK}: Pending (no queued-provisioning node pool 'gpu' can take 1 node(s) in one zone now)"
        in line
    )
    assert "(fix: raise cluster.capacity_timeout_s (its quota is reserved; an admission check waits" in line
    wait_for(lambda: not gke.sim.provisioning.requests and not gke.sim.jobsets, 10)


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ({"admission_checks": ()}, "ClusterQueue team lists no admission check (spec.admissionChecksStrategy)"),
        ({"controller": "example.com/other"}, "AdmissionCheck dws has controllerName 'example.com/other'"),
        ({"provisioning_class": "check-capacity.autoscaling.x-k8s.io"},
         "ProvisioningRequestConfig dws-config (of AdmissionCheck dws) has class 'check-capacity.autoscaling.x-k8s.io'"),
        ({"make_config": False}, "ProvisioningRequestConfig dws-config (of AdmissionCheck dws) does not exist"),
        ({}, None),
    ],
)  # fmt: skip
def test_the_pool_and_doctor_check_name_what_keeps_the_queue_from_asking_gke(setup, expected):
    """`queue_problem`, which the pool's resize and `doctor` call before any node is asked for."""
    from batchpilot.cluster.kueue import queue_problem
    from batchpilot.config import parse_config

    checks = setup.pop("admission_checks", (CHECK,))
    kueue = kueue_with_check(**setup)
    spec = kueue.objects["clusterqueues"][("", "team")]["spec"]
    if not checks:
        del spec["admissionChecksStrategy"]
    config = parse_config(gke_a3_config(namespace=NS, kueue_queue=QUEUE, provisioning="flex-start"))
    with simulated_gke(kueue=kueue) as cluster:
        problem = queue_problem(cluster.kube.api_client(), config.cluster, nodes=1)
        assert queue_problem(cluster.kube.api_client(), config.cluster.model_copy(update={"provisioning": "resize"}),
                             nodes=1) is None  # fmt: skip
    if expected is None:
        assert problem is None
        return
    assert problem is not None
    text = str(problem)
    assert text.startswith(f"cluster.provisioning: flex-start through LocalQueue {QUEUE} needs Kueue to ask GKE "
                           "for the nodes: ") and expected in text and "\n" not in text  # fmt: skip
    assert "(fix: ask the cluster's admin to set up the ProvisioningRequestConfig" in text
