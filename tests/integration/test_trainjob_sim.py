"""Issue #37: `cluster.launcher: trainjob` runs each launch as a Kubeflow Trainer v2 TrainJob on a
ClusterTrainingRuntime, and Trainer builds the same JobSet the `jobset` launcher would create.

Trainer is the stand-in in trainer_controller.py (its rules from Trainer v2.3.0, each with its file; objects
validated against Trainer's published CRDs), served by the simulated cluster's Kubernetes API; `batchpilot
launch` runs as a process with the real `kubernetes` client. The pods run no process here: the test ends them
as a trainer would.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from gke_sim import SimulatedGke, simulated_gke, start_launch
from test_kueue_sim import pods_of, wait_for
from trainer_controller import TrainerController, build_jobset, check_schema

from batchpilot.cluster.trainjob import runtime_object, runtime_problems, trainjob_object
from helpers import gke_a3_config, write_plan

NS = "batchpilot"


def dry_run(plan: str) -> list[dict[str, Any]]:
    """`batchpilot launch --dry-run` of stage 0: [the ClusterTrainingRuntime, the TrainJob]."""
    done = subprocess.run(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "0", "--dry-run"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return list(yaml.safe_load_all(done.stdout))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("trainjob")
    plan = write_plan(folder, gke_a3_config(namespace=NS, launcher="trainjob"))
    return plan, dry_run(plan)


def test_trainers_jobset_for_the_trainjob_is_the_jobset_launchers_jobset(rendered):
    """Split into a runtime and a TrainJob and built again by Trainer's rules, the launch's JobSet is the one
    the jobset launcher creates, with only what Trainer adds: torchrun's PET_* variables, its owner and the
    runtime's ancestor label on the Job template. Both
    objects pass Trainer's published CRDs with no field the API server would prune."""
    from batchpilot.cluster.jobset import JobSetOpts, app_to_jobset
    from batchpilot.cluster.launch import cluster_appdef
    from batchpilot.config import ClusterConfig

    _, (runtime, trainjob) = rendered
    assert check_schema("clustertrainingruntimes", runtime) is None
    assert check_schema("trainjobs", trainjob) is None
    # The node pool, tolerations and account come with each TrainJob, so one runtime serves every pool.
    pod_spec = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]
    assert not {"nodeSelector", "tolerations", "serviceAccountName"} & set(pod_spec)
    (patch,) = trainjob["spec"]["runtimePatches"]
    patched_pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]
    assert {"nodeSelector", "tolerations", "serviceAccountName"} <= set(patched_pod["spec"])
    # The JobSet the jobset launcher would create for the same launch (its node job named as Trainer's).
    cluster = ClusterConfig.model_validate(gke_a3_config(namespace=NS, launcher="trainjob")["cluster"])
    from batchpilot.cluster.launch_spec import LaunchSpec

    spec = LaunchSpec(name=trainjob["metadata"]["name"], trainer_args=("--stage", "0"), num_nodes=2,
                      processes_per_node=8, env={}, labels=dict(trainjob["metadata"]["labels"]))  # fmt: skip
    appdef = cluster_appdef(spec, cluster=cluster)
    jobset = app_to_jobset(appdef, JobSetOpts(namespace=NS, service_account="batchpilot", labels=spec.labels))
    split_runtime = runtime_object(jobset, name="batchpilot")
    split_trainjob = trainjob_object(jobset, runtime="batchpilot")
    split_trainjob["metadata"]["uid"] = "uid-1"
    built = build_jobset(split_runtime, split_trainjob)
    (container,) = built["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    pet = {e["name"]: e for e in container["env"] if e["name"].startswith("PET_")}
    assert pet["PET_NNODES"]["value"] == "2" and pet["PET_NPROC_PER_NODE"]["value"] == "auto"
    assert pet["PET_MASTER_ADDR"]["value"] == f"{spec.name}-node-0-0.{spec.name}"
    # torchrun's own arguments name the same rank-0 host: Trainer's variables change nothing.
    rank0 = next(e["value"] for e in container["env"] if e["name"] == "TORCHX_RANK0_HOST")
    assert rank0 == pet["PET_MASTER_ADDR"]["value"]
    container["env"] = [e for e in container["env"] if not e["name"].startswith("PET_")]
    assert built["metadata"].pop("ownerReferences")[0]["kind"] == "TrainJob"
    assert built["metadata"].pop("annotations") == {}
    ancestor = {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}}
    assert (
        built["spec"]["replicatedJobs"][0]["template"].pop("metadata") == ancestor
    )  # the runtime's Job label
    expected = copy.deepcopy(jobset)
    expected["spec"]["network"].pop("subdomain")  # JobSet defaults it to the name (jobset_webhook.go Default)
    assert built == expected


def test_a_runtime_that_differs_where_a_trainjob_cannot_set_it_is_named(rendered):
    _, (runtime, _) = rendered
    assert runtime_problems(runtime, runtime) == []
    other = copy.deepcopy(runtime)
    other["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 0
    other["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ][0]["image"] = "someone/else:1"  # the TrainJob sets the image: no difference
    assert runtime_problems(other, runtime) == [
        "spec.template.spec.failurePolicy.maxRestarts: 0 instead of 10"
    ]
    stock = copy.deepcopy(runtime)  # Trainer's own torch-distributed runtime: no sidecar, no failure policy
    del stock["spec"]["template"]["spec"]["failurePolicy"]
    assert any("failurePolicy: missing instead of" in p for p in runtime_problems(stock, runtime))


@pytest.fixture
def gke(rendered) -> Iterator[SimulatedGke]:
    trainer = TrainerController()
    with simulated_gke(trainer=trainer) as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=2)
        yield cluster


def test_a_launch_runs_as_a_trainjob_whose_jobset_trainer_builds(gke, rendered, tmp_path):
    plan, (runtime, _) = rendered
    gke.sim.trainer.add_runtime(runtime)  # what `kubectl apply` of the dry run's first document makes
    proc = start_launch(gke, plan, tmp_path)
    name = wait_for(lambda: gke.sim.trainer.built, proc=proc)[0]
    trainjob = gke.sim.trainer.trainjobs[(NS, name)]
    assert trainjob["metadata"]["labels"]["batchpilot.dev/stage"] == "stage-0"
    jobset = gke.sim.jobsets[(NS, name)]
    assert jobset["metadata"]["ownerReferences"][0]["uid"] == trainjob["metadata"]["uid"]
    running = wait_for(lambda: pods_of(gke, name), proc=proc)
    pod = gke.sim.pods[running[0]]
    # The runtime patch's pod settings reach the pods: safe-to-evict, GPUDirect's networks, the pool.
    assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert "networking.gke.io/interfaces" in pod["metadata"]["annotations"]
    assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "gpu"
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["tcpx-daemon"]  # from the runtime
    (node,) = pod["spec"]["containers"]
    assert node["name"] == "node" and node["resources"]["limits"]["nvidia.com/gpu"] == "8"
    time.sleep(1.0)  # the launch follows the pods
    for key in running:
        gke.sim.finish_pod(*key, exit_code=0)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in trainjob["status"]["conditions"])


def test_a_missing_or_different_runtime_is_refused_before_any_trainjob(gke, rendered, tmp_path):
    plan, (runtime, _) = rendered
    proc = start_launch(gke, plan, tmp_path)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "cluster.training_runtime: ClusterTrainingRuntime 'batchpilot' does not exist" in output
    other = copy.deepcopy(runtime)
    other["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 6
    gke.sim.trainer.add_runtime(other)
    proc = start_launch(gke, plan, tmp_path)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "cannot run this launch (1 difference(s); first: spec.template.spec.replicatedJobs[node].template." \
           "spec.backoffLimit: 6 instead of 0)" in output  # fmt: skip
    assert not gke.sim.trainer.trainjobs and not gke.sim.jobsets


def test_a_queued_trainjob_waits_for_quota_then_trains_on_the_flavors_nodes(rendered, tmp_path):
    """With `cluster.kueue_queue`, Kueue queues the TrainJob (not the JobSet Trainer builds): it is created
    suspended, waits while another team's JobSet holds the quota, and once admitted Kueue's runtime patch
    carries the flavor's node labels to the pods (Kueue's TrainJob integration in kueue_controller.py)."""
    from kubernetes import client
    from kueue_controller import QUEUE_LABEL, KueueController, workload_name

    kueue = KueueController()
    # The flavor's own node label (the pool carries it) shows that Kueue's patch reached the pods.
    flavor = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "example.com/team-flavor": "h100-a"}
    kueue.add_flavor("h100", node_labels=flavor)
    kueue.add_cluster_queue(
        "team", quota={"h100": {"cpu": "1000", "memory": "10000Gi", "nvidia.com/gpu": "8"}}
    )
    kueue.add_local_queue(NS, "team-a", cluster_queue="team")
    with simulated_gke(kueue=kueue, trainer=TrainerController()) as gke:
        gke.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=2)
        gke.sim.pool_labels["gpu"] = {"example.com/team-flavor": "h100-a"}
        gke.sim.trainer.add_runtime(rendered[1][0])
        pod = {"containers": [{"name": "main", "image": "x", "resources": {
                   "limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "1", "memory": "1Gi"}}}],
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "restartPolicy": "Never"}  # fmt: skip
        other = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                 "metadata": {"name": "other-team", "labels": {QUEUE_LABEL: "team-a"}},
                 "spec": {"replicatedJobs": [{"name": "main", "replicas": 1, "template": {"spec": {
                     "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod}}}}]}}  # fmt: skip
        client.CustomObjectsApi(gke.kube.api_client()).create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", other
        )
        wait_for(lambda: pods_of(gke, "other-team"))
        plan = write_plan(tmp_path, gke_a3_config(namespace=NS, launcher="trainjob", kueue_queue="team-a",
                                                  capacity_timeout_s=120))  # fmt: skip
        proc = start_launch(gke, plan, tmp_path)
        name = wait_for(lambda: gke.sim.trainer.built, proc=proc)[0]
        trainjob = gke.sim.trainer.trainjobs[(NS, name)]
        assert trainjob["spec"]["suspend"] is True and gke.sim.jobsets[(NS, name)]["spec"]["suspend"] is True
        assert (
            QUEUE_LABEL not in gke.sim.jobsets[(NS, name)]["metadata"]["labels"]
        )  # Kueue queues the TrainJob
        workloads = kueue.objects["workloads"]
        key = (
            NS,
            workload_name(name, trainjob["metadata"]["uid"], kind="TrainJob", group="trainer.kubeflow.org"),
        )
        wait_for(lambda: key in workloads, proc=proc)
        assert workloads[key]["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
        assert workloads[key]["spec"]["podSets"][0]["name"] == "node"
        time.sleep(2.0)  # still waiting: no pod of ours while the other team's JobSet holds the GPUs
        assert not pods_of(gke, name, "Pending") and not pods_of(gke, name)
        for other_pod in pods_of(gke, "other-team"):
            gke.sim.finish_pod(*other_pod, exit_code=0)
        running = wait_for(lambda: pods_of(gke, name), proc=proc)
        assert trainjob["spec"]["suspend"] is False
        selector = gke.sim.pods[running[0]]["spec"]["nodeSelector"]
        assert selector["example.com/team-flavor"] == "h100-a"  # from Kueue's patch
        assert selector["cloud.google.com/gke-nodepool"] == "gpu"  # from batchpilot's
        time.sleep(1.0)
        for key_ in running:
            gke.sim.finish_pod(*key_, exit_code=0)
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output
        assert (
            f"Kueue, TrainJob {name} in LocalQueue team-a: QuotaReserved=False (Pending: couldn't assign"
            in output
        )
        assert "insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed" in output
        assert f"Kueue, TrainJob {name} in LocalQueue team-a: QuotaReserved=True" in output


def test_an_interrupted_launch_deletes_its_trainjob_not_only_the_jobset(gke, rendered, tmp_path):
    """Ctrl-C (or a cancel) deletes the TrainJob: deleting only its JobSet would make Trainer build it again."""
    import os
    import signal

    plan, (runtime, _) = rendered
    gke.sim.trainer.add_runtime(runtime)
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "0"], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    name = wait_for(lambda: gke.sim.trainer.built, proc=proc)[0]
    wait_for(lambda: pods_of(gke, name), proc=proc)
    time.sleep(1.0)  # the launch follows the pods
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, output
    wait_for(lambda: not gke.sim.trainer.trainjobs and not gke.sim.jobsets and not gke.sim.pods)
    assert gke.sim.trainer.built == [name]  # never built again
