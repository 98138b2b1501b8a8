"""The pool side of flex-start: the pool tasks leave a queued-provisioning pool's size to GKE (its nodes
come with each launch's ProvisioningRequest), refuse a pool that cannot serve a request, and the exit
handler deletes the run's leftover requests. Through the real google-cloud-container and kubernetes
clients against the simulated cluster (provisioning_controller.py, container_api_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gke_sim import CLUSTER, LOCATION, PROJECT, SimulatedGke, simulated_gke

from batchpilot.cluster.gke import GkeNodePool, PoolRef
from batchpilot.cluster.provisioning import Requests, pod_template_manifest, provisioning_request_manifest
from batchpilot.cluster.readiness import PoolNodes
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from helpers import gke_a3_config

FLEX_AUTOSCALING = {"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2}


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        cluster.add_pool(
            "gpu", machine_type="a3-highgpu-8g", queued_provisioning=True, autoscaling=FLEX_AUTOSCALING
        )
        cluster.add_pool("plain", machine_type="a3-highgpu-8g")
        yield cluster


def flex_pool(gke: SimulatedGke, name: str = "gpu") -> GkeNodePool:
    return GkeNodePool(
        client=gke.container.client(), pool=PoolRef(PROJECT, LOCATION, CLUSTER, name), pool_mode="resize",
        idle_nodes=0, nodes=PoolNodes(api_client=gke.kube.api_client(), node_pool=name, gpus_per_node=8),
        operation_timeout_s=10, poll_initial_s=0.02, poll_maximum_s=0.05, ready_poll_interval_s=0.05,
        provisioning="flex-start",
    )  # fmt: skip


def writes(gke: SimulatedGke) -> list[str]:
    return [r.path for r in gke.container.state.requests if r.method != "GET"]


def test_a_queued_provisioning_pool_is_not_resized_and_nothing_is_waited_for(gke, batchpilot_log):
    pool = flex_pool(gke)
    pool.resize(2)
    pool.wait_ready(2, timeout_s=0.01)  # returns at once: the launch waits for its request
    pool.resize(0)
    assert writes(gke) == []  # no setSize, no setAutoscaling: GKE's autoscaler owns this pool
    lines = [r.getMessage() for r in batchpilot_log.records]
    assert "gpu: flex-start: not resized; the 2 node(s) come with the launch's ProvisioningRequest" in lines
    assert (
        "gpu: flex-start: 2 node(s) come with the launch's ProvisioningRequest; the launch waits for it"
        in lines
    )
    assert pool.current_size() == 0


def test_a_pool_without_queued_provisioning_is_one_line_naming_how_to_create_one(gke):
    with pytest.raises(BatchpilotError) as caught:
        flex_pool(gke, "plain").resize(2)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "cluster.provisioning: flex-start needs a node pool with queued provisioning and autoscaling, but plain "
        "has no queued provisioning (fix: create the pool with `gcloud container node-pools create POOL "
        "--flex-start --enable-queued-provisioning"
    )
    assert writes(gke) == []


def test_an_autoscaling_maximum_below_the_launch_is_refused_before_any_request(gke):
    with pytest.raises(BatchpilotError, match=r"but gpu has autoscaling at most 2 node\(s\); 3 are needed"):
        flex_pool(gke).resize(3)


def test_gke_refuses_to_size_a_queued_provisioning_pool_and_to_create_one_with_a_reservation(gke):
    from google.api_core import exceptions
    from google.cloud import container_v1

    client = gke.container.client()
    with pytest.raises(exceptions.BadRequest, match="has autoscaling enabled"):
        client.set_node_pool_size(request={"name": gke.pool_path("gpu"), "node_count": 1})
    pool = container_v1.NodePool(
        name="flex2", initial_node_count=0, queued_provisioning=container_v1.NodePool.QueuedProvisioning(enabled=True),
        config=container_v1.NodeConfig(machine_type="a3-highgpu-8g"), locations=["us-central1-a"],
    )  # fmt: skip
    parent = gke.pool_path("gpu").rsplit("/nodePools", 1)[0]
    with pytest.raises(
        exceptions.BadRequest, match="Queued_provisioning requires reservation affinity to be set to none"
    ):
        client.create_node_pool(request={"parent": parent, "node_pool": pool})
    pool.config.reservation_affinity = container_v1.ReservationAffinity(
        consume_reservation_type=container_v1.ReservationAffinity.Type.NO_RESERVATION
    )
    client.create_node_pool(request={"parent": parent, "node_pool": pool})
    assert client.get_node_pool(name=f"{parent}/nodePools/flex2").queued_provisioning.enabled


def test_the_exit_handler_deletes_the_runs_leftover_requests_and_resizes_nothing(gke, tmp_path, monkeypatch):
    from batchpilot.workflow.pool import scale_down

    monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = parse_config(
        gke_a3_config(provisioning="flex-start", container_api_endpoint=gke.container.endpoint)
    )
    requests = Requests(gke.kube.api_client(), "batchpilot")
    for run, name in (("tiny", "tiny-final-00000000"), ("other", "other-final-00000000")):
        labels = {"batchpilot.dev/run": run, "batchpilot.dev/stage": "final", "batchpilot.dev/plan": "0" * 12}
        pod = {"spec": {"nodeSelector": {"cloud.google.com/gke-nodepool": "gpu"},
                        "containers": [{"name": "t", "image": "batchpilot:0.1.0"}]}}  # fmt: skip
        requests.create(
            template=pod_template_manifest(name=name, namespace="batchpilot", labels=labels, pod=pod),
            request=provisioning_request_manifest(
                name=name, namespace="batchpilot", labels=labels, count=1, max_run_duration_s=3600
            ),
        )
    scale_down(config)
    assert sorted(name for _, name in gke.sim.provisioning.requests) == [
        "other-final-00000000"
    ]  # another run's
    assert sorted(name for _, name in gke.sim.provisioning.templates) == ["other-final-00000000"]
    assert not [path for path in writes(gke) if path.endswith((":setSize", ":setAutoscaling"))]


def test_a_cluster_without_the_provisioningrequest_api_is_one_line_naming_the_gke_version():
    from cluster_sim import ClusterSim
    from kube_api_server import kube_server_running

    # A cluster without queued provisioning served: the list is answered 404.
    with kube_server_running(sim=ClusterSim()) as server, pytest.raises(BatchpilotError) as caught:
        Requests(server.api_client(), "batchpilot").list({"batchpilot.dev/run": "tiny"})
    assert str(caught.value) == (
        "cluster.provisioning: the cluster serves no autoscaling.x-k8s.io/v1 ProvisioningRequests (HTTP 404) "
        "(fix: use a GKE version with flex-start (1.32.2-gke.1652000 or later), or cluster.provisioning: resize)"
    )
