"""Compiled pipeline tasks as the pods the KFP v2 driver would create, submitted to the simulated cluster."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke
from kfp_driver import argo_retry, executor_label, load_compiled, nested_retry_policy, retry_policy, task_pod

ROOT = Path(__file__).resolve().parents[2]
NEMO = ROOT / "pipelines" / "compiled" / "nemo_gpt3_5b.yaml"
NS = "kubeflow"


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        # A GKE cluster keeps a CPU pool for system and pipeline pods; the GPU pool starts empty.
        cluster.add_pool("default-pool", machine_type="e2-standard-4", per_zone=1)
        cluster.add_pool("h100-pool", machine_type="a3-highgpu-8g", zones=["us-central1-a"])
        yield cluster


def submit(gke: SimulatedGke, pod: dict[str, Any]) -> Any:
    from kubernetes import client

    return client.CoreV1Api(gke.kube.api_client()).create_namespaced_pod(NS, pod)


def read(gke: SimulatedGke, name: str) -> Any:
    from kubernetes import client

    return client.CoreV1Api(gke.kube.api_client()).read_namespaced_pod(name, NS)


def test_the_driver_uses_the_accelerator_type_verbatim_as_the_resource_name():
    pipeline, platform = load_compiled(NEMO)
    executor = pipeline["deploymentSpec"]["executors"]["exec-explore"]["container"]
    executor["resources"] = {
        "accelerator": {"type": "nvidia-h100-80gb", "count": "1"},
        "cpuLimit": 4.0,
        "memoryLimit": 16.0,
        "resourceCpuRequest": "2",
    }
    pod = task_pod(pipeline, platform, "explore")
    (main,) = pod["spec"]["containers"]
    assert main["name"] == "main" and main["command"][0] == "/kfp-launcher/launch"
    assert main["resources"] == {"limits": {"memory": "16G", "cpu": "4", "nvidia-h100-80gb": "1"},
                                 "requests": {"cpu": "2"}}  # fmt: skip


def test_an_accelerator_type_as_resource_name_is_refused_and_a_resource_name_is_accepted(gke):
    from kubernetes.client.rest import ApiException

    pipeline, platform = load_compiled(NEMO)
    bad = copy.deepcopy(pipeline)
    bad["deploymentSpec"]["executors"]["exec-explore"]["container"]["resources"] = {
        "accelerator": {"resourceType": "nvidia-h100-80gb", "resourceCount": "1"}
    }
    with pytest.raises(ApiException) as caught:
        submit(gke, task_pod(bad, platform, "explore"))
    assert caught.value.status == 422
    assert "limits[nvidia-h100-80gb]: Invalid value" in json.loads(caught.value.body)["message"]
    good = copy.deepcopy(pipeline)
    good["deploymentSpec"]["executors"]["exec-explore"]["container"]["resources"] = {
        "accelerator": {"resourceType": "nvidia.com/gpu", "resourceCount": "1"}
    }
    assert submit(gke, task_pod(good, platform, "explore")).status.phase == "Pending"


def test_the_compiled_explore_pod_is_valid_and_runs_once_its_pool_has_a_node(gke):
    """The pipeline as compiled today: explore's pod passes validation, waits for the GPU pool, then binds."""
    pipeline, platform = load_compiled(NEMO)
    pod = task_pod(pipeline, platform, "explore")
    created = submit(gke, pod)  # a 422 here means the compiled accelerator is not a resource name
    name = created.metadata.name
    assert read(gke, name).status.conditions[0].reason == "Unschedulable"  # idle_nodes: 0
    gke.container.client().set_node_pool_size(request={"name": gke.pool_path("h100-pool"), "node_count": 1})
    deadline = time.monotonic() + 5
    while not read(gke, name).spec.node_name:
        assert time.monotonic() < deadline, read(gke, name).status.conditions
        time.sleep(0.02)
    node = gke.sim.nodes[read(gke, name).spec.node_name]
    assert node["pool"] == "h100-pool"


def test_every_compiled_task_pod_passes_api_validation(gke):
    pipeline, platform = load_compiled(NEMO)
    labels = pipeline["deploymentSpec"]["executors"]
    tasks = ["explore", "plan", "report", "stages-0-3/train-stage", "stages-0-3/resize-pool", "scale-down"]
    for task in tasks:
        pod = task_pod(pipeline, platform, task)
        assert submit(gke, pod).metadata.name, task
    assert len(labels) >= len(tasks)


HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


def test_a_train_task_that_fails_after_hours_is_still_retried_and_each_retry_may_run_its_timeout():
    """Argo's maxDuration rule on a simulated clock: the compiled train task's window fits every attempt
    at its full timeout (30 days); KFP's default window (3600 s) would refuse the first retry."""
    pipeline, platform = load_compiled(NEMO)
    policy = retry_policy(pipeline, "final/train-stage")
    timeout_s = float(
        platform["deploymentSpec"]["executors"][executor_label(pipeline, "final/train-stage")][
            "activeDeadlineSeconds"
        ]
    )
    assert timeout_s == 30 * DAY_S
    first = (0.0, 2 * HOUR_S)  # a launch that fails (e.g. evicted) two hours in
    starts, why = argo_retry(policy, attempts=[first], now=first[1])
    assert starts == 2 * HOUR_S + 60, why
    # The second attempt runs to its timeout and fails; the third still gets its whole timeout.
    second = (starts, starts + timeout_s)
    third, why = argo_retry(policy, attempts=[first, second], now=second[1])
    assert third == second[1] + 120, why
    deadline = float(policy["backoffMaxDuration"].removesuffix("s"))
    assert deadline >= third + timeout_s
    assert argo_retry(policy, attempts=[first, second, (third, third + HOUR_S)], now=third + HOUR_S) == (
        None, "No more retries left",
    )  # fmt: skip
    # The window KFP writes when backoff_max_duration is left out (sdk kfp/dsl/structures.py RetryPolicy).
    old = {**policy, "backoffMaxDuration": "3600s"}
    assert argo_retry(old, attempts=[first], now=first[1]) == (None, "Max duration limit exceeded")


def test_the_long_lived_task_pods_never_land_on_a_spot_node():
    """A Spot VM's reclaim deletes the task pod whatever its disruption budget, and Argo may not retry a
    deleted pod: train, canary and the pool tasks avoid Spot and preemptible nodes (compiled node affinity,
    applied by the driver as KFP 2.14+ does; kfp_driver.py), while plan, which nothing follows, may use them."""
    pipeline, platform = load_compiled(NEMO)
    with simulated_gke() as gke:
        gke.add_pool("spot-pool", machine_type="e2-standard-4", per_zone=1)
        gke.container.state.pools[gke.pool_path("spot-pool")]["config"]["spot"] = True
        gke.sim.pools["spot-pool"].spot = True  # GKE labels its nodes cloud.google.com/gke-spot=true
        train = submit(gke, task_pod(pipeline, platform, "stages-0-3/train-stage")).metadata.name
        resize = submit(gke, task_pod(pipeline, platform, "stages-0-3/resize-pool")).metadata.name
        plan = submit(gke, task_pod(pipeline, platform, "plan")).metadata.name
        deadline = time.monotonic() + 5
        while not read(gke, plan).spec.node_name:
            assert time.monotonic() < deadline, read(gke, plan).status.conditions
            time.sleep(0.02)
        for name in (train, resize):
            (condition,) = read(gke, name).status.conditions
            assert condition.reason == "Unschedulable", condition
            assert "1 node(s) didn't match Pod's node affinity/selector" in condition.message, condition
        gke.add_pool("default-pool", machine_type="e2-standard-4", per_zone=1)  # on-demand VMs
        while not (read(gke, train).spec.node_name and read(gke, resize).spec.node_name):
            assert time.monotonic() < deadline + 5, read(gke, train).status.conditions
            time.sleep(0.02)
        assert {gke.sim.nodes[read(gke, n).spec.node_name]["pool"] for n in (train, resize)} == {
            "default-pool"
        }


@pytest.mark.parametrize(("version", "retried"), [((2, 13, 1), False), ((2, 14, 0), True)])
def test_the_train_and_resize_tasks_sit_in_a_launch_group_whose_retries_need_kfp_2_14(version, retried):
    """Every launch's resize and train tasks are in its sub-pipeline; before KFP 2.14.0 the Argo compiler gave
    only root-DAG tasks their retry policy (kfp_driver.nested_retry_policy), so they would never be retried:
    what `batchpilot doctor`'s KFP floor is for."""
    pipeline, _ = load_compiled(NEMO)
    for task in ("final/train-stage", "final/resize-pool"):
        policy = nested_retry_policy(pipeline, task, kfp_version=version)
        starts, why = (
            argo_retry(policy, attempts=[(0.0, 60.0)], now=60.0) if policy else (None, "no retryStrategy")
        )
        assert (starts is not None) == retried, (task, why)


def test_no_cpu_task_runs_on_the_trainers_pool_which_its_resizes_shrink():
    """A resize that shrinks the trainers' pool deletes the nodes it removes with their pods: a task pod there
    (the resize's own, or the exit handler's scale-down) would be killed mid-way. Every CPU task's pod keeps
    off that pool; explore, which measures on it, does not."""
    pipeline, platform = load_compiled(NEMO)
    for task in (
        "plan",
        "report",
        "scale-down",
        "stages-0-3/train-stage",
        "stages-0-3/resize-pool",
        "explore",
    ):
        pod = task_pod(pipeline, platform, task)
        terms = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))  # fmt: skip
        avoids = {"key": "cloud.google.com/gke-nodepool", "operator": "NotIn", "values": ["h100-pool"]}
        assert (task != "explore") == any(avoids in term["matchExpressions"] for term in terms), (task, terms)
