"""The train task on SIGTERM: an eviction leaves the JobSet for the retry, a cancel deletes it.

The task pod is the one KFP's driver would create from the compiled pipeline (`kfp_driver.task_pod`),
submitted to the simulated cluster; `batchpilot launch` runs as a real process with the pod's name and
namespace in the environment (what the downward API gives the container). An eviction is marked as the
Eviction API / a graceful node shutdown does it: condition DisruptionTarget=True and deletionTimestamp
set before the kubelet sends SIGTERM (kubernetes.io "Pod disruption conditions"); Argo's
TerminateContainers (a KFP terminate or a deadline) sends SIGTERM and deletes nothing
(argo-workflows workflow/controller/pod/queue.go).

Whether Argo retries the task after it is lost depends on the cluster's Argo configuration and on what its
controller saw (kfp_driver.argo_retry, attempt_phase): every configuration is run, with the retry adopting
the JobSet where Argo retries, and the exit handler deleting it where it does not. A drain cannot get this
far: the Eviction API refuses it while the task's own disruption budget covers its pod (kube_disruption.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_sim import ClusterSim
from container_api_server import GkeClusterSim, container_server_running
from gke_sim import CLUSTER, SimulatedGke
from kfp_driver import argo_retry, attempt_phase, load_compiled, retry_policy, task_pod
from kube_api_server import kube_server_running
from workload_controllers import now

from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV, sigterm_cause
from batchpilot.exitcodes import EXIT_PREEMPTED
from helpers import tiny_config, write_plan

ROOT = Path(__file__).resolve().parents[2]
NEMO = ROOT / "pipelines" / "compiled" / "nemo_gpt3_5b.yaml"
KFP_NS, NS = "kubeflow", "batchpilot"


class GracefulKubelet:
    """A kubelet whose containers run until deleted, then take the grace period to stop (Kubernetes "Pod
    termination": the object stays, with its deletionTimestamp, until the containers have ended)."""

    def __init__(self) -> None:
        self.stopping: dict[str, float] = {}
        self.grace_cap_s: float | None = None  # containers that checkpoint faster than their grace period

    def start(self, pod: dict[str, Any], *, dns_names: set[str]) -> None:
        del pod, dns_names

    def stop(self, pod: dict[str, Any], *, grace_s: float) -> None:
        grace_s = grace_s if self.grace_cap_s is None else min(grace_s, self.grace_cap_s)
        self.stopping.setdefault(pod["metadata"]["uid"], time.monotonic() + grace_s)

    def poll(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        until = self.stopping.get(pod["metadata"]["uid"])
        return {"exitCode": 143} if until is not None and time.monotonic() > until else None

    def log(self, pod: dict[str, Any]) -> str:
        return ""


def mark_evicted(sim: ClusterSim, name: str, *, reason: str = "EvictionByEvictionAPI") -> None:
    """What the Eviction API does before the kubelet stops the pod: the condition, then the deletion."""
    with sim.lock:
        pod = sim.pods[(KFP_NS, name)]
        pod["status"]["conditions"].append(
            {"type": "DisruptionTarget", "status": "True", "reason": reason, "lastTransitionTime": now()}
        )
        sim.delete_pod(KFP_NS, name)


def train_task_pod(sim: ClusterSim) -> str:
    """The compiled train task's pod, created in the simulated cluster; returns its name."""
    pipeline, platform = load_compiled(NEMO)
    created = sim.create_pod(KFP_NS, task_pod(pipeline, platform, "final/train-stage"))
    return str(created["metadata"]["name"])


# --- the cause, read from the pod ------------------------------------------------------------------


@pytest.fixture
def pods() -> Iterator[tuple[ClusterSim, Any]]:
    sim = ClusterSim(kubelet=GracefulKubelet())
    sim.add_pool("default-pool", zones=["us-central1-a"], machine_type="e2-standard-4")
    sim.resize_pool("default-pool", per_zone=1)
    with kube_server_running(sim=sim) as server:
        yield sim, server.api_client


def test_a_pod_marked_for_eviction_is_an_eviction(pods):
    sim, api_client = pods
    name = train_task_pod(sim)
    mark_evicted(sim, name)
    cause = sigterm_cause(env={POD_NAME_ENV: name, POD_NAMESPACE_ENV: KFP_NS}, api_client=api_client)
    assert cause.eviction and cause.why == f"pod {name} has DisruptionTarget (EvictionByEvictionAPI)"


def test_a_pod_that_is_not_being_deleted_is_a_cancel(pods):
    sim, api_client = pods
    name = train_task_pod(sim)
    cause = sigterm_cause(env={POD_NAME_ENV: name, POD_NAMESPACE_ENV: KFP_NS}, api_client=api_client)
    assert not cause.eviction and cause.why == f"pod {name} is not being deleted (a cancel or a deadline)"


def test_a_pod_that_cannot_be_read_is_taken_as_a_cancel(pods):
    _, api_client = pods
    cause = sigterm_cause(env={POD_NAME_ENV: "gone", POD_NAMESPACE_ENV: KFP_NS}, api_client=api_client)
    assert not cause.eviction
    assert cause.why == f"cannot read pod {KFP_NS}/gone (HTTP 404 Not Found); taken as a cancel"


def test_the_compiled_train_task_pod_knows_its_name_and_is_protected():
    pipeline, platform = load_compiled(NEMO)
    pod = task_pod(pipeline, platform, "final/train-stage")
    (main,) = pod["spec"]["containers"]
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in main["env"] if "valueFrom" in e}
    assert downward == {POD_NAME_ENV: "metadata.name", POD_NAMESPACE_ENV: "metadata.namespace"}
    assert pod["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    assert main["resources"] == {"requests": {"cpu": "250m", "memory": "1Gi"}}  # not BestEffort


# --- the train task as a process -------------------------------------------------------------------


@pytest.fixture
def gke(tmp_path: Path) -> Iterator[SimulatedGke]:
    """`gke_sim.simulated_gke` with the graceful kubelet: a deleted pod stays readable while it stops."""
    sim = GkeClusterSim(cluster=CLUSTER, kubelet=GracefulKubelet())
    with container_server_running(sim=sim) as container, kube_server_running(sim=sim) as kube, sim.running():
        cluster = SimulatedGke(sim, container, kube)
        cluster.add_pool("default-pool", machine_type="e2-standard-4", per_zone=1)  # task pods
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
        yield cluster


def plan_file(folder: Path, *, endpoint: str | None = None) -> str:
    """The plan (and config.yaml beside it) of a tiny run on pool `gpu`; `endpoint`: the Container API
    stand-in's, for the commands that resize the pool (the exit handler's scale-down)."""
    config = tiny_config(data_uri="gs://data/tiny", checkpoint_uri="gs://ckpt/tiny")
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="gpu",
        image="registry.example/batchpilot:0.1.0", machine_type="a3-highgpu-8g",
        accelerator_type="nvidia-h100-80gb", devices_per_node=8, namespace=NS,
    )  # fmt: skip
    if endpoint is not None:
        config["cluster"]["container_api_endpoint"] = endpoint
    config["batch"]["micro_batch_size"] = 2
    return write_plan(folder, config)


def start_train_task(gke: SimulatedGke, plan: str, pod: str, folder: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "KUBECONFIG": str(gke.write_kubeconfig(folder / "kubeconfig")),
        POD_NAME_ENV: pod,
        POD_NAMESPACE_ENV: KFP_NS,
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def wait_for_running_jobset(gke: SimulatedGke, proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with gke.sim.lock:
            running = [p for p in gke.sim.pods.values() if p["metadata"]["namespace"] == NS and
                       p["status"]["phase"] == "Running"]  # fmt: skip
            if running and gke.sim.jobsets:
                time.sleep(1.0)  # the task follows it
                return next(iter(gke.sim.jobsets))[1]
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError("the JobSet's pod never ran")


def follow_until_adopted(retry: subprocess.Popen[str], jobset: str) -> str:
    deadline = time.monotonic() + 90
    lines: list[str] = []
    assert retry.stdout is not None
    while not any("adopting its running JobSet" in line for line in lines):
        assert time.monotonic() < deadline and retry.poll() is None, "".join(lines)
        lines.append(retry.stdout.readline())
    assert f"adopting its running JobSet {jobset}" in "".join(lines)
    return "".join(lines)


@pytest.mark.slow
def test_an_evicted_train_task_leaves_its_jobset_and_the_retry_adopts_it(gke, tmp_path):
    plan = plan_file(tmp_path)
    pod = train_task_pod(gke.sim)
    proc = start_train_task(gke, plan, pod, tmp_path)
    jobset = wait_for_running_jobset(gke, proc)
    mark_evicted(gke.sim, pod)  # e.g. the autoscaler drains the CPU node the task runs on
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, output
    assert (
        f"SIGTERM is an eviction (pod {pod} has DisruptionTarget (EvictionByEvictionAPI)): leaving its JobSet "
        f"running for the retry to adopt; exit {EXIT_PREEMPTED}"
    ) in output
    assert not gke.sim.jobsets[(NS, jobset)]["metadata"].get("deletionTimestamp"), output

    retry = start_train_task(gke, plan, train_task_pod(gke.sim), tmp_path)  # KFP's retry: a new pod
    lines = follow_until_adopted(retry, jobset)
    for key in list(gke.sim.pods):
        if key[0] == NS:
            gke.sim.finish_pod(*key, exit_code=0)
    output, _ = retry.communicate(timeout=90)
    assert retry.returncode == 0, lines + output + repr(gke.sim.jobsets[(NS, jobset)].get("status"))
    assert [name for ns, name in gke.sim.jobsets if ns == NS] == [jobset]  # nothing new was created


@pytest.mark.slow
def test_a_terminated_train_task_deletes_its_jobset(gke, tmp_path):
    """Argo's TerminateContainers (KFP terminate, a deadline): SIGTERM, the pod object stays."""
    plan = plan_file(tmp_path)
    pod = train_task_pod(gke.sim)
    proc = start_train_task(gke, plan, pod, tmp_path)
    jobset = wait_for_running_jobset(gke, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert (
        f"SIGTERM is a cancel (pod {pod} is not being deleted (a cancel or a deadline)): deleting" in output
    )
    # Deleted with propagationPolicy Foreground: it stays, marked, while its trainers checkpoint.
    assert gke.sim.jobsets[(NS, jobset)]["metadata"].get("deletionTimestamp"), output


# --- the task's own disruption budget ----------------------------------------------------------------


def drain(gke: SimulatedGke, pod: str) -> tuple[int, str]:
    """What `kubectl drain` (or a node upgrade, or the autoscaler) asks for each pod: an Eviction."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=KFP_NS))
    try:
        client.CoreV1Api(gke.kube.api_client()).create_namespaced_pod_eviction(pod, KFP_NS, eviction)
    except ApiException as error:
        return error.status, str(error.body)
    return 201, ""


@pytest.mark.slow
def test_a_drain_cannot_evict_the_task_while_it_follows_its_launch(gke, tmp_path):
    """The task's budget (minAvailable 1 over its own pod) makes the Eviction API refuse with 429; once the
    launch ended the budget is gone and the pod can be evicted (kube_disruption.py has the rules)."""
    plan = plan_file(tmp_path)
    pod = train_task_pod(gke.sim)
    proc = start_train_task(gke, plan, pod, tmp_path)
    wait_for_running_jobset(gke, proc)
    code, body = drain(gke, pod)
    assert code == 429 and "Cannot evict pod as it would violate the pod's disruption budget." in body, body
    assert not gke.sim.pods[(KFP_NS, pod)]["metadata"].get("deletionTimestamp")  # still following
    for key in list(gke.sim.pods):
        if key[0] == NS:
            gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    assert f"task pod {pod}: PodDisruptionBudget batchpilot-task-" in output
    assert not gke.kube.state.budgets, gke.kube.state.budgets
    assert drain(gke, pod)[0] == 201


@pytest.mark.slow
def test_a_task_that_may_not_make_its_budget_says_so_and_trains(gke, tmp_path):
    gke.kube.state.denied.add(("create", "poddisruptionbudgets.policy"))
    plan = plan_file(tmp_path)
    pod = train_task_pod(gke.sim)
    proc = start_train_task(gke, plan, pod, tmp_path)
    wait_for_running_jobset(gke, proc)
    for key in list(gke.sim.pods):
        if key[0] == NS:
            gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    assert (
        f"task pod {pod}: cannot protect it with a PodDisruptionBudget (HTTP 403 Forbidden): a node drain or "
        "upgrade may evict it (the chart's Role grants pods/patch and poddisruptionbudgets)"
    ) in output


# --- an evicted task under each Argo configuration ----------------------------------------------------

KFP_2_17_DEFAULTS = {"retryStrategy": {"limit": "2", "retryPolicy": "OnError"}}  # kubeflow/pipelines #13485
ALWAYS = {"retryStrategy": {"limit": "2", "retryPolicy": "Always"}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("defaults", "seen", "retried"),
    [
        (None, False, False),  # KFP up to 2.16's manifests: OnFailure, and the pod was gone
        (None, True, True),  # OnFailure, and the controller saw exit 75
        (KFP_2_17_DEFAULTS, False, True),  # OnError, the pod was gone: "pod deleted"
        (KFP_2_17_DEFAULTS, True, False),  # OnError, and the controller saw exit 75
        (ALWAYS, False, True),
        (ALWAYS, True, True),
    ],
    ids=[
        "onfailure-deleted",
        "onfailure-seen",
        "onerror-deleted",
        "onerror-seen",
        "always-deleted",
        "always-seen",
    ],
)
def test_a_task_lost_to_its_node_under_each_argo_configuration(gke, tmp_path, defaults, seen, retried):
    """The task's node shuts down (a graceful node shutdown: no Eviction API, so no budget stops it); the task
    leaves its JobSet and exits 75. Whether Argo retries it follows from its templateDefaults and from
    whether its controller saw the exit before the pod was gone (kfp_driver.argo_retry, attempt_phase). Retried,
    the new attempt adopts the running JobSet; not retried, the run fails and its exit handler deletes the
    JobSet: nothing keeps the GPUs, and the run's retry starts the stage again from its last checkpoint."""
    plan = plan_file(tmp_path, endpoint=gke.container.endpoint)
    pod = train_task_pod(gke.sim)
    proc = start_train_task(gke, plan, pod, tmp_path)
    jobset = wait_for_running_jobset(gke, proc)
    mark_evicted(gke.sim, pod, reason="DeletionByGracefulNodeShutdown")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, output
    pipeline, _ = load_compiled(NEMO)
    phase = attempt_phase(exit_code=proc.returncode, controller_saw_it_end=seen)
    starts, why = argo_retry(
        retry_policy(pipeline, "final/train-stage"), attempts=[(0.0, 60.0)], now=60.0, phase=phase,
        template_defaults=defaults,
    )  # fmt: skip
    assert (starts is not None) == retried, why
    if retried:
        retry = start_train_task(gke, plan, train_task_pod(gke.sim), tmp_path)
        lines = follow_until_adopted(retry, jobset)
        for key in list(gke.sim.pods):
            if key[0] == NS:
                gke.sim.finish_pod(*key, exit_code=0)
        output, _ = retry.communicate(timeout=90)
        assert retry.returncode == 0, lines + output
        assert [name for ns, name in gke.sim.jobsets if ns == NS] == [jobset]
        return
    # Not retried: the DAG fails and Argo runs the exit handler (the pipeline's scale-down task). Its trainers
    # checkpoint on SIGTERM in a second here, not in their 120 s grace period.
    gke.sim.kubelet.grace_cap_s = 1.0
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    handler = subprocess.run(
        [sys.executable, "-m", "batchpilot", "pool", "scale-down", "--config", str(tmp_path / "config.yaml")],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert handler.returncode == 0, handler.stdout + handler.stderr
    assert f"deleting JobSet(s) {jobset} (the end of run tiny)" in handler.stdout + handler.stderr
    remaining = gke.sim.jobsets.get((NS, jobset))
    assert remaining is None or remaining["metadata"].get("deletionTimestamp")
