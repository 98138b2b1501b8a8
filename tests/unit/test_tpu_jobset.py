"""Issue #14: a launch on a TPU slice is a multi-host JobSet: one pod per TPU VM with all its chips, on the
node pool of the launch's slice shape, one trainer process per pod (no torchrun). Each rendered JobSet is
validated against the published JobSet CRD and its Job with kubernetes-validate --strict."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from test_cluster_launch import dryrun as gpu_dryrun
from test_cluster_launch import launch_in_process, validate_crd, validate_k8s, write_plan

from batchpilot.cluster.launch_spec import exit_75_when_preempted
from batchpilot.cluster.machines import MACHINE_TYPES, gke_allocatable
from batchpilot.cluster.tpu_jobset import WORKER_HOSTNAMES_ENV
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from helpers import REPO

JOBSET_CRD = "jobset.x-k8s.io_jobsets.yaml"

# GKE TPU types: (accelerator label, machine type, node pool). 4 chips per VM; a stage's node count is the
# host count of a slice: the schedule at micro batch 2 grows 2 -> 4 -> 8 hosts.
V6E = ("tpu-v6e-slice", "ct6e-standard-4t", "v6e")
V5P = ("tpu-v5p-slice", "ct5p-hightpu-4t", "v5p")


def tpu_config(tpu: tuple[str, str, str], **cluster: object) -> dict:
    accelerator, machine, pool = tpu
    return {
        "name": "tiny-tpu",
        "model": {
            "factory": "batchpilot.models.llama:build",
            "args": {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 128, "vocab_size": 512},
        },
        "data": {"uri": "gs://bucket/tokens", "seq_len": 128},
        "cluster": {
            "backend": "gke",
            "devices_per_node": 4,
            "min_nodes": 2,
            "max_nodes": 8,
            "project": "proj",
            "location": "us-east5",
            "tpu_zone": "us-east5-b",
            "cluster_name": "train",
            "node_pool": pool,
            "accelerator_type": accelerator,
            "machine_type": machine,
            "image": "registry.example/batchpilot:0.1.0-tpu",
            **cluster,
        },
        "batch": {"global_batch_size": 64, "micro_batch_size": 2, "schedule": "0:16 4K:32 8K:64"},
        "train": {"total_samples": 16384, "lr": 3e-4, "checkpoint_uri": "gs://bucket/ckpt"},
        "explore": {"study": False},
    }  # fmt: skip


# ct6e-standard-4t's vCPUs and memory are not in the machine table: a v6e config sizes its pods.
V6E_SIZES = {"cpu_per_node": 170, "memory_per_node_bytes": "680GiB"}


def render(folder: Path, config: dict, stage: str) -> dict:
    plan = write_plan(folder, config)
    code, out, err = launch_in_process("--plan", plan, "--stage", stage, "--dryrun")
    assert code == 0, err
    return yaml.safe_load(out)


CASES = {
    # id: (TPU, stage, hosts, topology)
    "v6e-2-hosts": (V6E, "stage-0", 2, "2x4"),
    "v6e-4-hosts": (V6E, "stage-1", 4, "4x4"),
    "v6e-8-hosts": (V6E, "final", 8, "4x8"),
    "v5p-2-hosts": (V5P, "stage-0", 2, "2x2x2"),
    "v5p-8-hosts": (V5P, "final", 8, "2x4x4"),
}


@pytest.fixture(scope="module", params=list(CASES))
def rendered(request, tmp_path_factory) -> tuple[dict, tuple, int, str]:
    tpu, stage, hosts, topology = CASES[request.param]
    sizes = V6E_SIZES if tpu is V6E else {}
    jobset = render(tmp_path_factory.mktemp(request.param), tpu_config(tpu, **sizes), stage)
    return jobset, tpu, hosts, topology


def pod_spec(jobset: dict) -> dict:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, str | None]:
    return {item["name"]: item.get("value") for item in container["env"]}


def test_the_tpu_jobset_validates_against_the_published_crd_and_its_job_against_kubernetes(rendered):
    jobset, *_ = rendered
    validate_crd(jobset, JOBSET_CRD)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    validate_k8s(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "x"},
            "spec": replicated["template"]["spec"],
        }
    )
    broken = copy.deepcopy(jobset)
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "all hosts"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validate_crd(broken, JOBSET_CRD)
    broken = copy.deepcopy(replicated["template"]["spec"])
    broken["template"]["spec"]["nodeSelectors"] = broken["template"]["spec"].pop("nodeSelector")  # a typo
    with pytest.raises(Exception, match="nodeSelectors"):
        validate_k8s({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": broken})


def test_one_indexed_pod_per_host_reachable_by_name_one_slice_per_node_pool(rendered):
    jobset, _, hosts, _ = rendered
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1
    assert job["parallelism"] == job["completions"] == hosts and job["completionMode"] == "Indexed"
    name = jobset["metadata"]["name"]
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": name}
    assert jobset["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool"
    )
    assert jobset["metadata"]["labels"]["batchpilot.dev/run"] == "tiny-tpu"


def test_each_pod_takes_all_chips_of_its_host_on_the_slice_pool_and_no_gpu(rendered):
    jobset, (accelerator, _, pool), _, topology = rendered
    pod = pod_spec(jobset)
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": f"{pool}-{topology}",
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["limits"]["google.com/tpu"] == resources["requests"]["google.com/tpu"] == "4"
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(jobset)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["terminationGracePeriodSeconds"] == 120


def test_each_pod_runs_one_trainer_process_with_pjrt_on_tpu(rendered):
    jobset, _, hosts, _ = rendered
    (container,) = pod_spec(jobset)["containers"]
    command = container["command"][-1]
    assert "torchrun" not in command and "--nproc_per_node" not in command
    assert " && python -m batchpilot train --plan /tmp/batchpilot/plan.json --stage " in command
    env = env_of(container)
    assert env["PJRT_DEVICE"] == "TPU" and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env
    name = jobset["metadata"]["name"]
    names = [f"{name}-batchpilot-0-{k}.{name}" for k in range(hosts)]
    assert env[WORKER_HOSTNAMES_ENV] == ",".join(names)
    assert env["MASTER_ADDR"] == names[0] and env["MASTER_PORT"] == "29500"
    # GKE's webhook injects these into such a Job; the pod spec must not set (and so duplicate) them.
    assert "TPU_WORKER_ID" not in env and "TPU_WORKER_HOSTNAMES" not in env
    assert json.loads(env["BATCHPILOT_PLAN_JSON"])["config"]["cluster"]["accelerator_type"].startswith("tpu-")


def test_the_stages_of_a_launch_run_on_their_slice(tmp_path):
    jobset = render(tmp_path, tpu_config(V6E, **V6E_SIZES), "stage-1")
    command = pod_spec(jobset)["containers"][0]["command"][-1]
    assert "--stage 1 " in command
    assert jobset["metadata"]["labels"]["batchpilot.dev/stage"] == "stage-1"


def test_v5p_pods_are_sized_from_the_machine_type_and_v6e_needs_explicit_sizes(tmp_path):
    v5p = render(tmp_path / "v5p", tpu_config(V5P), "final")
    limits = pod_spec(v5p)["containers"][0]["resources"]["limits"]
    # ct5p-hightpu-4t: 208 vCPUs, 448 GiB; the cluster autoscaler's template of a new node takes the kernel's
    # share off first (7.32 GiB, cluster-autoscaler reserved.go), GKE keeps 0.59 CPU and its kube-reserved and
    # eviction threshold of what is left; the reserve 1 CPU, 2 GiB.
    assert limits["cpu"] == "206000m" and limits["memory"] == "454044M"
    plan = write_plan(tmp_path / "v6e", tpu_config(V6E))
    code, out, err = launch_in_process("--plan", plan, "--stage", "final", "--dryrun")
    assert code == 2 and not out
    assert err.strip() == (
        "batchpilot: error: cluster.cpu_per_node: and cluster.memory_per_node_bytes are needed to size the "
        "trainer pods on ct6e-standard-4t TPU VMs, whose vCPUs and memory batchpilot has no documented figures "
        "for (fix: set both to the node's allocatable less GKE's DaemonSets (`kubectl describe node`, Allocatable))"
    )


def test_tpu_machine_types_carry_their_chips_and_leave_a_trainer_room():
    for name, chips, label in [
        ("ct5lp-hightpu-4t", 4, "tpu-v5-lite-podslice"),
        ("ct5p-hightpu-4t", 4, "tpu-v5p-slice"),
    ]:
        machine = MACHINE_TYPES[name]
        assert (machine.num_gpus, machine.gpu_label) == (chips, label)
        assert gke_allocatable(machine).cpu_millicores > 100_000


def test_a_volcano_launcher_cannot_run_a_tpu_slice(tmp_path):
    plan = write_plan(tmp_path, tpu_config(V5P, launcher="volcano"))
    code, _, err = launch_in_process("--plan", plan, "--stage", "final", "--dryrun")
    assert code == 2
    assert "cluster.launcher: volcano cannot run a multi-host TPU slice" in err


def test_the_gpu_jobset_has_nothing_of_the_tpu_path(tmp_path):
    jobset = gpu_dryrun(tmp_path, "final")
    text = yaml.safe_dump(jobset)
    assert "google.com/tpu" not in text and "exclusive-topology" not in text and "PJRT_DEVICE" not in text
    (container,) = pod_spec(jobset)["containers"]
    assert "torchrun --rdzv_backend c10d" in container["command"][-1]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    marker = "/tmp/batchpilot/out/preempted"
    assert exit_75_when_preempted("torchrun x", marker=marker) == exit_75_when_preempted(
        "torchrun x", marker=marker, program="torchrun"
    )


# --- the pod's command line, run for real with a stand-in trainer -----------------------------------

FAKE_PYTHON = """#!/bin/bash
# Stands in for `python -m batchpilot train ...`: reports the worker variables it got; $OUTCOME says what
# the trainer does (the real one exits 75 itself after checkpointing on SIGTERM).
trap 'touch "$MARKER"; exit 75' TERM
echo "worker=${TPU_WORKER_ID:-unset} hosts=${TPU_WORKER_HOSTNAMES:-unset} stage=$7"
case "$OUTCOME" in
  preempted) touch "$MARKER"; kill -KILL $$ ;;
  fails) exit 3 ;;
  succeeds) exit 0 ;;
  waits) while true; do sleep 0.1; done ;;
esac
"""


def run_pod_command(tmp_path: Path, jobset: dict, outcome: str, **env: str) -> subprocess.Popen:
    """The rendered pod's bash line with its paths moved under tmp_path and `python` a stand-in."""
    (container,) = pod_spec(jobset)["containers"]
    command = container["command"][-1].replace("/tmp/batchpilot", str(tmp_path / "pod"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    pod_env = {k: v for k, v in env_of(container).items() if v is not None}
    full_env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "MARKER": str(tmp_path / "pod" / "out" / "preempted"),
        "OUTCOME": outcome,
        "JOB_COMPLETION_INDEX": "1",
        **pod_env,
        **env,
    }
    (tmp_path / "pod" / "out").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        ["bash", "-c", command], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> dict:
    return render(tmp_path_factory.mktemp("two"), tpu_config(V6E, **V6E_SIZES), "stage-0")


def test_the_pod_writes_the_plan_and_keeps_the_worker_variables_gke_injected(two_hosts, tmp_path):
    proc = run_pod_command(tmp_path, two_hosts, "succeeds", TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES="a,b")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.strip() == "worker=1 hosts=a,b stage=0" and "not injected" not in err
    assert json.loads((tmp_path / "pod" / "plan.json").read_text())["config"]["name"] == "tiny-tpu"


def test_without_gke_s_webhook_the_pod_derives_the_worker_variables_and_says_so(two_hosts, tmp_path):
    proc = run_pod_command(tmp_path, two_hosts, "succeeds")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    name = two_hosts["metadata"]["name"]
    assert out.strip() == f"worker=1 hosts={name}-batchpilot-0-0.{name},{name}-batchpilot-0-1.{name} stage=0"
    assert "TPU_WORKER_ID/TPU_WORKER_HOSTNAMES were not injected by GKE" in err


@pytest.mark.parametrize(("outcome", "code"), [("preempted", 75), ("fails", 3), ("succeeds", 0)])
def test_the_pod_exits_75_only_when_the_trainer_stopped_for_preemption(two_hosts, tmp_path, outcome, code):
    marker = tmp_path / "pod" / "out" / "preempted"
    marker.parent.mkdir(parents=True)
    marker.write_text("a previous run's\n")  # removed before the trainer starts
    proc = run_pod_command(tmp_path, two_hosts, outcome, TPU_WORKER_ID="0", TPU_WORKER_HOSTNAMES="a,b")
    proc.communicate(timeout=30)
    assert proc.returncode == code


def test_sigterm_reaches_the_trainer_and_the_pod_waits_for_its_checkpoint(two_hosts, tmp_path):
    proc = run_pod_command(tmp_path, two_hosts, "waits", TPU_WORKER_ID="0", TPU_WORKER_HOSTNAMES="a,b")
    assert proc.stdout.readline().startswith("worker=0")
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends to PID 1
    assert proc.wait(timeout=30) == 75


# --- the KFP pipeline of a TPU config -----------------------------------------------------------------


def test_the_compiled_tpu_pipeline_requests_no_gpu(tmp_path):
    from batchpilot.kfp.compile import compile_file

    output = tmp_path / "tpu.yaml"
    compile_file(REPO / "configs" / "llama_5b_tpu.yaml", output)
    text = output.read_text()
    assert "tpu-v6e-slice" in text  # the config is in it
    # No task asks for an accelerator (KFP writes `accelerator:` under a task's resources) or a GPU node.
    assert "nvidia.com/gpu" not in text and "accelerator:" not in text and "gke-accelerator" not in text


def test_an_explore_task_is_never_placed_on_a_tpu_pool():
    from batchpilot.kfp.pipeline import _on_accelerator

    class Task:
        def set_accelerator_type(self, name: str) -> None:
            raise AssertionError(f"asked for {name}")

    config = parse_config(tpu_config(V5P))
    with pytest.raises(BatchpilotError, match="explore does not run on TPU yet"):
        _on_accelerator(Task(), config)
