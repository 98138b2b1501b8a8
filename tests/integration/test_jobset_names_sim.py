"""Issue #20: run names whose JobSets the JobSet webhook refused now launch; the stand-in refuses like it.

The stand-in (`jobset_webhook.py`, run by the Kubernetes API stand-in on every JobSet create) applies the
API server's name check and the JobSet webhook's name rules; the real `kubernetes` client receives its 422.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jobset_webhook
import pytest
import yaml
from kube_api_server import KubeServer, kube_server_running
from torchx.schedulers.ids import make_unique
from torchx.util.strings import normalize_str

from batchpilot.cli import main
from batchpilot.config import parse_config
from batchpilot.plan.planner import make_run_document
from batchpilot.planning.launches import launches

NS = "batchpilot"
COMPLETED = {"terminalState": "Completed", "conditions": [{"type": "Completed", "status": "True"}]}


def gke_config(name: str) -> dict[str, Any]:
    """Three launches: 128 on 1 node, 256 on 2, 512 and 1024 on 4 (micro batch 16, 8 GPUs a node)."""
    return {
        "name": name,
        "data": {"uri": "gs://bucket/data", "seq_len": 128},
        "cluster": {
            "backend": "gke", "devices_per_node": 8, "max_nodes": 4, "project": "p", "location": "l",
            "cluster_name": "c", "node_pool": "h100", "accelerator_type": "nvidia-h100-80gb",
            "image": "registry.example/batchpilot:0.1.0", "cpu_per_node": 200, "memory_per_node_bytes": "1000GB",
        },
        "batch": {"global_batch_size": 1024, "micro_batch_size": 16, "schedule": "0:128 1K:256 2K:512 3K:1024"},
        "train": {"total_samples": 8192, "lr": 3e-4, "checkpoint_uri": "gs://bucket/ckpt"},
    }  # fmt: skip


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeServer]:
    with kube_server_running() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


def write_plan(folder: Path, name: str) -> tuple[str, list[str]]:
    """plan.json of `gke_config(name)` and its launches' names."""
    document = make_run_document(parse_config(gke_config(name)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(document.to_json())
    return str(folder / "plan.json"), [launch.name for launch in launches(document.plan)]


def dryrun(plan: str, stage: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["launch", "--plan", plan, "--stage", stage, "--dryrun"]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)  # type: ignore[no-any-return]


def renamed(jobset: dict[str, Any], name: str) -> dict[str, Any]:
    """The JobSet as today's derivation named it before #20: `<run>-<launch>` + torchx's random suffix."""
    old = copy.deepcopy(jobset)
    old["metadata"]["name"] = old["spec"]["network"]["subdomain"] = name
    return old


@pytest.mark.parametrize("run", ["my-llama-5b-pretraining", "5b-llama", "a" * 40])
def test_every_launch_of_a_long_or_digit_first_run_renders_a_jobset_the_webhook_admits(run, tmp_path, capsys):
    plan, names = write_plan(tmp_path, run)
    assert names == ["stage-0", "stage-1", "stages-2-final"]
    for launch in names:
        jobset = dryrun(plan, launch, capsys)
        assert jobset_webhook.admit_create(jobset) is None, jobset["metadata"]["name"]
        assert jobset["metadata"]["labels"]["batchpilot.dev/run"] == run
        assert jobset["metadata"]["labels"]["batchpilot.dev/stage"] == launch
        assert dryrun(plan, launch, capsys)["metadata"]["name"] == jobset["metadata"]["name"]  # deterministic
        # The derivation before #20 made names the webhook refuses (leading digit, or pods over 63: the
        # random suffix has 11 to 14 characters).
        old = normalize_str(make_unique(f"{run}-{launch}"))
        assert jobset_webhook.admit_create(renamed(jobset, old)) is not None, old


def test_the_stand_in_answers_a_refused_jobset_as_the_api_server_relays_the_webhook(kube, tmp_path, capsys):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    plan, _ = write_plan(tmp_path, "5b-llama")
    jobset = dryrun(plan, "stages-2-final", capsys)
    objects = client.CustomObjectsApi(kube.api_client())
    with pytest.raises(ApiException) as refused:
        objects.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", renamed(jobset, "5b-llama-stages-2-final-x1")
        )
    assert refused.value.status == 422
    status = yaml.safe_load(refused.value.body)
    assert status["reason"] == "Invalid" and status["details"]["kind"] == "JobSet"
    assert status["message"].startswith(
        'admission webhook "vjobset.kb.io" denied the request: JobSet.jobset.x-k8s.io '
        '"5b-llama-stages-2-final-x1" is invalid: [spec.network.subdomain: Invalid value: '
        '"5b-llama-stages-2-final-x1": a DNS-1035 label must consist of lower case alphanumeric characters'
    )
    assert [cause["field"] for cause in status["details"]["causes"]] == [
        "spec.network.subdomain", "spec.replicatedJobs[0].name", "spec.replicatedJobs[0].name",
    ]  # fmt: skip
    long_name = "a" * 40 + "-stages-2-final-" + "1" * 13
    with pytest.raises(ApiException) as too_long:
        objects.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", renamed(jobset, long_name)
        )
    message = yaml.safe_load(too_long.value.body)["message"]
    assert jobset_webhook.SUBDOMAIN_TOO_LONG in message and jobset_webhook.POD_NAME_TOO_LONG in message
    with pytest.raises(ApiException) as bad_name:  # the API server's own check, before any webhook
        objects.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", renamed(jobset, "Ramp")
        )
    assert yaml.safe_load(bad_name.value.body)["message"].startswith(
        'JobSet.jobset.x-k8s.io "Ramp" is invalid: metadata.name: Invalid value: "Ramp": a lowercase RFC 1123'
    )
    assert not kube.state.jobsets


def test_a_digit_first_run_launches_through_the_api_and_a_retry_replaces_its_jobset(kube, tmp_path, capsys):
    """The real client creates the JobSet (the webhook admits it); a second launch of the same launch finds
    the first by its labels, deletes it and creates one of the same, deterministic name."""
    kube.state.jobset_statuses = [COMPLETED]
    plan, _ = write_plan(tmp_path, "5b-llama")
    for _ in range(2):
        assert main(["launch", "--plan", plan, "--stage", "stage-0"]) == 0, capsys.readouterr().err
    requests = [(method, path, body) for method, path, _, body in kube.state.requests if "/jobsets" in path]
    created = [body["metadata"]["name"] for method, _, body in requests if method == "POST"]
    deleted = [path.rsplit("/", 1)[-1] for method, path, _ in requests if method == "DELETE"]
    assert len(created) == 2 and created[0] == created[1] and created[0].startswith("bp-5b-llama-stage-0-")
    assert deleted[:1] == created[:1]
    assert list(kube.state.jobsets) == created[:1]
