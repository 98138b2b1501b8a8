"""Issue #20: a simulated pod's emptyDir `/tmp` is its own, as on a real node (kubernetes.io docs "Volumes":
an emptyDir is created empty when the pod is assigned to a node and deleted with the pod), so what one
trainer pod writes under /tmp/batchpilot is never what another (or its replacement after a restart) reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gke_sim import SimulatedGke, simulated_gke

NS = "batchpilot"
# What a trainer pod does with its output dir: read what is there, then write its own marker.
SCRIPT = (
    "mkdir -p /tmp/batchpilot/out && cat /tmp/batchpilot/out/marker 2>/dev/null; "
    'echo "$HOSTNAME" > /tmp/batchpilot/out/marker; echo "wrote $HOSTNAME"'
)


@pytest.fixture
def gke(tmp_path: Path) -> Iterator[SimulatedGke]:
    with simulated_gke(run_pods_in=tmp_path / "pods") as cluster:
        cluster.add_pool("cpu", machine_type="e2-standard-4", per_zone=2)
        yield cluster


def trainer_like_pod(name: str) -> dict[str, Any]:
    """A pod with batchpilot's trainer volumes: /tmp is an emptyDir (`placement.trainer_pod_overlay`)."""
    container = {
        "name": "main", "image": "batchpilot:0.1.0", "command": ["bash", "-c", SCRIPT],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]},
    }


def log_when_done(gke: SimulatedGke, name: str) -> str:
    from kubernetes import client

    core = client.CoreV1Api(gke.kube.api_client())
    deadline = time.monotonic() + 20
    while core.read_namespaced_pod(name, NS).status.phase not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, f"pod {name} did not finish"
        time.sleep(0.05)
    return str(core.read_namespaced_pod_log(name, NS))


def test_each_pod_starts_with_an_empty_tmp_of_its_own(gke):
    from kubernetes import client

    core = client.CoreV1Api(gke.kube.api_client())
    for name in ("trainer-a", "trainer-b"):
        core.create_namespaced_pod(NS, trainer_like_pod(name))
        # Nothing of the other pod's /tmp: the log is only this pod's own line.
        assert log_when_done(gke, name) == f"wrote {name}\n"
