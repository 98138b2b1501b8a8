"""Pods of the simulated cluster as local processes: command, env, DNS names, exit codes, OOM, SIGTERM."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke

NS = "batchpilot"


@pytest.fixture
def gke(tmp_path: Path) -> Iterator[SimulatedGke]:
    with simulated_gke(run_pods_in=tmp_path / "pods") as cluster:
        cluster.add_pool("cpu", machine_type="e2-standard-4", per_zone=2)
        yield cluster


def core(gke: SimulatedGke) -> Any:
    from kubernetes import client

    return client.CoreV1Api(gke.kube.api_client())


def wait_for(condition: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


def python_pod(name: str, code: str, **extra: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "batchpilot:0.1.0", "command": ["python", "-c", code], **extra}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container]},
    }


def finished(gke: SimulatedGke, name: str) -> Any:
    pod = core(gke).read_namespaced_pod(name, NS)
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def terminated(pod: Any) -> Any:
    return pod.status.container_statuses[0].state.terminated


def test_a_pod_runs_its_command_with_its_env_and_reports_the_exit_code(gke):
    code = "import os, sys; print(os.environ['GREETING'], os.environ['HOSTNAME']); sys.exit(3)"
    env = [{"name": "WHO", "value": "sim"}, {"name": "GREETING", "value": "hello-$(WHO)"}]
    core(gke).create_namespaced_pod(NS, python_pod("hello", code, env=env))
    pod = wait_for(lambda: finished(gke, "hello"))
    assert pod.status.phase == "Failed"
    assert (terminated(pod).exit_code, terminated(pod).reason) == (3, "Error")
    assert core(gke).read_namespaced_pod_log("hello", NS) == "hello-sim hello\n"


def test_a_pod_over_its_memory_limit_is_oom_killed_with_137(gke):
    code = "import time; blocks = [bytearray(8 << 20) for _ in range(40)]; time.sleep(30)"
    resources = {"limits": {"memory": "150Mi"}}
    core(gke).create_namespaced_pod(NS, python_pod("hungry", code, resources=resources))
    pod = wait_for(lambda: finished(gke, "hungry"))
    assert (terminated(pod).exit_code, terminated(pod).reason) == (137, "OOMKilled")


def test_deleting_a_pod_sends_sigterm_then_sigkill_after_the_grace_period(gke, tmp_path):
    marker = tmp_path / "sigterm"
    handles = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marker)!r}).write_text('ok'), sys.exit(75)))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    api = core(gke)
    api.create_namespaced_pod(NS, python_pod("polite", handles))
    stubborn = python_pod("stubborn", ignores)
    stubborn["spec"]["terminationGracePeriodSeconds"] = 1
    api.create_namespaced_pod(NS, stubborn)
    for name in ("polite", "stubborn"):
        wait_for(lambda name=name: "ready" in api.read_namespaced_pod_log(name, NS))
    started = time.monotonic()
    api.delete_namespaced_pod("polite", NS)
    api.delete_namespaced_pod("stubborn", NS)
    wait_for(lambda: (NS, "polite") not in gke.sim.pods)
    assert marker.read_text() == "ok"
    wait_for(lambda: not gke.sim.pods)
    assert time.monotonic() - started >= 1.0  # the stubborn one got its whole grace period


def test_pod_dns_names_in_env_resolve_to_this_machine(gke):
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "echo"},
        "spec": {"network": {"enableDNSHostnames": True, "subdomain": "echo"}, "replicatedJobs": [{
            "name": "node", "replicas": 1, "template": {"spec": {
                "parallelism": 2, "completions": 2, "completionMode": "Indexed", "backoffLimit": 0,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{
                    "name": "main", "image": "batchpilot:0.1.0",
                    "command": ["python", "-c", "import os; print(os.environ['RANK0'], os.environ['JOB_COMPLETION_INDEX'])"],
                    "env": [{"name": "RANK0", "value": "echo-node-0-0.echo:29500"}],
                }]}},
            }},
        }]},
    }  # fmt: skip
    from kubernetes import client

    objects = client.CustomObjectsApi(gke.kube.api_client())
    objects.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", jobset)
    status = wait_for(
        lambda: objects.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "echo")[
            "status"
        ].get("terminalState")
    )
    assert status == "Completed"
    logs = sorted(core(gke).read_namespaced_pod_log(name, NS) for (_, name) in gke.sim.pods)
    assert logs == ["127.0.0.1:29500 0\n", "127.0.0.1:29500 1\n"]


def test_the_pod_python_is_this_interpreter(gke):
    core(gke).create_namespaced_pod(NS, python_pod("which", "import sys; print(sys.executable)"))
    wait_for(lambda: finished(gke, "which"))
    assert core(gke).read_namespaced_pod_log("which", NS).strip() == sys.executable


def test_a_pod_past_its_active_deadline_is_killed_with_reason_deadline_exceeded(gke):
    pod = python_pod("slow", "import time; time.sleep(60)")
    pod["spec"]["activeDeadlineSeconds"] = 1
    core(gke).create_namespaced_pod(NS, pod)
    ended = wait_for(lambda: finished(gke, "slow"))
    assert (ended.status.phase, ended.status.reason) == ("Failed", "DeadlineExceeded")
    assert terminated(ended).exit_code == 137
