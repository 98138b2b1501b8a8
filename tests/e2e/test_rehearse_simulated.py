"""`batchpilot rehearse` end to end on the simulated cluster: the real command (a process) submits the
rehearsal's pipeline to the KFP API stand-in, whose backend (kfp_backend_sim.py) runs it as KFP on Argo
would, task pods and retries included; the trainers are the simulator's pods, real `torchrun ... batchpilot
train` processes; data and checkpoints live in the GCS emulator.

The rehearsal deletes a trainer pod mid-stage and the train task's pod, and terminates the run; every line
it prints must pass. Under Argo's default retry policy (OnFailure) the deleted train task is not retried, and
the rehearsal must say so in its line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gcs_server import GCSServer, gcs_server_running
from gke_sim import SimulatedGke, simulated_gke
from kfp_api_server import KfpServer, kfp_server_running
from kfp_backend_sim import SimKfpBackend, TaskProcessKubelet

pytestmark = pytest.mark.slow
PROJECT_ID = "batchpilot-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    with gcs_server_running(log_path=tmp_path_factory.mktemp("fake-gcs-server") / "server.log") as server:
        yield server


def user_config(*, endpoint: str, bucket: str, gcs: GCSServer, **cluster: object) -> dict:
    """The user's own config: a big GPU pool it trains on (the rehearsal uses another, cheap one)."""
    return {
        "name": "gpt-big",
        "model": {"args": {"n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 2048, "vocab_size": 50304}},
        "data": {"uri": f"gs://{bucket}/tokens", "seq_len": 2048},
        "cluster": {
            "backend": "gke", "project": "proj", "location": "us-central1", "cluster_name": "train",
            "node_pool": "h100", "machine_type": "a3-highgpu-8g", "accelerator_type": "nvidia-h100-80gb",
            "devices_per_node": 8, "max_nodes": 16, "image": "registry.example/batchpilot:0.1.0",
            "namespace": "batchpilot",
            "container_api_endpoint": endpoint,
            "env": {"STORAGE_EMULATOR_HOST": gcs.endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT_ID}, **cluster,
        },
        "batch": {"global_batch_size": 1024, "micro_batch_size": 4},
        "train": {"total_samples": 10_000_000, "lr": 3.0e-4, "checkpoint_uri": f"gs://{bucket}/ckpt"},
        "explore": {"study": False},
    }  # fmt: skip


def rehearse(
    tmp_path: Path,
    gke: SimulatedGke,
    kfp: KfpServer,
    gcs: GCSServer,
    bucket: str,
    pool: str = "cheap",
    **cluster: object,
) -> tuple[int, str]:
    config = tmp_path / "config.yaml"
    written = user_config(endpoint=gke.container.endpoint, bucket=bucket, gcs=gcs, **cluster)
    config.write_text(yaml.safe_dump(written))
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig")),
           "STORAGE_EMULATOR_HOST": gcs.endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT_ID}  # fmt: skip
    env.pop("KUBERNETES_SERVICE_HOST", None)
    done = subprocess.run(
        [sys.executable, "-m", "batchpilot", "rehearse", "--config", str(config), "--pool", pool,
         "--host", kfp.endpoint, "--pace-s", "0.25", "--step-timeout-s", "180"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def cluster(tmp_path: Path, gcs: GCSServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT_ID)
    bucket = f"rehearse-{uuid.uuid4().hex[:8]}"
    storage.Client(project=PROJECT_ID, credentials=AnonymousCredentials()).create_bucket(bucket)
    with simulated_gke(run_pods_in=tmp_path / "pods", ready_delay_s=0.2) as gke, kfp_server_running() as kfp:
        gke.add_pool("default-pool", machine_type="e2-standard-4", per_zone=1)  # the task pods' CPU nodes
        gke.add_pool("cheap", machine_type="e2-standard-4")  # the rehearsal's pool, empty
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "backend-kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        backend = SimKfpBackend(sim=gke.sim, kfp=kfp.state, output=tmp_path / "kfp-runs")
        gke.sim.kubelet = TaskProcessKubelet(gke.sim.kubelet, backend)
        kfp.state.on_run, kfp.state.on_terminate = backend.start, backend.terminate
        yield gke, kfp, backend, bucket


def lines_of(out: str) -> dict[str, str]:
    """check name -> its rehearse line."""
    return {line.split(": ")[1]: line for line in out.splitlines() if line.startswith("rehearse: ") and
            line.count(": ") >= 2}  # fmt: skip


def test_a_rehearsal_with_argo_retrying_a_deleted_pod_passes_every_check(cluster, tmp_path, gcs):
    gke, kfp, backend, bucket = cluster
    backend.template_defaults = {"retryStrategy": {"limit": "2", "retryPolicy": "OnError"}}  # KFP 2.17's
    code, out = rehearse(tmp_path, gke, kfp, gcs, bucket)
    assert code == 0, out[-6000:]
    lines = lines_of(out)
    for name in ("config", "data", "submit", "launch", "checkpoint", "trainer pod deleted", "stage change",
                 "train task pod deleted", "terminate", "clean up"):  # fmt: skip
        assert f": {name}: passed: " in lines[name], lines.get(name, out[-3000:])
    assert (
        "provisioning request: skipped: cluster.provisioning is not flex-start"
        in lines["provisioning request"]
    )
    assert "and resumed from step" in lines["trainer pod deleted"], lines["trainer pod deleted"]
    assert "adopted the running JobSet" in lines["train task pod deleted"]
    assert not gke.sim.jobsets and not [n for n in gke.sim.nodes if gke.sim.nodes[n]["pool"] == "cheap"]


def test_under_argos_default_a_deleted_train_task_is_not_retried_and_the_rehearsal_says_so(
    cluster, tmp_path, gcs
):
    """Argo's default retryPolicy, OnFailure, does not retry an attempt whose pod was deleted (Error): the run
    fails, its exit handler stops the trainers, and the rehearsal's line names the fix."""
    gke, kfp, backend, bucket = cluster
    backend.template_defaults = None
    code, out = rehearse(tmp_path, gke, kfp, gcs, bucket)
    assert code == 1, out[-6000:]
    lines = lines_of(out)
    line = lines["train task pod deleted"]
    assert ": train task pod deleted: FAILED: deleted the train task's pod " in line, out[-6000:]
    assert "Argo did not retry it and the run ended FAILED" in line and "argo retries" in line, line
    for name in ("stage change", "terminate", "clean up"):
        # the whole rehearsal's tail on failure: a stage change that failed once under load said too little
        assert f": {name}: passed: " in lines[name], out[-6000:]
    assert not gke.sim.jobsets and not [n for n in gke.sim.nodes if gke.sim.nodes[n]["pool"] == "cheap"]


def test_a_pool_the_cluster_does_not_have_fails_the_first_check_and_leaves_nothing(cluster, tmp_path, gcs):
    gke, kfp, _, bucket = cluster
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(user_config(endpoint=gke.container.endpoint, bucket=bucket, gcs=gcs)))
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig"))}
    done = subprocess.run(
        [sys.executable, "-m", "batchpilot", "rehearse", "--config", str(config), "--pool", "nope", "--host",
         kfp.endpoint], env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    lines = lines_of(done.stdout)
    assert ": config: FAILED: " in lines["config"] and "nope" in lines["config"], lines["config"]
    assert "terminate: skipped: no run was submitted" in lines["terminate"]
    assert not kfp.state.runs and "Traceback" not in done.stderr
