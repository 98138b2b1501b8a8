"""What `batchpilot launch --dryrun` renders for GKE: a JobSet or a Volcano Job, validated against schemas.

The CRD schemas are the published JobSet and Volcano CRDs under tests/fixtures/schemas; the pod templates
inside are checked with kubernetes-validate --strict as the Job/Pod objects the controllers create.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.cluster.jobset import JobSetOpts, app_to_jobset, jobset_state
from batchpilot.cluster.launch import cluster_appdef
from batchpilot.cluster.launch_spec import cluster_launch_spec
from batchpilot.cluster.placement import gpu_node_selector, gpu_tolerations
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.planner import make_run_document
from batchpilot.threads import local_trainer_threads
from helpers import validate_crd

K8S_VERSION = "1.30.0"


def validate_k8s(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def gke_config(**cluster: object) -> dict:
    flex = cluster.get("provisioning") == "flex-start"  # no explore task then: its pool has no node for one
    return {
        **({"explore": {"study": False}} if flex else {}),
        "name": "ramp",
        "data": {"uri": "gs://bucket/data", "seq_len": 128},
        "cluster": {
            "backend": "gke",
            "devices_per_node": 8,
            "max_nodes": 4,
            "project": "proj",
            "location": "us-central1",
            "cluster_name": "train",
            "node_pool": "h100",
            "accelerator_type": "nvidia-h100-80gb",
            "image": "registry.example/batchpilot:0.1.0",
            "cpu_per_node": 200,
            "memory_per_node_bytes": "1000GB",
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}
            ],
            "node_selector": {"team": "lm"},
            **cluster,
        },
        "batch": {"global_batch_size": 512, "micro_batch_size": 4, "schedule": "0:128 1K:256 2K:512"},
        "train": {"total_samples": 8192, "lr": 3e-4, "checkpoint_uri": "gs://bucket/ckpt"},
    }


def launch_in_process(*argv: str) -> tuple[int, str, str]:
    """`batchpilot launch ARGV` in this process (the imports are paid once): (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["launch", *argv])
    return code, out.getvalue(), err.getvalue()


def write_plan(folder: Path, config: dict) -> str:
    """plan.json (the run document, carrying the config) for `config`, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(make_run_document(parse_config(config)).to_json())
    return str(folder / "plan.json")


def dryrun(tmp_path: Path, stage: str, **cluster: object) -> dict:
    plan = write_plan(tmp_path, gke_config(**cluster))
    code, out, err = launch_in_process("--plan", plan, "--stage", stage, "--dryrun")
    assert code == 0, err
    return yaml.safe_load(out)


@pytest.fixture(scope="module")
def jobset(tmp_path_factory) -> dict:
    return dryrun(tmp_path_factory.mktemp("jobset"), "final", kueue_queue="lm-queue")


@pytest.fixture(scope="module")
def volcano(tmp_path_factory) -> dict:
    return dryrun(tmp_path_factory.mktemp("volcano"), "0", launcher="volcano")


def test_the_jobset_validates_against_the_published_crd(jobset):
    validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    broken = copy.deepcopy(jobset)
    broken["spec"]["replicatedJobs"][0]["replicas"] = "one"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validate_crd(broken, "jobset.x-k8s.io_jobsets.yaml")


@pytest.fixture(scope="module")
def launch_jobset(tmp_path_factory) -> dict:
    """All three stages of gke_config's plan run on 4 nodes: one launch, `stages-0-final`."""
    return dryrun(tmp_path_factory.mktemp("launch"), "0-final", kueue_queue="lm-queue")


def test_a_launch_of_several_stages_is_one_valid_jobset_training_them_in_turn(launch_jobset, tmp_path):
    validate_crd(launch_jobset, "jobset.x-k8s.io_jobsets.yaml")
    (replicated,) = launch_jobset["spec"]["replicatedJobs"]
    validate_k8s(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "x"},
            "spec": replicated["template"]["spec"],
        }
    )
    assert launch_jobset["metadata"]["labels"]["batchpilot.dev/stage"] == "stages-0-final"
    assert launch_jobset["metadata"]["name"].startswith("ramp-stages-0-final")
    job = replicated["template"]["spec"]
    assert job["parallelism"] == 4
    command = job["template"]["spec"]["containers"][0]["command"][-1]
    assert "--nnodes 4 --nproc_per_node 8" in command and "--stage 0-2" in command
    # The launch's name selects it too, and renders the same job.
    plan = write_plan(tmp_path, gke_config(kueue_queue="lm-queue"))
    code, out, err = launch_in_process("--plan", plan, "--stage", "stages-0-final", "--dryrun")
    assert code == 0, err
    assert yaml.safe_load(out)["metadata"]["labels"] == launch_jobset["metadata"]["labels"]


def test_a_range_over_two_node_counts_is_refused_naming_the_launches(tmp_path):
    config = gke_config()
    config["batch"]["micro_batch_size"] = 16  # 128 on 1 node, 256 on 2, 512 on 4
    plan = write_plan(tmp_path, config)
    code, _, err = launch_in_process("--plan", plan, "--stage", "0-1", "--dryrun")
    assert code == 2
    assert "stages 0-1 run on 1, 2 nodes; one launch runs on one node count" in err
    assert "give one launch of this plan: 0 (stage-0, 1 node(s)), 1 (stage-1, 2 node(s)), 2 (final" in err


def test_the_jobset_job_template_is_a_valid_kubernetes_job(jobset):
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "x"},
        "spec": replicated["template"]["spec"],
    }
    validate_k8s(job)


def test_the_jobset_runs_the_final_stage_on_its_nodes_with_placement_and_kueue(jobset):
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "lm-queue"
    assert jobset["spec"]["suspend"] is True  # Kueue admits it
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4 and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": "h100",
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
        "team": "lm",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/batchpilot:0.1.0"
    assert container["resources"]["limits"] == {"cpu": "200000m", "memory": "1000000M", "nvidia.com/gpu": "8"}
    command = container["command"][-1]
    assert "--nnodes 4 --nproc_per_node 8" in command and "--stage 2" in command  # final = stage 2
    env = {item["name"]: item.get("value") for item in container["env"]}
    name = jobset["metadata"]["name"]
    assert env["TORCHX_RANK0_HOST"] == f"{name}-batchpilot-0-0.{name}"
    assert json.loads(env["BATCHPILOT_PLAN_JSON"])["config"]["cluster"]["node_pool"] == "h100"
    assert "BATCHPILOT_CONFIG_YAML" not in env  # the run document carries the config


def test_trainer_pods_run_non_root_read_only_without_escalation(jobset, volcano):
    pods = [jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
    pods += [task["template"]["spec"] for task in volcano["spec"]["tasks"]]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["serviceAccountName"] == "batchpilot"
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_the_volcano_job_validates_and_has_one_task_per_node(volcano):
    validate_crd(volcano, "batch.volcano.sh_jobs.yaml")
    assert volcano["metadata"]["namespace"] == "batchpilot" and volcano["spec"]["queue"] == "default"
    assert len(volcano["spec"]["tasks"]) == 4  # stage 0: 128 samples = micro batch 4 x 8 GPUs x 4 nodes
    for task in volcano["spec"]["tasks"]:
        validate_k8s({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, **task["template"]})


def test_dryrun_of_a_local_config_and_missing_gke_settings_are_one_line_errors(tmp_path):
    local = gke_config(backend="local")
    local["cluster"] = {"backend": "local", "max_nodes": 2}
    plan = write_plan(tmp_path / "local", local)
    code, _, err = launch_in_process("--plan", plan, "--stage", "0", "--dryrun")
    assert code == 2 and err.startswith("batchpilot: error: --dry-run:")
    plan = write_plan(tmp_path / "gke", gke_config(image=None))
    code, _, err = launch_in_process("--plan", plan, "--stage", "0", "--dryrun")
    assert code == 2
    assert err.strip() == (
        "batchpilot: error: cluster.image: is required when cluster.backend is gke (fix: set cluster.image)"
    )


def test_placement_helpers_for_kfp_tasks():
    config = parse_config(gke_config())
    assert gpu_node_selector(config)["cloud.google.com/gke-nodepool"] == "h100"
    assert gpu_node_selector(config.cluster) == gpu_node_selector(config)
    assert gpu_tolerations(config)[0] == {
        "key": "nvidia.com/gpu",
        "operator": "Exists",
        "effect": "NoSchedule",
    }
    cpu_only = parse_config(gke_config(accelerator_type=None, tolerations=[], node_selector={}))
    assert gpu_node_selector(cpu_only) == {"cloud.google.com/gke-nodepool": "h100"}
    assert gpu_tolerations(cpu_only) == []


def test_a_long_run_name_makes_a_short_jobset_and_an_unusable_app_name_is_refused():
    """(#20) The launch's JobSet is named `names.jobset_name`, whatever the run's name; the scheduler itself
    refuses a name its pods could not have (a leading digit), before any API call."""
    from batchpilot.planning import Stage
    from batchpilot.planning.launches import launch_of

    config = parse_config(gke_config())
    stage = Stage(0, "stage-0", 128, 0, 1024, 4, 32, 4, 1, 3e-4, 8, 32, 128, 4, False)
    launch = launch_of([stage], index=0)
    spec = cluster_launch_spec(run_name="r" * 60, launch=launch, devices_per_node=8, plan_text="{}")
    appdef = cluster_appdef(spec, cluster=config.cluster)
    name = app_to_jobset(appdef, JobSetOpts(namespace="ns"))["metadata"]["name"]
    assert name.startswith("r" * 20) and "-stage-0-" in name and len(name) == 38
    appdef.name = "5b-llama-stage-0"
    with pytest.raises(ValueError, match="DNS-1035 label must consist"):
        app_to_jobset(appdef, JobSetOpts(namespace="ns"))


@pytest.mark.parametrize(
    ("status", "state"),
    [
        (None, "PENDING"),
        ({"conditions": [{"type": "Completed", "status": "True"}]}, "SUCCEEDED"),
        ({"terminalState": "Failed"}, "FAILED"),
        ({"conditions": [{"type": "Suspended", "status": "True"}]}, "PENDING"),
        ({"replicatedJobsStatus": [{"name": "t", "active": 2}]}, "RUNNING"),
        ({"conditions": [{"type": "Completed", "status": "False"}]}, "PENDING"),
    ],
)
def test_jobset_status_maps_to_torchx_states(status, state):
    assert jobset_state(status).name == state


def test_local_trainers_and_probes_use_one_thread_unless_omp_num_threads_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert local_trainer_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert local_trainer_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(BatchpilotError, match="OMP_NUM_THREADS"):
        local_trainer_threads()


# --- lifecycle: labels, TTL, failure policies, the pod's exit code --------------------------------


def test_the_jobset_and_its_pods_carry_the_run_stage_and_plan_labels(jobset):
    labels = jobset["metadata"]["labels"]
    assert labels["batchpilot.dev/run"] == "ramp" and labels["batchpilot.dev/stage"] == "final"
    assert len(labels["batchpilot.dev/plan"]) == 12 and labels["kueue.x-k8s.io/queue-name"] == "lm-queue"
    pod_labels = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    assert {key: pod_labels[key] for key in ("batchpilot.dev/run", "batchpilot.dev/stage")} == {
        "batchpilot.dev/run": "ramp",
        "batchpilot.dev/stage": "final",
    }
    assert jobset["spec"]["ttlSecondsAfterFinished"] == 24 * 3600


def test_disruptions_and_preemptions_restart_the_jobset_and_real_errors_fail_it(jobset):
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"operator": "In", "values": [75]}},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [75]}},
    ]
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 10
    assert [(rule["action"], rule["onJobFailureReasons"]) for rule in policy["rules"]] == [
        ("FailJobSet", ["PodFailurePolicy"]),
        ("RestartJobSet", ["BackoffLimitExceeded"]),
    ]
    validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    broken = copy.deepcopy(jobset)
    broken["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"
    with pytest.raises(Exception, match="is not one of"):
        validate_crd(broken, "jobset.x-k8s.io_jobsets.yaml")


def test_the_pod_command_exits_75_only_when_the_trainers_stopped_for_preemption(jobset):
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    command = container["command"][-1]
    assert command.startswith("rm -f /tmp/batchpilot/out/preempted; torchrun() {")
    assert "--out /tmp/batchpilot/out" in command
    env = {item["name"]: item.get("value") for item in container["env"]}
    grace_s = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) == grace_s - 10  # torchrun's own default: 30 s


FAKE_TORCHRUN = """#!/bin/bash
# Stands in for torchrun: exits 1 like torchrun whatever the trainers did; on SIGTERM the "trainers"
# checkpoint (write the marker) first. $1: what to do.
trap 'touch "$MARKER"; exit 1' TERM
case "$1" in
  preempted) touch "$MARKER"; exit 1 ;;
  fails) exit 3 ;;
  succeeds) exit 0 ;;
  waits) echo started; while true; do sleep 0.1; done ;;
esac
"""


def run_wrapped(tmp_path: Path, action: str) -> subprocess.Popen:
    from batchpilot.cluster.launch_spec import exit_75_when_preempted

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    marker = tmp_path / "preempted"
    marker.write_text("a previous run's\n")  # removed before torchrun starts
    line = exit_75_when_preempted(f"true && torchrun {action}", marker=str(marker))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MARKER": str(marker)}
    return subprocess.Popen(["bash", "-c", line], env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("action", "code"), [("preempted", 75), ("fails", 3), ("succeeds", 0)])
def test_the_exit_code_wrapper_turns_the_trainers_marker_into_75(tmp_path, action, code):
    proc = run_wrapped(tmp_path, action)
    assert proc.wait(timeout=30) == code


def test_the_exit_code_wrapper_forwards_sigterm_to_torchrun_and_waits_for_it(tmp_path):
    proc = run_wrapped(tmp_path, "waits")
    assert proc.stdout.readline() == "started\n"
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends to PID 1
    assert proc.wait(timeout=30) == 75
