"""The simulated GKE cluster, through the real google-cloud-container and kubernetes clients.

The simulator's rules come from Kubernetes, JobSet and GKE (see `cluster_sim.py`); these tests check
that it plays them: a resize makes GKE-shaped Nodes, the API server refuses an invalid resource name,
the scheduler leaves a pod that does not fit Pending with the scheduler's message, and a JobSet makes
its Jobs and pods and restarts them as its failure policy says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke, start_launch
from k8s_rules import container_resource_name_errors, quantity

from batchpilot.cluster.gke import GkeNodePool, PoolRef
from batchpilot.cluster.readiness import PoolNodes

NS = "batchpilot"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
H100_SELECTOR = {
    "cloud.google.com/gke-nodepool": "gpu",
    "cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
}


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", zones=["us-central1-a", "us-central1-b"])
        yield cluster


def core(gke: SimulatedGke) -> Any:
    from kubernetes import client

    return client.CoreV1Api(gke.kube.api_client())


def objects(gke: SimulatedGke) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(gke.kube.api_client())


def wait_for(condition: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
    return value


def gpu_pod(name: str, *, resources: dict[str, str], tolerate: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "batchpilot:0.1.0", "resources": {"limits": resources}}],
        "nodeSelector": H100_SELECTOR,
    }
    if tolerate:
        spec["tolerations"] = [GPU_TOLERATION]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def events_of(gke: SimulatedGke, name: str) -> list[tuple[str, str]]:
    found = core(gke).list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
    return [(e.reason, e.message) for e in found]


def resize(gke: SimulatedGke, per_zone: int) -> None:
    gke.container.client().set_node_pool_size(request={"name": gke.pool_path("gpu"), "node_count": per_zone})


# -- nodes ----------------------------------------------------------------------------------------


def test_a_resize_registers_gke_nodes_with_labels_taint_and_allocatable(gke):
    resize(gke, 1)
    nodes = core(gke).list_node(label_selector="cloud.google.com/gke-nodepool=gpu").items
    assert sorted(n.metadata.labels["topology.kubernetes.io/zone"] for n in nodes) == [
        "us-central1-a",
        "us-central1-b",
    ]
    node = nodes[0]
    assert node.metadata.name.startswith("gke-train-gpu-")
    assert node.metadata.labels["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
    assert node.metadata.labels["node.kubernetes.io/instance-type"] == "a3-highgpu-8g"
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [
        ("nvidia.com/gpu", "present", "NoSchedule")
    ]
    assert node.status.capacity["nvidia.com/gpu"] == "8" and node.status.allocatable["nvidia.com/gpu"] == "8"
    # GKE reserves 6% + 1% + 2 x 0.5% + 204 x 0.25% of a core = 590m of 208 cores.
    assert node.status.allocatable["cpu"] == "207410m"
    # The kernel reports less than the nominal 1872 GiB (gke_nodes.KERNEL_RESERVED_FRACTION, 1.5%), and
    # GKE's reservation is taken from what it reports.
    capacity_gib = float(quantity(node.status.capacity["memory"])) / 2**30
    assert abs(capacity_gib - 1872 * 0.985) < 1e-3
    reserved = quantity(node.status.capacity["memory"]) - quantity(node.status.allocatable["memory"])
    expected = 1 + 0.8 + 0.8 + 6.72 + 0.02 * (capacity_gib - 128) + 100 / 1024
    assert abs(float(reserved) / 2**30 - expected) < 1e-3
    resize(gke, 0)
    assert core(gke).list_node().items == []


def test_the_project_pool_waits_until_the_simulated_nodes_are_ready_with_gpus():
    with simulated_gke(ready_delay_s=0.3, gpu_delay_s=0.3) as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", zones=["us-central1-a", "us-central1-b"])
        pool = GkeNodePool(
            client=cluster.container.client(),
            pool=PoolRef("proj", "us-central1", "train", "gpu"),
            pool_mode="resize", idle_nodes=0,
            nodes=PoolNodes(api_client=cluster.kube.api_client(), node_pool="gpu", gpus_per_node=8),
            operation_timeout_s=20, poll_initial_s=0.02, poll_maximum_s=0.05, ready_poll_interval_s=0.05,
        )  # fmt: skip
        started = time.monotonic()
        pool.resize(4)
        nodes = core(cluster).list_node().items
        assert len(nodes) == 4 and all(n.status.allocatable["nvidia.com/gpu"] == "0" for n in nodes)
        assert {t.key for t in nodes[0].spec.taints} == {"nvidia.com/gpu", "node.kubernetes.io/not-ready"}
        pool.wait_ready(4, timeout_s=5)
        assert time.monotonic() - started >= 0.6
        assert pool.current_size() == 4


# -- validation -----------------------------------------------------------------------------------


def test_container_resource_names_follow_the_api_server_rules():
    assert container_resource_name_errors("nvidia.com/gpu") == []
    assert container_resource_name_errors("cpu") == []
    assert container_resource_name_errors("hugepages-2Mi") == []
    assert container_resource_name_errors("nvidia-h100-80gb") == [
        "must be a standard resource type or fully qualified",
        "must be a standard resource for containers",
    ]
    assert container_resource_name_errors("kubernetes.io/gpu") == []  # native, not extended
    assert container_resource_name_errors("Example.com/gpu") != []  # the prefix is lower case only


def test_a_pod_naming_an_accelerator_type_as_a_resource_is_refused_with_422(gke):
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as caught:
        core(gke).create_namespaced_pod(NS, gpu_pod("bad", resources={"nvidia-h100-80gb": "1"}))
    assert caught.value.status == 422
    import json

    body = json.loads(caught.value.body)
    assert body["reason"] == "Invalid"
    assert body["message"] == (
        'Pod "bad" is invalid: [spec.containers[0].resources.limits[nvidia-h100-80gb]: Invalid value: '
        '"nvidia-h100-80gb": must be a standard resource type or fully qualified, '
        "spec.containers[0].resources.limits[nvidia-h100-80gb]: Invalid value: "
        '"nvidia-h100-80gb": must be a standard resource for containers]'
    )
    assert not gke.sim.pods


# -- scheduling -----------------------------------------------------------------------------------


def test_the_scheduler_binds_a_pod_that_fits_and_explains_those_that_do_not(gke):
    api = core(gke)
    api.create_namespaced_pod(NS, gpu_pod("early", resources={"nvidia.com/gpu": "8"}))
    assert events_of(gke, "early") == [("FailedScheduling", "no nodes available to schedule pods")]
    resize(gke, 1)
    wait_for(lambda: api.read_namespaced_pod("early", NS).spec.node_name)
    api.create_namespaced_pod(NS, gpu_pod("second", resources={"nvidia.com/gpu": "8"}))
    bound = wait_for(lambda: api.read_namespaced_pod("second", NS).spec.node_name)
    assert bound != api.read_namespaced_pod("early", NS).spec.node_name
    api.create_namespaced_pod(NS, gpu_pod("third", resources={"nvidia.com/gpu": "1"}))
    api.create_namespaced_pod(NS, gpu_pod("untolerated", resources={"cpu": "1"}, tolerate=False))
    assert events_of(gke, "third")[-1] == (
        "FailedScheduling",
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. "
        "preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod.",
    )
    assert events_of(gke, "untolerated")[-1] == (
        "FailedScheduling",
        "0/2 nodes are available: 2 node(s) had untolerated taint {nvidia.com/gpu: present}. "
        "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.",
    )
    pending = api.read_namespaced_pod("third", NS)
    assert pending.status.phase == "Pending" and pending.status.conditions[0].reason == "Unschedulable"


# -- JobSets --------------------------------------------------------------------------------------


def jobset(
    name: str, *, nodes: int, max_restarts: int = 0, resources: dict[str, str] | None = None
) -> dict[str, Any]:
    pod_spec = {
        "containers": [{"name": "trainer", "image": "batchpilot:0.1.0",
                        "resources": {"limits": resources or {"nvidia.com/gpu": "8"}}}],
        "nodeSelector": H100_SELECTOR, "tolerations": [GPU_TOLERATION], "restartPolicy": "Never",
    }  # fmt: skip
    job = {"parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
           "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec}}  # fmt: skip
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "labels": {"batchpilot/run": "r1"}},
        "spec": {"network": {"enableDNSHostnames": True, "subdomain": name},
                 "failurePolicy": {"maxRestarts": max_restarts}, "successPolicy": {"operator": "All"},
                 "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]},
    }  # fmt: skip


def create_jobset(gke: SimulatedGke, body: dict[str, Any]) -> dict[str, Any]:
    return objects(gke).create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", body)  # type: ignore[no-any-return]


def get_jobset(gke: SimulatedGke, name: str) -> dict[str, Any]:
    return objects(gke).get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", name)  # type: ignore[no-any-return]


def pods_of(gke: SimulatedGke, name: str) -> list[Any]:
    return list(
        core(gke).list_namespaced_pod(NS, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
    )


def test_a_jobset_makes_named_jobs_and_pods_that_complete_it(gke):
    resize(gke, 1)
    create_jobset(gke, jobset("ramp", nodes=2))
    pods = wait_for(lambda: [p for p in pods_of(gke, "ramp") if p.spec.node_name])
    assert len(pods) == 2
    pod = min(pods, key=lambda p: p.metadata.name)
    assert pod.metadata.name.startswith("ramp-node-0-0-")
    assert pod.spec.hostname == "ramp-node-0-0" and pod.spec.subdomain == "ramp"
    labels = pod.metadata.labels
    assert labels["jobset.sigs.k8s.io/replicatedjob-name"] == "node"
    assert labels["jobset.sigs.k8s.io/restart-attempt"] == "0"
    assert labels["batch.kubernetes.io/job-completion-index"] == "0" and labels["app"] == "ramp"
    assert ("JOB_COMPLETION_INDEX", "0") in [(e.name, e.value) for e in pod.spec.containers[0].env]
    listed = objects(gke).list_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", label_selector="batchpilot/run=r1"
    )
    assert [j["metadata"]["name"] for j in listed["items"]] == ["ramp"]
    for p in pods:
        gke.sim.finish_pod(NS, p.metadata.name, exit_code=0)
    status = get_jobset(gke, "ramp")["status"]
    assert status["terminalState"] == "Completed"
    assert status["conditions"][0]["message"] == "jobset completed successfully"


def test_a_failed_pod_restarts_the_jobset_until_max_restarts(gke):
    resize(gke, 1)
    create_jobset(gke, jobset("ramp", nodes=2, max_restarts=1))
    first = wait_for(lambda: [p for p in pods_of(gke, "ramp") if p.status.phase == "Running"][:2])
    gke.sim.finish_pod(NS, first[1].metadata.name, exit_code=137, reason="OOMKilled")
    second = wait_for(
        lambda: [
            p for p in pods_of(gke, "ramp") if p.metadata.labels["jobset.sigs.k8s.io/restart-attempt"] == "1"
        ]
    )
    assert get_jobset(gke, "ramp")["status"]["restarts"] == 1
    assert {p.metadata.name for p in first}.isdisjoint(p.metadata.name for p in pods_of(gke, "ramp"))
    gke.sim.finish_pod(NS, second[0].metadata.name, exit_code=1)
    status = get_jobset(gke, "ramp")["status"]
    assert status["terminalState"] == "Failed" and status["conditions"][0]["reason"] == "ReachedMaxRestarts"


def test_a_jobset_whose_job_the_api_refuses_reports_job_creation_failed(gke):
    create_jobset(gke, jobset("bad", nodes=1, resources={"nvidia-h100-80gb": "8"}))
    (reason, message), *_ = events_of(gke, "bad")
    assert reason == "JobCreationFailed"
    assert message.startswith(
        'Job.batch "bad-node-0" is invalid: [spec.template.spec.containers[0].resources'
    )
    assert not pods_of(gke, "bad")


@pytest.mark.parametrize("policy", ["Background", "Foreground"])
def test_deleting_a_jobset_removes_its_jobs_and_pods(gke, policy):
    resize(gke, 1)
    create_jobset(gke, jobset("ramp", nodes=2))
    wait_for(lambda: len(pods_of(gke, "ramp")) == 2)
    objects(gke).delete_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "ramp", propagation_policy=policy
    )
    wait_for(lambda: not gke.sim.jobsets)
    assert pods_of(gke, "ramp") == [] and not gke.sim.jobs


def test_autoscaling_adds_nodes_for_pending_pods_and_removes_idle_ones():
    with simulated_gke(scale_down_unneeded_s=0.2) as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", zones=["us-central1-a", "us-central1-b"])
        cluster.container.client().set_node_pool_autoscaling(request={
            "name": cluster.pool_path("gpu"),
            "autoscaling": {"enabled": True, "total_min_node_count": 0, "total_max_node_count": 2},
        })  # fmt: skip
        create_jobset(cluster, jobset("ramp", nodes=3))
        wait_for(lambda: len([p for p in pods_of(cluster, "ramp") if p.spec.node_name]) == 2)
        assert cluster.sim.pool_size("gpu") == 2  # the third pod waits: the maximum is 2
        objects(cluster).delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "ramp")
        wait_for(lambda: cluster.sim.pool_size("gpu") == 0)


def with_project_failure_policy(body: dict[str, Any]) -> dict[str, Any]:
    """The failure policies batchpilot's launcher renders: restart after a disruption or exit 75."""
    body["spec"]["failurePolicy"] = {"maxRestarts": 10, "rules": [
        {"name": "FailOnTrainerError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "RestartAfterDisruption", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
    ]}  # fmt: skip
    body["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"] = {"rules": [
        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"operator": "In", "values": [75]}},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [75]}},
    ]}  # fmt: skip
    return body


def attempts(gke: SimulatedGke, name: str) -> set[str]:
    return {p.metadata.labels["jobset.sigs.k8s.io/restart-attempt"] for p in pods_of(gke, name)}


@pytest.mark.parametrize("how", ["preempted node", "exit 75"])
def test_a_disruption_restarts_the_jobset_under_the_failure_policy(gke, how):
    resize(gke, 1)
    create_jobset(gke, with_project_failure_policy(jobset("ramp", nodes=2)))
    pods = wait_for(lambda: [p for p in pods_of(gke, "ramp") if p.spec.node_name])
    if how == "preempted node":
        gke.sim.preempt_node(pods[0].spec.node_name)
    else:
        gke.sim.finish_pod(NS, pods[0].metadata.name, exit_code=75)
    wait_for(lambda: attempts(gke, "ramp") == {"1"})
    status = get_jobset(gke, "ramp")["status"]
    assert status["restarts"] == 1 and "terminalState" not in status


def test_a_trainer_error_fails_the_jobset_at_once_under_the_failure_policy(gke):
    resize(gke, 1)
    create_jobset(gke, with_project_failure_policy(jobset("ramp", nodes=2)))
    pods = wait_for(lambda: [p for p in pods_of(gke, "ramp") if p.spec.node_name])
    gke.sim.finish_pod(NS, pods[0].metadata.name, exit_code=1)
    status = get_jobset(gke, "ramp")["status"]
    assert status["terminalState"] == "Failed" and status["restarts"] == 0
    assert ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action") in events_of(
        gke, "ramp"
    )


def test_a_pod_hostname_longer_than_a_dns_label_fails_the_job_controllers_create(gke):
    name = "r" * 56  # the Job `<jobset>-node-0` has 63 characters, its pods' hostname 65
    # The JobSet webhook refuses it at create (jobset_webhook.py); the controllers' own rule is for a
    # JobSet that got past admission (a cluster without the webhook), so it is put in directly.
    gke.sim.create_jobset(NS, jobset(name, nodes=1))
    job_events = events_of(gke, f"{name}-node-0")
    assert job_events and job_events[0][0] == "FailedCreate"
    assert (
        f'spec.hostname: Invalid value: "{name}-node-0-0": must be no more than 63 characters'
        in job_events[0][1]
    )
    assert not pods_of(gke, name)


def test_a_job_name_longer_than_a_label_value_is_refused(gke):
    name = "r" * 57
    gke.sim.create_jobset(NS, jobset(name, nodes=1))  # past the webhook, as above
    (reason, message), *_ = events_of(gke, name)
    assert reason == "JobCreationFailed"
    assert (
        f'spec.template.labels: Invalid value: "{name}-node-0": must be no more than 63 characters' in message
    )


def test_every_short_resource_is_named_and_each_node_counts_once_for_preemption(gke):
    resize(gke, 1)
    too_big = gpu_pod("huge", resources={"nvidia.com/gpu": "16", "cpu": "300", "memory": "10Ti"})
    core(gke).create_namespaced_pod(NS, too_big)
    assert events_of(gke, "huge")[-1][1] == (
        "0/2 nodes are available: 2 Insufficient cpu, 2 Insufficient memory, 2 Insufficient nvidia.com/gpu. "
        "preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod."
    )


@pytest.mark.slow
def test_a_launch_follows_every_pod_of_its_jobset_across_a_restart(tmp_path):
    """A JobSet restart (here after a trainer's exit 75) replaces every pod; the launch relays the new pods'
    lines too, so the task's log and its preemption check see the whole stage, not only the first attempt."""

    from test_train_task_sigterm import plan_file

    plan = plan_file(tmp_path)  # the tiny model on pool gpu (a3-highgpu-8g), namespace batchpilot
    with simulated_gke() as gke:
        gke.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
        launch = start_launch(gke, plan, tmp_path)

        def running_trainer(attempt: str) -> tuple[str, str]:
            def found() -> tuple[str, str] | None:
                assert launch.poll() is None, launch.communicate()[0]
                for key, pod in list(gke.sim.pods.items()):
                    labels = pod["metadata"].get("labels") or {}
                    if (
                        key[0] == NS
                        and pod["status"]["phase"] == "Running"
                        and (labels.get("jobset.sigs.k8s.io/restart-attempt") == attempt)
                    ):
                        return key
                return None

            return wait_for(found, timeout_s=90)

        first = running_trainer("0")
        gke.sim.logs[first] = "[rank 0] step 10 loss 4.2 (first attempt)\n"
        time.sleep(3.0)  # the launch follows it
        gke.sim.finish_pod(*first, exit_code=75)  # preempted after checkpointing: the JobSet restarts
        second = running_trainer("1")
        gke.sim.logs[second] = "[rank 0] resumed from step 10 (after the restart)\n"
        time.sleep(3.0)
        gke.sim.finish_pod(*second, exit_code=0)
        output, _ = launch.communicate(timeout=90)
    assert launch.returncode == 0, output
    assert (
        "step 10 loss 4.2 (first attempt)" in output and "resumed from step 10 (after the restart)" in output
    )
