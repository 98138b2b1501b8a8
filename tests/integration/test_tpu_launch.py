"""Issue #14 end to end: `batchpilot plan` then `batchpilot launch` of a TPU config, as real processes for
the dry run, and through the real kubernetes client against the local API server for the submission."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kube_api_server import KubeServer, kube_server_running

from batchpilot.cli import main
from helpers import REPO, run_batchpilot, validate_crd

pytestmark = pytest.mark.slow  # real `batchpilot plan` and `launch` processes

COMPLETED = {"conditions": [{"type": "Completed", "status": "True", "message": "jobset completed"}]}


def write_config(folder: Path) -> Path:
    """The v6e example config (2 -> 4 -> 8 hosts of ct6e-standard-4t) with its pods' sizes set."""
    config = yaml.safe_load((REPO / "configs" / "llama_5b_tpu.yaml").read_text())
    config["cluster"].update({"cpu_per_node": 170, "memory_per_node_bytes": "680GiB"})
    path = folder / "tpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def make_plan(folder: Path) -> Path:
    plan = folder / "plan.json"
    result = run_batchpilot("plan", "--config", str(write_config(folder)), "--out", str(plan))
    assert result.returncode == 0, result.stderr
    assert "stage-0 on 2 node(s) (2x4), stage-1 on 4 (4x4), stages-2-final on 8 (4x8)" in result.stdout
    return plan


def test_launch_dryrun_prints_the_multi_host_tpu_jobset(tmp_path):
    plan = make_plan(tmp_path)
    result = run_batchpilot("launch", "--plan", str(plan), "--stage", "stages-2-final", "--dryrun")
    assert result.returncode == 0, result.stderr
    jobset = yaml.safe_load(result.stdout)  # stdout is the YAML alone
    validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 8 and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": "v6e-4x8",
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x8",
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == "4"
    assert "--stage 2-4 " in container["command"][-1] and "torchrun" not in container["command"][-1]
    assert "nvidia.com/gpu" not in result.stdout
    assert "4 TPU chip(s) each, one per host of slice 4x8" in result.stderr


@pytest.fixture
def kube(tmp_path, monkeypatch) -> Iterator[KubeServer]:
    with kube_server_running() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


def test_launch_submits_the_tpu_jobset_and_follows_every_host(kube, tmp_path, capsys):
    kube.state.jobset_statuses = [COMPLETED]
    kube.state.node_logs = {0: "[host 0] step 1 loss 5.1\n", 3: "[host 3] step 1\n"}
    plan = make_plan(tmp_path)
    assert main(["launch", "--plan", str(plan), "--stage", "stage-1"]) == 0
    (created,) = [body for method, _, _, body in kube.state.requests if method == "POST"]
    assert created["kind"] == "JobSet"
    assert created["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    job = created["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == 4
    assert job["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "v6e-4x4"
    out = capsys.readouterr().out
    assert "4 node(s) x 1 process(es) via jobset" in out
    assert "[host 0] step 1 loss 5.1" in out and "[host 3] step 1" in out
