"""Issue #37: a launch in a Kueue queue (`cluster.kueue_queue`) waits for its Workload's admission, saying what
Kueue reports, and ends at `cluster.capacity_timeout_s` with the reason, leaving nothing queued.

Kueue is the stand-in in kueue_controller.py (its rules from Kueue v0.19.2, each with its file), served by the
simulated cluster's Kubernetes API; `batchpilot launch` runs as a process with the real `kubernetes` client.
The pods run no process here: the test ends them as a trainer would.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke, start_launch
from kueue_controller import JOB_UID_LABEL, PRIORITY_LABEL, QUEUE_LABEL, KueueController, workload_name

from batchpilot.cluster.kueue import admission
from helpers import gke_a3_config, write_plan

NS = "batchpilot"
QUEUE = "team-a"
H100 = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
TEAM_FLAVOR = {**H100, "example.com/team-flavor": "h100-a"}
"""The flavor's node labels here: the second is the flavor's own (the pool carries it), which batchpilot's own
node selector does not have, so finding it on the pods shows Kueue's admission put it there."""


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    kueue = KueueController()
    kueue.add_flavor("h100", node_labels=TEAM_FLAVOR)
    kueue.add_cluster_queue(
        "team",
        quota={"h100": {"cpu": "1000", "memory": "10000Gi", "nvidia.com/gpu": "8"}},
        preemption="LowerPriority",
    )
    kueue.add_local_queue(NS, QUEUE, cluster_queue="team")
    kueue.add_priority_class("high", 1000)
    with simulated_gke(kueue=kueue) as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=2)
        cluster.sim.pool_labels["gpu"] = {"example.com/team-flavor": "h100-a"}
        yield cluster


def wait_for(
    condition: Callable[[], Any], timeout_s: float = 60.0, proc: subprocess.Popen[str] | None = None
) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if proc is not None:
            assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


def blocker(gke: SimulatedGke, name: str = "other-team", *, priority_class: str | None = None) -> str:
    """Another team's JobSet in the same queue, holding its 8 GPUs of quota once admitted."""
    from kubernetes import client

    pod = {"containers": [{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "8"},
                                                                      "requests": {"cpu": "1", "memory": "1Gi"}}}],
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
           "restartPolicy": "Never"}  # fmt: skip
    body = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: QUEUE, **({PRIORITY_LABEL: priority_class} if priority_class else {})}},
        "spec": {"replicatedJobs": [{"name": "main", "replicas": 1, "template": {"spec": {
            "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod}}}}]},
    }  # fmt: skip
    client.CustomObjectsApi(gke.kube.api_client()).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", body
    )
    wait_for(lambda: any(w.startswith(f"jobset-{name}-") for w in gke.sim.kueue.admitted))
    return name


def pods_of(gke: SimulatedGke, jobset: str, phase: str = "Running") -> list[tuple[str, str]]:
    with gke.sim.lock:
        return [key for key, p in gke.sim.pods.items()
                if p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == jobset
                and p["status"]["phase"] == phase]  # fmt: skip


def launch(gke: SimulatedGke, folder: Path, **cluster: object) -> tuple[subprocess.Popen[str], str]:
    proc = start_launch(
        gke, write_plan(folder, gke_a3_config(namespace=NS, kueue_queue=QUEUE, **cluster)), folder
    )
    ours = wait_for(lambda: [k[1] for k in gke.sim.jobsets if k[1] != "other-team"], proc=proc)
    return proc, ours[0]


def workload_of(gke: SimulatedGke, jobset: str) -> dict[str, Any]:
    with gke.sim.lock:
        uid = gke.sim.jobsets[(NS, jobset)]["metadata"]["uid"]
        return gke.sim.kueue.objects["workloads"][(NS, workload_name(jobset, uid))]  # type: ignore[no-any-return]


def test_a_launch_waits_in_its_queue_while_another_holds_the_quota_then_trains_when_it_finishes(
    gke, tmp_path
):
    other = blocker(gke, priority_class="high")  # as high as ours: Kueue preempts only lower priorities
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=120, priority_class="high")
    jobset = gke.sim.jobsets[(NS, ours)]
    assert jobset["spec"]["suspend"] is True  # created suspended; the Workload waits for quota
    labels = jobset["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == QUEUE and labels[PRIORITY_LABEL] == "high"
    wait_for(lambda: "more needed" in admission(workload_of(gke, ours)).state, proc=proc)
    workload = workload_of(gke, ours)
    assert workload["metadata"]["labels"][JOB_UID_LABEL] == jobset["metadata"]["uid"]
    assert workload["spec"]["priority"] == 1000
    time.sleep(2.0)  # still waiting: no pod of ours while the other team's JobSet holds the GPUs
    assert not pods_of(gke, ours, "Pending") and not pods_of(gke, ours)
    for key in pods_of(gke, other):
        gke.sim.finish_pod(*key, exit_code=0)  # the other team's job ends: its quota is freed
    running = wait_for(lambda: pods_of(gke, ours), proc=proc)
    assert gke.sim.kueue.admitted == [workload_name(other, gke.sim.jobsets[(NS, other)]["metadata"]["uid"]),
                                      workload["metadata"]["name"]]  # fmt: skip
    template = gke.sim.jobsets[(NS, ours)]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]
    assert template["nodeSelector"]["example.com/team-flavor"] == "h100-a"  # the flavor's
    time.sleep(2.0)  # the launch follows the pod
    for key in running:
        gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    waiting = f"Kueue, JobSet {ours} in LocalQueue {QUEUE}: QuotaReserved=False (Pending: couldn't assign flavors to"
    assert (
        waiting in output
        and "insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed" in output
    )
    assert f"Kueue, JobSet {ours} in LocalQueue {QUEUE}: QuotaReserved=True (QuotaReserved: Quota reserved in " \
           "ClusterQueue team); Admitted=True (Admitted: The workload is admitted)" in output  # fmt: skip


def test_a_launch_preempted_by_a_higher_priority_workload_is_requeued_and_resumes_when_admitted_again(
    gke, tmp_path
):
    """Kueue preempts a running launch for a higher-priority workload by suspending its JobSet (its pods get
    SIGTERM: the trainers checkpoint); the launch keeps following it, says so, and trains on once Kueue admits it
    again (the JobSet resumes and new pods start, which resume from the checkpoint)."""
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=120)  # Kueue's default priority: 0
    first = wait_for(lambda: pods_of(gke, ours), proc=proc)
    time.sleep(2.0)  # the launch follows its pod
    other = blocker(gke, "urgent", priority_class="high")  # admitted once our pods are gone
    assert gke.sim.jobsets[(NS, ours)]["spec"]["suspend"] is True and not pods_of(gke, ours)
    assert first[0] not in gke.sim.pods  # deleted by the suspension (a kubelet would SIGTERM it)
    time.sleep(7.0)  # the launch reads its Workload every 5 s
    for key in pods_of(gke, other):
        gke.sim.finish_pod(*key, exit_code=0)
    again = wait_for(lambda: pods_of(gke, ours), proc=proc)  # admitted again: the JobSet resumed
    assert again != first
    assert gke.sim.jobsets[(NS, ours)]["spec"]["suspend"] is False
    time.sleep(2.0)
    for key in again:
        gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    uid = gke.sim.jobsets[(NS, ours)]["metadata"]["uid"]
    assert gke.sim.kueue.admitted == [workload_name(ours, uid),
                                      workload_name(other, gke.sim.jobsets[(NS, other)]["metadata"]["uid"]),
                                      workload_name(ours, uid)]  # fmt: skip
    lines = [line for line in output.splitlines() if f"Kueue, JobSet {ours} in LocalQueue {QUEUE}: " in line]
    preempted = [
        i
        for i, line in enumerate(lines)
        if "Evicted=True (Preempted: Preempted to accommodate a workload" in line
    ]
    assert preempted and "Preempted=True (InClusterQueue: " in lines[preempted[0]], output
    readmitted = [i for i, line in enumerate(lines) if "Admitted=True" in line and i > preempted[0]]
    assert readmitted, lines  # logged while the launch followed its JobSet


def test_a_launch_kueue_does_not_admit_in_time_ends_with_the_reason_and_leaves_nothing_queued(gke, tmp_path):
    blocker(gke)
    started = time.monotonic()
    proc, ours = launch(gke, tmp_path, capacity_timeout_s=6)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode != 0 and time.monotonic() - started < 60, output
    lines = [line for line in output.splitlines() if "cluster.capacity_timeout_s" in line]
    assert (
        lines
        and f"Kueue did not admit JobSet {ours} in LocalQueue {QUEUE} within 6 s: QuotaReserved=False"
        in lines[0]
    )
    assert "insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed" in lines[0], lines
    assert (NS, ours) not in gke.sim.jobsets and (
        NS,
        "other-team",
    ) in gke.sim.jobsets  # its queued JobSet deleted
    assert "Traceback" not in output


def test_a_queue_that_does_not_exist_is_named_while_the_launch_waits(gke, tmp_path):
    gke.sim.kueue.objects["localqueues"].clear()
    proc, _ = launch(gke, tmp_path, capacity_timeout_s=4)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode != 0, output
    assert f"QuotaReserved=False (Inadmissible: LocalQueue {QUEUE} is terminating or missing)" in output, (
        output
    )


def test_the_workload_line_names_each_condition_and_admission_check():
    workload = {
        "spec": {"active": True},
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "Quota reserved in ClusterQueue cq"},
                {"type": "Admitted", "status": "False", "reason": "UnsatisfiedChecks", "message": "The workload has not all checks ready"},
            ],
            "admissionChecks": [{"name": "dws", "state": "Pending", "message": "Waiting for resources"}],
        },
    }  # fmt: skip
    found = admission(workload)
    assert not found.admitted and not found.refused
    assert found.state == ("QuotaReserved=True (QuotaReserved: Quota reserved in ClusterQueue cq); Admitted=False "
                           "(UnsatisfiedChecks: The workload has not all checks ready); check dws: Pending (Waiting "
                           "for resources)")  # fmt: skip
    workload["status"]["admissionChecks"][0]["state"] = "Rejected"
    assert admission(workload).refused
    workload["status"]["admissionChecks"][0]["state"] = "Ready"
    workload["status"]["conditions"][1].update(status="True", reason="Admitted")
    assert admission(workload).admitted and not admission(workload).refused
    assert admission({"spec": {"active": False}, "status": {}}).refused
