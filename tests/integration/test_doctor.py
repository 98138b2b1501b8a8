"""`batchpilot doctor` against the stand-ins: a simulated GKE cluster (Container API, Compute regions.get and
the Kubernetes API), fake-gcs-server, and the KFP API stand-in. One cluster that is right, then one thing
wrong at a time: each must give exactly one FAILED line, naming its check and the fix, and exit 1."""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gcs_server import GCSServer
from gke_sim import SimulatedGke, simulated_gke
from kfp_api_server import kfp_server_running
from kube_api_server import published_crds

from batchpilot.cli import main
from batchpilot.cluster.crds import JOBSET_CRD
from batchpilot.storage import open_storage
from helpers import REPO, run_batchpilot

POOL = "h100"
TEXT = "The quick brown fox jumps over the lazy dog, and the doctor checks the cluster.\n" * 200


def gke_config(*, endpoint: str, bucket: str, **cluster: Any) -> dict[str, Any]:
    """A small GPT on 2 a3-highgpu-8g nodes at most (the plan's largest launch: 2 x 8 = 16 GPUs)."""
    return {
        "name": "doctor-test",
        "model": {"factory": "batchpilot.models.gpt:build",
                  "args": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128, "vocab_size": 257}},
        "data": {"uri": f"gs://{bucket}/data", "seq_len": 128},
        "cluster": {"backend": "gke", "devices_per_node": 8, "max_nodes": 2, "project": "proj",
                    "location": "us-central1", "cluster_name": "train", "node_pool": POOL,
                    "accelerator_type": "nvidia-h100-80gb", "machine_type": "a3-highgpu-8g",
                    "image": "registry.example/batchpilot:0.1.0", "container_api_endpoint": endpoint, **cluster},
        "batch": {"global_batch_size": 128, "micro_batch_size": 4, "rampup": [64, 64, 2048]},
        "train": {"total_samples": 8192, "lr": 3.0e-4, "checkpoint_uri": f"gs://{bucket}/ckpt"},
    }  # fmt: skip


def write_texts(folder: Path) -> Path:
    """Twenty small documents (data prepare holds some out for validation)."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(20):
        (folder / f"doc{index:02d}.txt").write_text(f"document {index}: {TEXT}")
    return folder


@pytest.fixture(scope="module")
def bucket(gcs_server: GCSServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bucket holding a small prepared shard set under data/ (byte tokenizer, vocabulary 257)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    texts = write_texts(tmp_path_factory.mktemp("texts"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
        env.setenv("GOOGLE_CLOUD_PROJECT", "proj")
        storage.Client(project="proj", credentials=AnonymousCredentials()).create_bucket("doctor")
        assert main(["data", "prepare", str(texts), "--out", "gs://doctor/data", "--no-progress"]) == 0
    yield "doctor"


@pytest.fixture
def gke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gcs_server: GCSServer, bucket: str
) -> Iterator[SimulatedGke]:
    """The cluster the config describes: pool h100 with one a3-highgpu-8g node whose driver GKE installs,
    quota for 64 H100s, JobSet installed, every permission granted; KUBECONFIG and GCS point at the stand-ins."""
    with simulated_gke() as cluster:
        cluster.add_pool(POOL, machine_type="a3-highgpu-8g", zones=["us-central1-a"], per_zone=1)
        accelerator = pool_of(cluster)["config"]["accelerators"][0]
        accelerator["gpuDriverInstallationConfig"] = {"gpuDriverVersion": "DEFAULT"}
        cluster.container.state.accelerator_quota = {"nvidia-h100-80gb": 64}
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj")
        monkeypatch.delenv("KFP_TOKEN", raising=False)
        cluster.kube.state.configmaps[ARGO_CONFIGMAP] = argo_configmap(ARGO_ALWAYS)
        yield cluster


ARGO_CONFIGMAP = ("kubeflow", "workflow-controller-configmap")
ARGO_ALWAYS = "spec:\n  templateDefaults:\n    retryStrategy:\n      retryPolicy: Always\n"
KFP_2_17_DEFAULTS = (
    "spec:\n  ttlStrategy:\n    secondsAfterCompletion: 3600\n  templateDefaults:\n    retryStrategy:\n"
    "      limit: '2'\n      retryPolicy: OnError\n"
)
"""What KFP 2.17.0's manifests put in Argo's ConfigMap (kubeflow/pipelines #13485,
manifests/kustomize/third-party/argo/base/workflow-controller-configmap-patch.yaml)."""


def argo_configmap(workflow_defaults: str | None) -> dict[str, Any]:
    data = {"workflowDefaults": workflow_defaults} if workflow_defaults is not None else {}
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
            "metadata": {"name": ARGO_CONFIGMAP[1], "namespace": ARGO_CONFIGMAP[0]}}  # fmt: skip


def pool_of(cluster: SimulatedGke, name: str = POOL) -> dict[str, Any]:
    return cluster.container.state.pools[cluster.pool_path(name)]


def doctor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], *args: str
) -> tuple[int, list[str]]:
    """Runs `batchpilot doctor` in this process; (exit code, the printed lines)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["doctor", "--config", str(path), *args])
    return code, capsys.readouterr().out.splitlines()


def failed(lines: list[str]) -> list[str]:
    return [line for line in lines if ": FAILED: " in line]


def status_of(lines: list[str]) -> dict[str, str]:
    """check name -> passed / FAILED / skipped, for every check line."""
    return dict(line.split(": ")[:2] for line in lines if not line.startswith("doctor: "))


def test_a_cluster_that_is_right_passes_every_check(gke, tmp_path, capsys):
    with kfp_server_running() as kfp:
        kfp.state.tag_name = "2.14.0"
        code, lines = doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"),
                             "--host", kfp.endpoint)  # fmt: skip
    assert code == 0, lines
    checks = ["plan", "credentials", "node pool", "kubernetes", "quota", "rbac", "jobset crd", "gpu driver",
              "gpu nodes", "data", "checkpoint", "kfp", "argo retries"]  # fmt: skip
    assert status_of(lines) == dict.fromkeys(checks, "passed")
    assert lines[-1] == "doctor: 13 passed, 0 FAILED, 0 skipped"
    text = "\n".join(lines)
    assert "plan: passed: largest launch stages-0-final: 2 node(s) x 8 device(s) = 16 (micro batch 4)" in text
    assert "node pool: passed: h100: a3-highgpu-8g, 8 x nvidia-h100-80gb" in text
    # 8 H100s in use are the pool's own node, which the resize keeps: 64 for the launch, not 56.
    assert (
        "quota: passed: NVIDIA_H100_GPUS in us-central1: limit 64, 8 in use (8 of them the pool's), 64 for the "
        "launch; the largest launch needs 16"
    ) in text
    assert "gpu driver: passed: GKE installs the driver on h100's nodes (gpu_driver_version DEFAULT)" in text
    assert "gpu nodes: passed: 1 node(s) of h100, each with 8 nvidia.com/gpu" in text
    assert f"kfp: passed: {kfp.endpoint} answers; backend 2.14.0 (2.14.0 or later)" in text
    # One review per permission a run uses, as the real client sends them.
    reviews = [
        body for method, path, _, body in gke.kube.state.requests if path.endswith("selfsubjectaccessreviews")
    ]
    assert {
        "verb": "create",
        "group": "jobset.x-k8s.io",
        "resource": "jobsets",
        "namespace": "batchpilot",
    } in [review["spec"]["resourceAttributes"] for review in reviews]
    # The task's own pod lives where KFP runs it: its budget is asked for in that namespace.
    assert {
        "verb": "create",
        "group": "policy",
        "resource": "poddisruptionbudgets",
        "namespace": "kubeflow",
    } in [review["spec"]["resourceAttributes"] for review in reviews]
    assert len(reviews) == 18
    assert open_storage("gs://doctor/ckpt").list() == []  # the checkpoint probe cleaned up after itself


def one_failure(code: int, lines: list[str]) -> str:
    """The single FAILED line of a run that exited 1."""
    assert code == 1, lines
    assert len(failed(lines)) == 1, lines
    return failed(lines)[0]


def test_a_pool_of_another_machine_type(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", node_pool="a100")
    gke.add_pool("a100", machine_type="a2-ultragpu-8g", zones=["us-central1-a"])
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "node pool: FAILED: node pool a100 has machine type a2-ultragpu-8g, cluster.machine_type says a3-highgpu-8g "
        "(fix: set cluster.machine_type: a2-ultragpu-8g, or use a pool of a3-highgpu-8g)"
    )


def test_a_missing_node_pool(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", node_pool="h200")
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "node pool: FAILED: cluster train has no node pool 'h200' (its pools: h100) (fix: create it "
        "(docs/cluster.md), or set cluster.node_pool to one of its pools)"
    )


def test_a_quota_too_small_for_the_largest_launch(gke, tmp_path, capsys):
    gke.container.state.accelerator_quota = {"nvidia-h100-80gb": 16}
    gke.container.state.region_usage = {"nvidia-h100-80gb": 8}  # another pool's H100s
    line = one_failure(
        *doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"))
    )
    assert line == (
        "quota: FAILED: NVIDIA_H100_GPUS in us-central1: limit 16, 16 in use (8 of them the pool's), 8 for the "
        "launch; the largest launch needs 16 (2 node(s) x 8 device(s) = 16) (fix: request a NVIDIA_H100_GPUS "
        "quota of at least 24 in us-central1, free GPUs elsewhere, or lower cluster.max_nodes)"
    )


def test_flex_start_is_checked_against_the_preemptible_quota(gke, tmp_path, capsys):
    """Flex-start VMs count against PREEMPTIBLE_ quotas (GKE "About flex-start provisioning mode"): a project
    with H100s on demand but none preemptible cannot run a flex-start launch."""
    gke.add_pool("flex", machine_type="a3-highgpu-8g", zones=["us-central1-a"], queued_provisioning=True,
                 autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2})  # fmt: skip
    pool_of(gke, "flex")["config"]["accelerators"][0]["gpuDriverInstallationConfig"] = {
        "gpuDriverVersion": "DEFAULT"
    }
    gke.container.state.preemptible_quota = {"nvidia-h100-80gb": 8}
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", provisioning="flex-start",
                        pool_mode="autoscale", node_pool="flex")  # fmt: skip
    config["explore"] = {
        "study": False
    }  # a flex-start pool has no node for explore (config check refuses it)
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "quota: FAILED: PREEMPTIBLE_NVIDIA_H100_GPUS in us-central1: limit 8, 0 in use (0 of them the pool's), 8 "
        "for the launch; the largest launch needs 16 (2 node(s) x 8 device(s) = 16) (fix: request a "
        "PREEMPTIBLE_NVIDIA_H100_GPUS quota of at least 16 in us-central1, free GPUs elsewhere, or lower "
        "cluster.max_nodes)"
    ), line


def test_rbac_that_denies_creating_jobsets(gke, tmp_path, capsys):
    gke.kube.state.denied = {("create", "jobsets.jobset.x-k8s.io")}
    line = one_failure(
        *doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"))
    )
    assert line.startswith(
        "rbac: FAILED: the caller may not create jobsets.jobset.x-k8s.io in batchpilot (fix: "
    )
    assert "the chart's Role in batchpilot and its ClusterRole do" in line


def test_flex_start_needs_provisioning_requests_and_pod_templates(gke, tmp_path, capsys):
    gke.kube.state.denied = {("create", "provisioningrequests.autoscaling.x-k8s.io")}
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    code, lines = doctor(tmp_path, capsys, config)
    assert code == 0 and not failed(lines)  # resize provisioning makes no request
    config["cluster"]["provisioning"] = "flex-start"
    config["explore"] = {"study": False}  # no explore task: its pool would have no node for it
    pool_of(gke)["queuedProvisioning"] = {"enabled": True}
    pool_of(gke)["autoscaling"] = {"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 8}
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line.startswith(
        "rbac: FAILED: the caller may not create provisioningrequests.autoscaling.x-k8s.io in batchpilot"
    )


def test_flex_start_needs_a_pool_with_queued_provisioning_and_resize_one_without(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    config["cluster"]["provisioning"] = "flex-start"
    config["explore"] = {"study": False}  # no explore task: its pool would have no node for it
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line.startswith(
        f"node pool: FAILED: cluster.provisioning is flex-start, but node pool {POOL} has no queued"
    )
    assert "--enable-queued-provisioning" in line
    pool_of(gke)["queuedProvisioning"] = {"enabled": True}
    pool_of(gke)["autoscaling"] = {"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 8}
    code, lines = doctor(tmp_path, capsys, config)
    assert code == 0 and not failed(lines), lines
    config["cluster"]["provisioning"] = "resize"
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert "has queued provisioning: its nodes come only for ProvisioningRequests" in line
    assert line.endswith("(fix: set cluster.provisioning: flex-start)")


def without_failure_policy_rules(crd: dict[str, Any]) -> dict[str, Any]:
    """The published JobSet CRD as a controller before v0.6.0 served it."""
    old = copy.deepcopy(crd)
    for version in old["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["failurePolicy"][
            "properties"
        ]["rules"]
    return old


@pytest.mark.parametrize("installed", ["none", "v0.5"])
def test_a_missing_or_too_old_jobset(gke, tmp_path, capsys, installed):
    crd = published_crds()[JOBSET_CRD]
    gke.kube.state.crds = {} if installed == "none" else {JOBSET_CRD: without_failure_policy_rules(crd)}
    line = one_failure(
        *doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"))
    )
    problem = (
        "JobSet is not installed in the cluster (no CRD jobsets.jobset.x-k8s.io)"
        if installed == "none"
        else "the cluster's JobSet is older than v0.6.0"
    )
    assert line.startswith(f"jobset crd: FAILED: cluster.launcher: {problem}")
    assert "(fix: install or upgrade JobSet (v0.6.0 or later)" in line


def test_a_pool_without_driver_installation_needs_the_driver_daemonset(gke, tmp_path, capsys):
    accelerator = pool_of(gke)["config"]["accelerators"][0]
    accelerator["gpuDriverInstallationConfig"] = {"gpuDriverVersion": "INSTALLATION_DISABLED"}
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line.startswith(
        "gpu driver: FAILED: node pool h100 has gpu_driver_version INSTALLATION_DISABLED (GKE installs no driver) "
        "and no DaemonSet kube-system/nvidia-driver-installer runs (fix: kubectl apply -f "
    )
    # DaemonSetStatus's required fields (apps/v1), as the API server always serves them.
    status = {
        "currentNumberScheduled": 1,
        "desiredNumberScheduled": 1,
        "numberMisscheduled": 0,
        "numberReady": 1,
    }
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "status": status,
                 "metadata": {"name": "nvidia-driver-installer", "namespace": "kube-system"}}  # fmt: skip
    gke.kube.state.daemonsets[("kube-system", "nvidia-driver-installer")] = daemonset
    code, lines = doctor(tmp_path, capsys, config)
    assert code == 0, lines
    assert (
        "gpu driver: passed: gpu_driver_version INSTALLATION_DISABLED: DaemonSet kube-system/nvidia-driver-installer "
        "installs it (1 of 1 pod(s) ready)"
    ) in lines


def test_an_unreadable_data_manifest(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    config["data"]["uri"] = "gs://doctor/nothing-here"
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "data: FAILED: data.uri: gs://doctor/nothing-here/manifest.json: does not exist, so there is no shard set "
        "here (fix: run: batchpilot data prepare ... --out gs://doctor/nothing-here)"
    )


def test_a_vocabulary_larger_than_the_model_embeds(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    config["model"]["args"]["vocab_size"] = 200
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "data: FAILED: the model embeds 200 token ids but gs://doctor/data's vocabulary has 257 "
        "(fix: set model.args.vocab_size to at least 257)"
    )


def test_a_checkpoint_prefix_that_cannot_be_written(gke, tmp_path, capsys):
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
    config["train"]["checkpoint_uri"] = "gs://no-such-bucket/ckpt"
    line = one_failure(*doctor(tmp_path, capsys, config))
    assert line == (
        "checkpoint: FAILED: train.checkpoint_uri: gs://no-such-bucket: does not exist "
        "(fix: create the bucket or fix the URI)"
    )


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_kfp_host(gke, tmp_path, capsys):
    host = f"http://127.0.0.1:{closed_port()}"
    code, lines = doctor(
        tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"), "--host", host
    )
    line = one_failure(code, lines)
    assert line.startswith(
        f"kfp: FAILED: --host: cannot reach {host} to check the API (GET /apis/v2beta1/healthz): "
    )
    assert line.endswith("(fix: check the URL and that the KFP API server (or its port-forward) is up)")


@pytest.mark.parametrize("tag", ["2.3.0", "2.13.1"])  # before execution-level retries; before nested ones
def test_a_kfp_backend_older_than_2_14_0(gke, tmp_path, capsys, tag):
    with kfp_server_running() as kfp:
        kfp.state.tag_name = tag
        config = gke_config(endpoint=gke.container.endpoint, bucket="doctor")
        line = one_failure(*doctor(tmp_path, capsys, config, "--host", kfp.endpoint))
    assert line == (
        f"kfp: FAILED: {kfp.endpoint} runs KFP {tag}, older than 2.14.0: its Argo compiler drops the retry policy of "
        "a task inside a nested pipeline, so a failed resize or stage (each launch's group) would never be retried "
        '(fix: upgrade the KFP backend to 2.14.0 or later (docs/cluster.md, "KFP version"))'
    )


# --- the stand-ins' own rules ---------------------------------------------------------------------------


def test_the_kubernetes_stand_in_refuses_a_review_without_attributes(gke):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.AuthorizationV1Api(gke.kube.api_client())
    with pytest.raises(ApiException) as caught:
        api.create_self_subject_access_review(
            client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec())
        )
    assert caught.value.status == 422
    assert "exactly one of nonResourceAttributes or resourceAttributes" in caught.value.body


def test_regions_get_counts_every_pool_of_the_accelerator(gke):
    import requests

    gke.add_pool("more", machine_type="a3-highgpu-8g", zones=["us-central1-a", "us-central1-b"], per_zone=2)
    gke.add_pool("cpu", machine_type="n1-standard-8", zones=["us-central1-a"], per_zone=3)
    region = requests.get(
        f"{gke.container.endpoint}/compute/v1/projects/proj/regions/us-central1", timeout=5
    ).json()
    assert region["quotas"] == [
        {"metric": "NVIDIA_H100_GPUS", "limit": 64.0, "usage": 40.0}
    ]  # (1 + 2 x 2) x 8


# --- real processes -------------------------------------------------------------------------------------


def no_credentials_env(home: Path) -> dict[str, str]:
    """A machine with no Google or Kubernetes credentials and no metadata server (a closed loopback port:
    google-auth's GCE probe is refused at once instead of waiting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "CLOUDSDK_", "KUBE", "GCE_"))}
    env.pop("STORAGE_EMULATOR_HOST", None)
    metadata = f"127.0.0.1:{closed_port()}"
    return {**env, "HOME": str(home), "CLOUDSDK_CONFIG": str(home / "gcloud"), "GCE_METADATA_HOST": metadata,
            "GCE_METADATA_IP": metadata}  # fmt: skip


@pytest.mark.slow
def test_no_credentials_is_one_line_per_failed_check_and_quick(tmp_path):
    started = time.monotonic()
    result = run_batchpilot("doctor", "--config", str(REPO / "configs" / "nemo_gpt3_5b.yaml"),
                            env=no_credentials_env(tmp_path), timeout=60)  # fmt: skip
    elapsed_s = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert elapsed_s < 30, output
    assert "Traceback" not in output
    lines = result.stdout.splitlines()
    assert [line.split(": FAILED: ")[0] for line in failed(lines)] == ["credentials", "kubernetes"]
    assert all("(fix: " in line for line in failed(lines))
    skipped = {name for name, status in status_of(lines).items() if status == "skipped"}
    assert {"node pool", "quota", "data", "checkpoint"} <= skipped
    assert "node pool: skipped: no credentials" in lines
    assert "data: skipped: no credentials" in lines


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the demo's largest launch is 2 local processes")
def test_the_demo_passes_once_its_data_is_prepared(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["data"]["uri"] = f"file://{tmp_path}/data"
    config["train"]["checkpoint_uri"] = f"file://{tmp_path}/ckpt"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    before = run_batchpilot("doctor", "--config", str(path), cwd=tmp_path)
    assert before.returncode == 1
    assert failed(before.stdout.splitlines())[0].startswith("data: FAILED: data.uri: ")
    texts = write_texts(tmp_path / "texts")
    prepared = run_batchpilot(
        "data", "prepare", str(texts), "--out", config["data"]["uri"], "--no-progress", cwd=tmp_path
    )
    assert prepared.returncode == 0, prepared.stderr
    result = run_batchpilot("doctor", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert status_of(lines) == {"plan": "passed", "cloud": "skipped", "cpus": "passed", "data": "passed",
                                "checkpoint": "passed", "kfp": "skipped"}  # fmt: skip
    assert lines[1] == (
        "cloud: skipped: backend local: credentials, Container API, quota, Kubernetes and GPU checks do not apply"
    )
    assert "Traceback" not in result.stdout + result.stderr
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe object is gone again


def test_an_unexpected_error_is_one_failed_line_and_a_hung_check_is_cut_off(monkeypatch):
    from batchpilot.doctor import core

    context = core.Context(config=None)  # type: ignore[arg-type]
    check = core.bounded("gpu nodes", lambda context: 1 / 0, context)
    assert check.line() == (
        "gpu nodes: FAILED: unexpected ZeroDivisionError: division by zero "
        "(fix: report it as a batchpilot bug, with this line)"
    )
    monkeypatch.setattr(core, "CHECK_TIMEOUT_S", 0.2)
    started = time.monotonic()
    check = core.bounded("kubernetes", lambda context: time.sleep(5), context)  # type: ignore[arg-type,return-value]
    assert time.monotonic() - started < 2
    assert check.line() == (
        "kubernetes: FAILED: did not finish within 0.2s (fix: check that its endpoint is reachable)"
    )


def test_an_unreachable_container_api_fails_its_checks_in_seconds(gke, tmp_path, capsys):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    code, lines = doctor(tmp_path, capsys, gke_config(endpoint=endpoint, bucket="doctor"))
    assert time.monotonic() - started < 15
    assert code == 1
    assert [line.split(": FAILED: ")[0] for line in failed(lines)] == ["node pool", "quota"]
    assert failed(lines)[0].startswith(
        "node pool: FAILED: cluster.container_api_endpoint: cannot list the node pools of "
        "projects/proj/locations/us-central1/clusters/train: "
    )
    assert failed(lines)[0].endswith(
        "(fix: check that the Container API (or cluster.container_api_endpoint) is reachable from here)"
    )
    assert "gpu driver: skipped: the node pool was not read" in lines


ARGO_FIX = (
    "(fix: set retryPolicy: Always under workflowDefaults.spec.templateDefaults.retryStrategy in ConfigMap "
    'kubeflow/workflow-controller-configmap, then restart the workflow controller (docs/cluster.md, "Argo retries"))'
)


@pytest.mark.parametrize(
    ("configmap", "expected"),
    [
        (
            None,
            "argo retries: FAILED: retryPolicy OnFailure (Argo's default (no workflow-controller-configmap)): a "
            "task whose pod is deleted before it ends (a node drain or upgrade, a Spot reclaim) is not retried, so "
            "the run fails and its exit handler stops the stage's trainers",
        ),
        (
            "spec:\n  ttlStrategy:\n    secondsAfterCompletion: 3600\n",
            "argo retries: FAILED: retryPolicy OnFailure (Argo's default (no retryPolicy in workflowDefaults's "
            "templateDefaults)): a task whose pod is deleted",
        ),
        (
            KFP_2_17_DEFAULTS,
            "argo retries: FAILED: retryPolicy OnError (workflowDefaults.spec.templateDefaults.retryStrategy.retryPolicy): "
            "a task that fails on its own is not retried (exit 75 after an eviction, a resize GKE refused for a moment, "
            "a launch that found no capacity), so batchpilot's retries of the resize and train tasks never run",
        ),
        (
            "spec:\n  templateDefaults:\n    retryStrategy:\n      retryPolicy: Sometimes\n",
            "argo retries: FAILED: ConfigMap kubeflow/workflow-controller-configmap: "
            "workflowDefaults.spec.templateDefaults.retryStrategy.retryPolicy is 'Sometimes', which Argo refuses (valid: "
            "Always, OnFailure, OnError, OnTransientError)",
        ),
    ],
    ids=["no-configmap", "no-retry-policy", "kfp-2.17-defaults", "unknown-policy"],
)
def test_argo_retry_defaults_that_leave_a_case_unretried(gke, tmp_path, capsys, configmap, expected):
    """Which failed attempts Argo retries follows from its ConfigMap's templateDefaults (argo-workflows operator.go
    processNodeRetries, RetryPolicyActual; KFP sets no retryPolicy of its own)."""
    if configmap is None:
        del gke.kube.state.configmaps[ARGO_CONFIGMAP]
    else:
        gke.kube.state.configmaps[ARGO_CONFIGMAP] = argo_configmap(configmap)
    line = one_failure(
        *doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"))
    )
    assert line.startswith(expected) and line.endswith(ARGO_FIX), line


def test_argo_retries_are_skipped_when_the_caller_may_not_read_the_configmap(gke, tmp_path, capsys):
    gke.kube.state.denied.add(("get", "configmaps"))
    code, lines = doctor(tmp_path, capsys, gke_config(endpoint=gke.container.endpoint, bucket="doctor"))
    assert code == 0, lines
    assert (
        "argo retries: skipped: the caller may not read ConfigMap kubeflow/workflow-controller-configmap (HTTP 403)"
    ) in lines


def with_kueue(cluster: SimulatedGke, *, gpus: str = "16", accelerator: str = "nvidia-h100-80gb") -> None:
    """Kueue on the simulated cluster: LocalQueue team-a in batchpilot, ClusterQueue team with `gpus` GPUs of
    quota in flavor h100 (for `accelerator` nodes)."""
    from kueue_controller import KueueController

    kueue = KueueController()
    kueue.add_flavor("h100", node_labels={"cloud.google.com/gke-accelerator": accelerator})
    kueue.add_cluster_queue(
        "team", quota={"h100": {"cpu": "1000", "memory": "10000Gi", "nvidia.com/gpu": gpus}}
    )
    kueue.add_local_queue("batchpilot", "team-a", cluster_queue="team")
    cluster.sim.kueue = kueue


def test_a_kueue_queue_that_can_hold_the_largest_launch_passes(gke, tmp_path, capsys):
    with_kueue(gke)
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", kueue_queue="team-a")
    _, lines = doctor(tmp_path, capsys, config)
    assert status_of(lines)["kueue"] == "passed", lines
    assert "kueue: passed: LocalQueue team-a in batchpilot can hold the largest launch (2 node(s))" in lines
    assert status_of(lines)["rbac"] == "passed"  # the reads of the queue and the Workloads are reviewed too
    reviews = [b["spec"]["resourceAttributes"] for _, path, _, b in gke.kube.state.requests
               if path.endswith("selfsubjectaccessreviews")]  # fmt: skip
    assert {"verb": "get", "group": "kueue.x-k8s.io", "resource": "clusterqueues"} in reviews


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ({"gpus": "8"}, "kueue: FAILED: cluster.kueue_queue: a launch on 2 node(s) asks LocalQueue team-a for "
                        "nvidia.com/gpu 16; ClusterQueue team can never hold it: flavor h100: nvidia.com/gpu 16 > 8"),
        ({"accelerator": "nvidia-a100-80gb"}, "kueue: FAILED: cluster.kueue_queue: a launch on 2 node(s) asks "
         "LocalQueue team-a for nvidia.com/gpu 16; ClusterQueue team can never hold it: flavor h100 is for "
         "nvidia-a100-80gb nodes"),
        (None, "kueue: FAILED: cluster.kueue_queue: no LocalQueue team-a in namespace batchpilot (or Kueue v0.15 "
               "or later is not installed)"),
    ],
)  # fmt: skip
def test_a_kueue_queue_that_cannot_hold_the_largest_launch_is_named(gke, tmp_path, capsys, setup, expected):
    if setup is not None:
        with_kueue(gke, **setup)
    else:
        with_kueue(gke)
        gke.sim.kueue.objects["localqueues"].clear()
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", kueue_queue="team-a")
    code, lines = doctor(tmp_path, capsys, config)
    found = [line for line in failed(lines) if line.startswith("kueue: ")]
    assert code == 1 and found and found[0].startswith(expected), lines


def test_a_trainjob_config_checks_its_training_runtime(gke, tmp_path, capsys):
    """`cluster.launcher: trainjob`: doctor names a missing ClusterTrainingRuntime, passes the one the config's
    launches need, and reviews the TrainJob permissions."""
    from trainer_controller import TrainerController

    from batchpilot.cluster.launch import trainjob_runtime
    from batchpilot.config import ClusterConfig

    gke.sim.trainer = TrainerController()
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", launcher="trainjob")
    _, lines = doctor(tmp_path, capsys, config)
    found = [line for line in failed(lines) if line.startswith("training runtime: ")]
    assert found and found[0].startswith(
        "training runtime: FAILED: cluster.training_runtime: ClusterTrainingRuntime 'batchpilot' does not exist"
    ), lines
    gke.sim.trainer.add_runtime(trainjob_runtime(ClusterConfig.model_validate(config["cluster"])))
    _, lines = doctor(tmp_path, capsys, config)
    assert "training runtime: passed: ClusterTrainingRuntime batchpilot holds what the launches need" in lines
    assert status_of(lines)["rbac"] == "passed"
    reviews = [b["spec"]["resourceAttributes"] for _, path, _, b in gke.kube.state.requests
               if path.endswith("selfsubjectaccessreviews")]  # fmt: skip
    assert {"verb": "create", "group": "trainer.kubeflow.org", "resource": "trainjobs",
            "namespace": "batchpilot"} in reviews  # fmt: skip


def kueue_configmap(frameworks: list[str]) -> dict[str, Any]:
    """Kueue's configuration ConfigMap as its release manifests install it (see doctor/kube.py KUEUE_CONFIGMAP)."""
    config = {"apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
              "integrations": {"frameworks": frameworks}}  # fmt: skip
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "kueue-manager-config", "namespace": "kueue-system"},
            "data": {"controller_manager_config.yaml": yaml.safe_dump(config)}}  # fmt: skip


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("right", "kueue explore: passed: the explore task's pod goes through LocalQueue team-a in kubeflow"),
        ("no queue in kfp's namespace", "kueue explore: FAILED: the explore task's pod runs in KFP's namespace "
                                        "kubeflow, which has no LocalQueue team-a"),
        ("no pod integration", "kueue explore: FAILED: Kueue's pod integration is off (kueue-system/kueue-manager-"
                               "config lists batch/job, jobset.x-k8s.io/jobset)"),
        ("configmap denied", "kueue explore: skipped: LocalQueue team-a in kubeflow is there, but Kueue's "
                             "configuration ConfigMap kueue-system/kueue-manager-config could not be read (HTTP 403)"),
    ],
)  # fmt: skip
def test_the_explore_task_goes_through_the_queue_only_where_kueue_can_hold_its_pod(
    gke, tmp_path, capsys, setup, expected
):
    """#37: explore is a KFP task pod in KFP's namespace; Kueue holds it in the queue only when its pod
    integration is on and that namespace has the LocalQueue as well."""
    with_kueue(gke)
    if setup != "no queue in kfp's namespace":
        gke.sim.kueue.add_local_queue("kubeflow", "team-a", cluster_queue="team")
    frameworks = ["batch/job", "jobset.x-k8s.io/jobset"] + (["pod"] if setup != "no pod integration" else [])
    gke.kube.state.configmaps[("kueue-system", "kueue-manager-config")] = kueue_configmap(frameworks)
    if setup == "configmap denied":
        gke.kube.state.denied.add(("get", "configmaps"))
    config = gke_config(endpoint=gke.container.endpoint, bucket="doctor", kueue_queue="team-a")
    _, lines = doctor(tmp_path, capsys, config)
    found = [line for line in lines if line.startswith("kueue explore: ")]
    assert found and found[0].startswith(expected), lines
