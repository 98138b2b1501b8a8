"""A run terminated as KFP terminates it, whose exit hook never runs, in the simulated GKE cluster.

KFP terminates a run by setting the workflow's activeDeadlineSeconds to 0 (kubeflow/pipelines
resource_manager.go); Argo then sends the running task pods SIGTERM through TerminateContainers without
deleting them (argo-workflows exec_control.go, pod/queue.go), and its exit hook may never run (a Pending
exit pod). The train task (`batchpilot launch` as a process, following its JobSet) deletes the JobSet;
the pool stays up, labelled with the run, until its Lease has expired; then `batchpilot pool scale-down
--orphaned` (the chart's CronJob) scales it down. The clock is injected (`ownership._now`).
"""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from container_api_server import GkeClusterSim, container_server_running
from gke_sim import CLUSTER, SimulatedGke
from kube_api_server import kube_server_running
from test_train_task_sigterm import (
    GracefulKubelet,
    start_train_task,
    train_task_pod,
    wait_for_running_jobset,
)

from batchpilot.cli import main
from batchpilot.cluster import ownership
from batchpilot.cluster.labels import IDLE_POOL_LABEL, RUN_POOL_LABEL
from helpers import tiny_config, write_plan

NS = "batchpilot"


@pytest.fixture
def gke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedGke]:
    sim = GkeClusterSim(cluster=CLUSTER, kubelet=GracefulKubelet())
    with container_server_running(sim=sim) as container, kube_server_running(sim=sim) as kube, sim.running():
        cluster = SimulatedGke(sim, container, kube)
        cluster.add_pool("default-pool", machine_type="e2-standard-4", per_zone=1)  # task pods
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g")
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield cluster


def gke_config(gke: SimulatedGke, *, bucket: str, emulator: str) -> dict:
    config = tiny_config(data_uri=f"gs://{bucket}/data", checkpoint_uri=f"gs://{bucket}/ckpt")
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="gpu",
        image="registry.example/batchpilot:0.1.0", machine_type="a3-highgpu-8g",
        accelerator_type="nvidia-h100-80gb", devices_per_node=8, namespace=NS, ready_timeout_s=10,
        container_api_endpoint=gke.container.endpoint, orphan_ttl_s=60,
        env={"STORAGE_EMULATOR_HOST": emulator},  # pods inherit only PATH/HOME/PYTHONPATH/LANG
    )  # fmt: skip
    config["batch"]["micro_batch_size"] = 2
    return config


def labels(gke: SimulatedGke) -> dict[str, str]:
    return dict(gke.container.client().get_node_pool(name=gke.pool_path("gpu")).config.resource_labels)


@pytest.mark.slow
def test_a_terminated_run_whose_exit_hook_never_ran_has_its_pool_scaled_down_after_the_ttl(
    gke, gcs_server, gcs_bucket, tmp_path, capsys, monkeypatch
):
    config = gke_config(gke, bucket=gcs_bucket, emulator=gcs_server.endpoint)
    plan = write_plan(tmp_path, config)
    config_path = tmp_path / "config.yaml"
    assert main(["pool", "resize", "--config", str(config_path), "--nodes", "1"]) == 0  # resize task
    assert labels(gke) == {RUN_POOL_LABEL: "tiny", IDLE_POOL_LABEL: "0"}

    # The train task follows its JobSet; KFP terminates the run: SIGTERM, the task pod is not deleted.
    proc = start_train_task(gke, plan, train_task_pod(gke.sim), tmp_path)
    jobset = wait_for_running_jobset(gke, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "SIGTERM is a cancel" in output, output
    # Deleted with propagationPolicy Foreground: it stays, marked, while its trainers checkpoint.
    assert gke.sim.jobsets[(NS, jobset)]["metadata"].get("deletionTimestamp"), output

    # The exit hook never runs: the pool keeps its node and its labels while the Lease lasts.
    capsys.readouterr()
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert "gpu: run tiny is alive (Lease batchpilot-run-tiny renewed until" in capsys.readouterr().out
    assert gke.sim.pool_size("gpu") == 1

    # After the TTL (the resize task's Lease lasts explore + plan + a pool task's timeout at least).
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)
    monkeypatch.setattr(ownership, "_now", lambda: later)
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "gpu: orphaned by run tiny (Lease batchpilot-run-tiny expired); scaled down 1 -> 0 node(s)"
    )
    assert gke.sim.pool_size("gpu") == 0 and labels(gke) == {}
    assert not gke.kube.state.leases
    assert yaml.safe_load(config_path.read_text())["name"] == "tiny"


EMISSARY_CHILD = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
"""KFP's launcher as Argo's emissary sees it: it runs the component as a child process and has no SIGTERM
handler (kubeflow/pipelines backend/src/v2/component/launcher_v2.go), so SIGTERM ends it at once."""


@pytest.mark.slow
def test_a_cancel_that_kills_the_task_before_it_cleans_up_leaves_nothing_after_the_ttl(
    gke, gcs_server, gcs_bucket, tmp_path, capsys, monkeypatch
):
    """Argo's emissary forwards SIGTERM to the container's whole process group and exits as soon as its
    direct child (KFP's launcher) has exited; the container then ends, killing the component mid-cleanup
    (argo-workflows cmd/argoexec/commands/emissary.go). Nothing the cancel needs may depend on the task:
    with no exit hook either, the orphan reaper deletes the run's JobSet once its Lease has expired."""
    import os
    import subprocess
    import sys
    import time

    from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV

    config = gke_config(gke, bucket=gcs_bucket, emulator=gcs_server.endpoint)
    plan = write_plan(tmp_path, config)
    config_path = tmp_path / "config.yaml"
    assert main(["pool", "resize", "--config", str(config_path), "--nodes", "1"]) == 0
    env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig")),
           POD_NAME_ENV: train_task_pod(gke.sim), POD_NAMESPACE_ENV: "kubeflow"}  # fmt: skip
    env.pop("KUBERNETES_SERVICE_HOST", None)
    task = subprocess.Popen(
        [sys.executable, "-c", EMISSARY_CHILD, sys.executable, "-m", "batchpilot", "launch", "--plan", plan,
         "--stage", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    jobset = wait_for_running_jobset(gke, task)
    os.killpg(task.pid, signal.SIGTERM)  # emissary: SIGTERM to the process group
    task.wait(timeout=30)  # the launcher (its direct child) ends at once ...
    os.killpg(task.pid, signal.SIGKILL)  # ... and the container ends with it: whatever still runs is killed
    time.sleep(1.0)
    # Whatever the component managed before it was killed, the JobSet may still hold the GPUs; the exit hook
    # never runs. After the run's Lease has expired, the reaper deletes the JobSet, then scales the pool down.
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)
    monkeypatch.setattr(ownership, "_now", lambda: later)
    capsys.readouterr()
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert "gpu: orphaned by run tiny (Lease batchpilot-run-tiny expired); scaled down 1 -> 0 node(s)" in out
    remaining = gke.sim.jobsets.get((NS, jobset))
    assert remaining is None or remaining["metadata"].get("deletionTimestamp"), out
    assert gke.sim.pool_size("gpu") == 0 and labels(gke) == {}
