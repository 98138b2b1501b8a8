"""The `jobset` torchx scheduler and `batchpilot launch` on gke, through the real kubernetes client.

A local server plays the Kubernetes API and the JobSet controller (it starts one pod per node when a
JobSet is created, with the labels the controller sets, and serves scripted statuses and logs).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube_api_server import KubeServer, kube_server_running

from batchpilot.cli import main
from batchpilot.cluster.jobset import JobSetScheduler
from batchpilot.config import parse_config
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_LOG_MARKER
from batchpilot.plan.planner import make_run_document

COMPLETED = {
    "conditions": [{"type": "Completed", "status": "True", "message": "jobset completed successfully"}]
}
FAILED = {
    "terminalState": "Failed",
    "conditions": [{"type": "Failed", "status": "True", "message": "pod failed"}],
}
RUNNING = {"replicatedJobsStatus": [{"name": "batchpilot", "active": 2, "ready": 2}]}


@pytest.fixture
def kube(tmp_path, monkeypatch) -> Iterator[KubeServer]:
    with kube_server_running() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


def write_plan(folder: Path) -> str:
    config = {
        "name": "ramp",
        "data": {"uri": "gs://bucket/data", "seq_len": 128},
        "cluster": {
            "backend": "gke", "devices_per_node": 1, "max_nodes": 2, "project": "p", "location": "l",
            "cluster_name": "c", "node_pool": "gpu", "image": "registry.example/batchpilot:0.1.0",
            "cpu_per_node": 4, "memory_per_node_bytes": "16GiB",
        },
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "train": {"total_samples": 64, "lr": 1e-3, "checkpoint_uri": "gs://bucket/ckpt"},
    }  # fmt: skip
    (folder / "plan.json").write_text(make_run_document(parse_config(config)).to_json())
    return str(folder / "plan.json")


def launch(folder: Path) -> int:
    return main(["launch", "--plan", write_plan(folder), "--stage", "final"])


def test_launch_creates_the_jobset_streams_every_node_and_returns_0(kube, tmp_path, capsys):
    kube.state.jobset_statuses = [COMPLETED]
    kube.state.node_logs = {0: "[rank 0] step 1 loss 5.1\n", 1: "[rank 1] step 1\n"}
    assert launch(tmp_path) == 0
    (created,) = [body for method, path, _, body in kube.state.requests if method == "POST"]
    assert created["kind"] == "JobSet" and created["metadata"]["namespace"] == "batchpilot"
    creates = [path for method, path, _, _ in kube.state.requests if method == "POST"]
    assert creates == ["/apis/jobset.x-k8s.io/v1alpha2/namespaces/batchpilot/jobsets"]
    out = capsys.readouterr().out
    assert "via jobset (jobset://batchpilot/batchpilot:ramp-final-" in out
    assert "[rank 0] step 1 loss 5.1" in out and "[rank 1] step 1" in out


def test_a_failed_jobset_whose_log_says_preempted_exits_75(kube, tmp_path, capsys):
    kube.state.jobset_statuses = [FAILED]
    kube.state.node_logs = {1: f"[rank 1] SIGTERM: checkpoint written\n{PREEMPTED_LOG_MARKER}\n"}
    assert launch(tmp_path) == EXIT_PREEMPTED
    assert "was preempted after checkpointing" in capsys.readouterr().out


def test_a_failed_jobset_exits_1_with_the_controller_message(kube, tmp_path, capsys):
    kube.state.jobset_statuses = [FAILED]
    assert launch(tmp_path) == 1
    assert "failed (FAILED): pod failed" in capsys.readouterr().err


def test_scheduler_describe_follows_the_status_and_cancel_deletes(kube, tmp_path):
    from torchx.runner import Runner
    from torchx.specs import AppDef, AppState, Role

    client = kube.api_client()
    runner = Runner(
        "test", {"jobset": lambda session_name, **_: JobSetScheduler(session_name, client=client)}
    )
    app = AppDef(name="echo", roles=[Role(name="echo", image="busybox", entrypoint="echo", num_replicas=2)])
    kube.state.jobset_statuses = [{}, RUNNING, COMPLETED]
    handle = runner.run(app, scheduler="jobset", cfg={"namespace": "ns", "queue": "lm"})
    states = [runner.status(handle).state for _ in range(3)]
    assert states == [AppState.PENDING, AppState.RUNNING, AppState.SUCCEEDED]
    (created,) = kube.state.jobsets.values()
    assert created["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "lm"}
    kube.state.jobset_statuses = [RUNNING]  # a finished job is not cancelled
    runner.cancel(handle)
    assert not kube.state.jobsets
    assert (
        "DELETE",
        f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets/{created['metadata']['name']}",
    ) in [(method, path) for method, path, _, _ in kube.state.requests]
    assert runner.status(handle) is None  # the JobSet is gone: describe gets a 404 and torchx says no app


# --- lifecycle: cancel, retry, the run's end ------------------------------------------------------

JOBSETS_PATH = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/batchpilot/jobsets"


def launch_process(plan: str) -> subprocess.Popen:
    """`batchpilot launch` as a real process (KUBECONFIG comes from the `kube` fixture's environment)."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "final"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_jobset(kube: KubeServer, proc: subprocess.Popen, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if kube.state.jobsets:
            return next(iter(kube.state.jobsets))
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError("no JobSet was created")


def creates(kube: KubeServer) -> list[str]:
    return [path for method, path, _, _ in kube.state.requests if method == "POST"]


def deletes(kube: KubeServer) -> list[tuple[str, str | None]]:
    return [
        (path.rsplit("/", 1)[-1], query.get("propagationPolicy", [None])[0])
        for method, path, query, _ in kube.state.requests
        if method == "DELETE"
    ]


def test_sigterm_to_a_running_launch_deletes_its_jobset(kube, tmp_path):
    kube.state.jobset_statuses = [RUNNING]  # runs until cancelled
    proc = launch_process(write_plan(tmp_path))
    name = wait_for_jobset(kube, proc)
    time.sleep(1.0)  # following it
    proc.send_signal(signal.SIGTERM)  # KFP stops a cancelled run's task pod so
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, output
    assert not kube.state.jobsets, output
    assert (name, "Foreground") in deletes(kube)
    labels = kube.state.requests[[m for m, *_ in kube.state.requests].index("POST")][3]["metadata"]["labels"]
    assert labels["batchpilot.dev/run"] == "ramp" and labels["batchpilot.dev/stage"] == "final"


def test_a_second_launch_of_a_running_stage_adopts_its_jobset(kube, tmp_path, capsys):
    kube.state.jobset_statuses = [RUNNING]
    plan = write_plan(tmp_path)
    first = launch_process(plan)
    name = wait_for_jobset(kube, first)
    finish = threading.Timer(3.0, lambda: setattr(kube.state, "jobset_statuses", [COMPLETED]))
    finish.start()
    try:
        assert main(["launch", "--plan", plan, "--stage", "final"]) == 0  # a retried KFP task
    finally:
        finish.cancel()
    output, _ = first.communicate(timeout=60)
    assert first.returncode == 0, output
    assert creates(kube) == [JOBSETS_PATH]  # one JobSet, followed by both launches
    assert list(kube.state.jobsets) == [name] and not deletes(kube)
    assert f"adopting its running JobSet {name}" in capsys.readouterr().out


def test_a_launch_replaces_the_stage_s_failed_jobset(kube, tmp_path, capsys):
    plan = write_plan(tmp_path)
    kube.state.jobset_statuses = [FAILED]
    assert launch(tmp_path) == 1
    (failed,) = kube.state.jobsets
    kube.state.jobset_statuses = [COMPLETED]
    assert main(["launch", "--plan", plan, "--stage", "final"]) == 0
    assert deletes(kube) == [(failed, "Foreground")]
    assert creates(kube) == [JOBSETS_PATH, JOBSETS_PATH]
    # The same, deterministic name (#20): the replacement, created after the failed one was deleted.
    order = [method for method, path, _, _ in kube.state.requests if method != "GET" and "/jobsets" in path]
    assert list(kube.state.jobsets) == [failed] and order == ["POST", "DELETE", "POST"]
    assert f"deleting JobSet(s) {failed} (replaced by this launch)" in capsys.readouterr().out


def test_a_launch_deletes_a_running_leftover_of_its_run_s_other_launches(kube, tmp_path, capsys):
    """Launches of a run follow one another: another launch's JobSet still running (e.g. `stages-0-2` of
    a plan with another grouping, whose exit handler never ran) would write the same checkpoints."""

    def leftover(name: str, run: str, stage: str, status: dict) -> dict:
        labels = {"batchpilot.dev/run": run, "batchpilot.dev/stage": stage, "batchpilot.dev/plan": "0" * 12}
        return {"metadata": {"name": name, "labels": labels}, "spec": {}, "status": status}

    kube.state.jobsets["ramp-stages-0-1"] = leftover("ramp-stages-0-1", "ramp", "stages-0-1", RUNNING)
    kube.state.jobsets["ramp-stage-0"] = leftover(
        "ramp-stage-0", "ramp", "stage-0", COMPLETED
    )  # its logs stay
    kube.state.jobsets["other-final"] = leftover("other-final", "other", "final", RUNNING)  # another run's
    kube.state.jobset_statuses = [COMPLETED]
    assert launch(tmp_path) == 0
    assert deletes(kube) == [("ramp-stages-0-1", "Foreground")]
    assert {"ramp-stage-0", "other-final"} <= set(kube.state.jobsets)
    assert "deleting JobSet(s) ramp-stages-0-1 (replaced by this launch)" in capsys.readouterr().out


def test_scale_down_deletes_the_run_s_jobsets_before_the_pool_shrinks(kube, tmp_path, monkeypatch):
    from batchpilot.cluster import nodepool
    from batchpilot.workflow.pool import scale_down

    kube.state.jobset_statuses = [RUNNING]
    plan = write_plan(tmp_path)
    first = launch_process(plan)
    name = wait_for_jobset(kube, first)
    other = {"metadata": {"name": "other-run", "labels": {"batchpilot.dev/run": "other"}}, "spec": {}}
    kube.state.jobsets["other-run"] = other

    left_at_resize: list[str] = []

    class Pool:
        """The node pool: records which JobSets were left when it was resized."""

        def current_size(self) -> int:
            return 2

        def resize(self, num_nodes: int) -> None:
            left_at_resize.extend(sorted(kube.state.jobsets))

        def describe(self) -> str:
            return "pool"

    monkeypatch.setattr(nodepool, "node_pool_for", lambda config, state_path=None: Pool())
    config = parse_config(json.loads(Path(plan).read_text())["config"])
    scale_down(config)
    assert left_at_resize == ["other-run"]
    assert deletes(kube) == [(name, "Foreground")]
    first.communicate(timeout=60)  # its JobSet is gone: the launch ends
    assert first.returncode != 0
