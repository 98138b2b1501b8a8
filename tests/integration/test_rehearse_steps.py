"""The rehearsal's checks that the end-to-end test (tests/e2e/test_rehearse_simulated.py) cannot reach: a
flex-start pool needs GPU nodes, and the simulator's trainer pods cannot run a GPU-planned trainer. Here the
flex-start check reads the simulator's ProvisioningRequests through the real client, as on a cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gke_sim import SimulatedGke, simulated_gke

from batchpilot.config import parse_config
from batchpilot.rehearse.steps import Options, Rehearsal
from helpers import gke_a3_config


@pytest.fixture
def gke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield cluster


def rehearsal_of(gke: SimulatedGke) -> Rehearsal:
    config = parse_config(
        {**gke_a3_config(provisioning="flex-start", namespace="batchpilot"), "name": "rehearse-1"}
    )
    rehearsal = Rehearsal(
        config, Options(pool="gpu", host="http://127.0.0.1:9"), config=config, run_id="run-1"
    )
    return rehearsal


def ask_for_nodes(gke: SimulatedGke, name: str) -> None:
    """A launch's ProvisioningRequest for one a3-highgpu-8g node of pool `gpu`, as the train task creates it."""
    from batchpilot.cluster.provisioning import (
        Requests,
        consume_request,
        pod_template_manifest,
        provisioning_request_manifest,
    )

    labels = {
        "batchpilot.dev/run": "rehearse-1",
        "batchpilot.dev/stage": "stage-0",
        "batchpilot.dev/plan": "ab",
    }
    pod = {"metadata": {}, "spec": {"nodeSelector": {"cloud.google.com/gke-nodepool": "gpu"}, "containers": [
        {"name": "trainer", "image": "batchpilot:0.1.0", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}  # fmt: skip
    consume_request(pod, name=name)  # the queued nodes' taint, tolerated
    Requests(gke.kube.api_client(), "batchpilot").create(
        template=pod_template_manifest(name=name, namespace="batchpilot", labels=labels, pod=pod),
        request=provisioning_request_manifest(name=name, namespace="batchpilot", labels=labels, count=1,
                                              max_run_duration_s=3600),
    )  # fmt: skip


def test_a_request_seen_provisioned_passes_the_flex_start_check(gke):
    gke.add_pool("gpu", machine_type="a3-highgpu-8g", queued_provisioning=True,
                 autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2})  # fmt: skip
    rehearsal = rehearsal_of(gke)
    ask_for_nodes(gke, "rehearse-1-stage-0-ab")
    gke.sim.reconcile()  # GKE provisions it
    rehearsal._note_requests(rehearsal.view)  # what every wait for a JobSet does as it polls
    check = rehearsal.provisioning_round_trip()
    assert (check.status, check.message) == ("passed", "rehearse-1-stage-0-ab Provisioned, then deleted")


def test_no_request_seen_provisioned_fails_the_flex_start_check(gke):
    rehearsal = rehearsal_of(gke)
    ask_for_nodes(gke, "rehearse-1-stage-0-ab")  # no queued-provisioning pool: GKE never provisions it
    gke.sim.reconcile()
    rehearsal._note_requests(rehearsal.view)
    check = rehearsal.provisioning_round_trip()
    assert (
        check.status == "FAILED" and check.message == "no ProvisioningRequest of the run was seen Provisioned"
    )
