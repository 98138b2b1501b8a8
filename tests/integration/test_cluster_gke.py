"""The GKE node pool through the real google-cloud-container and kubernetes clients, against local servers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_api_server import ContainerServer, container_server_running
from kube_api_server import KubeServer, kube_server_running, node
from pydantic import ValidationError

from batchpilot.cluster.gke import (
    GkeNodePool,
    PoolRef,
    container_client,
    gke_node_pool,
    is_concurrent_operation,
    require_gke_settings,
)
from batchpilot.cluster.launch import trainer_pod_resources
from batchpilot.cluster.machines import Allocatable
from batchpilot.cluster.nodepool import NodePool
from batchpilot.cluster.readiness import PoolNodes
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError

REF = PoolRef("proj", "us-central1", "train", "gpu")


def messages(log: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in log.records if record.levelno == level]


@pytest.fixture
def container() -> Iterator[ContainerServer]:
    with container_server_running() as server:
        server.state.add_pool(REF.name, locations=["us-central1-a", "us-central1-b"])
        yield server


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    with kube_server_running() as server:
        yield server


def make_pool(
    container: ContainerServer, kube: KubeServer, *, mode: str = "resize", gpus: int = 8
) -> GkeNodePool:
    return GkeNodePool(
        client=container.client(),
        pool=REF,
        pool_mode=mode,
        idle_nodes=0,
        nodes=PoolNodes(api_client=kube.api_client(), node_pool="gpu", gpus_per_node=gpus),
        operation_timeout_s=20,
        retry_initial_s=0.05,
        retry_maximum_s=0.1,
        poll_initial_s=0.02,
        poll_maximum_s=0.05,
        ready_poll_interval_s=0.05,
    )


def test_resize_sets_the_per_zone_count_and_polls_the_operation_to_done(container, kube):
    pool = make_pool(container, kube)
    assert isinstance(pool, NodePool)
    pool.resize(4)
    writes = [r for r in container.state.requests if r.method == "POST"]
    assert [(r.path, r.body) for r in writes] == [(f"/v1/{REF.name}:setSize", {"nodeCount": 2})]
    polls = [r.path for r in container.state.requests if "/operations/" in r.path]
    assert polls == ["/v1/projects/proj/locations/us-central1/operations/operation-1"] * 2
    assert container.state.pools[REF.name]["nodeCountPerZone"] == 2


def test_a_size_that_does_not_split_over_the_zones_is_refused_before_any_write(container, kube):
    with pytest.raises(BatchpilotError, match=r"3 node\(s\) cannot be spread over the pool's 2 zones"):
        make_pool(container, kube).resize(3)
    assert not [r for r in container.state.requests if r.method == "POST"]


def test_a_concurrent_operation_is_retried_until_the_cluster_is_free(container, kube, batchpilot_log):
    container.state.conflicts = 2
    make_pool(container, kube).resize(2)
    writes = [r for r in container.state.requests if r.method == "POST"]
    assert len(writes) == 3 and container.state.pools[REF.name]["nodeCountPerZone"] == 1
    assert sum(message.count("retrying") for message in messages(batchpilot_log, logging.WARNING)) == 2


def test_a_permission_error_is_one_line_naming_the_permission(container, kube):
    container.state.deny = True
    with pytest.raises(BatchpilotError) as caught:
        make_pool(container, kube).resize(2)
    message = str(caught.value)
    assert "\n" not in message and "container.clusters.update" in message
    assert len([r for r in container.state.requests if r.method == "POST"]) == 1  # not retried


def test_a_failed_operation_reports_its_error(container, kube):
    container.state.fail_operation = "Insufficient quota to satisfy the request"
    with pytest.raises(BatchpilotError, match=r"resize to 2 node.* failed: Insufficient quota"):
        make_pool(container, kube).resize(2)


def test_an_unknown_pool_is_reported(container, kube):
    pool = make_pool(container, kube)
    pool.pool = PoolRef("proj", "us-central1", "train", "nope")
    with pytest.raises(BatchpilotError, match=r"cluster.node_pool: .*nodePools/nope was not found"):
        pool.resize(2)


def test_autoscale_mode_sets_total_bounds_and_checks_them_when_waiting(container, kube, batchpilot_log):
    pool = make_pool(container, kube, mode="autoscale")
    pool.resize(6)
    (write,) = [r for r in container.state.requests if r.method == "POST"]
    assert write.path == f"/v1/{REF.name}:setAutoscaling"
    assert write.body == {"autoscaling": {"enabled": True, "totalMaxNodeCount": 6}}  # min 0 is the default
    pool.wait_ready(6, timeout_s=1)
    assert any(
        "autoscaling admits 6 node(s)" in message for message in messages(batchpilot_log, logging.INFO)
    )
    with pytest.raises(BatchpilotError, match=r"at most 6 node\(s\); 8 are needed"):
        pool.wait_ready(8, timeout_s=1)


def test_static_mode_never_writes_and_refuses_a_pool_too_small(container, kube):
    kube.state.node_snapshots = [[node(f"n{i}", pool="gpu", gpus=8) for i in range(2)]]
    pool = make_pool(container, kube, mode="static")
    pool.resize(2)
    with pytest.raises(BatchpilotError, match=r"static pool gpu has 2 node\(s\), 3 are needed"):
        pool.resize(3)
    assert not [r for r in container.state.requests if r.method == "POST"]


def test_wait_ready_waits_for_ready_uncordoned_nodes_with_their_gpus(container, kube):
    kube.state.node_snapshots = [
        [node("a", pool="gpu", ready=False)],
        [node("a", pool="gpu", gpus=0), node("b", pool="gpu", ready=False)],
        [node("a", pool="gpu", gpus=8), node("b", pool="gpu", gpus=8), node("x", pool="other", gpus=8)],
    ]
    pool = make_pool(container, kube)
    pool.wait_ready(2, timeout_s=10)
    assert kube.state.node_lists == 3
    (_, path, query, _) = kube.state.requests[0]
    assert path == "/api/v1/nodes" and query["labelSelector"] == ["cloud.google.com/gke-nodepool=gpu"]
    assert pool.current_size() == 2


def test_wait_ready_times_out_saying_what_is_missing(container, kube):
    kube.state.node_snapshots = [
        [
            node("a", pool="gpu", gpus=8),
            node("b", pool="gpu", ready=False),
            node("c", pool="gpu", cordoned=True, gpus=8),
            node("d", pool="gpu", gpus=4),
        ]
    ]
    with pytest.raises(BatchpilotError) as caught:
        make_pool(container, kube).wait_ready(5, timeout_s=0.2)
    message = str(caught.value)
    assert message.startswith("cluster.ready_timeout_s: node pool 'gpu': 1 of 5 node(s) usable after 0.2s")
    for part in (
        "b is not Ready",
        "c is cordoned",
        "d has 4 of 8 nvidia.com/gpu",
        "1 node(s) not registered",
    ):
        assert part in message
    assert "\n" not in message


def test_describe_names_the_pool_zones_and_node_states(container, kube):
    kube.state.node_snapshots = [[node("a", pool="gpu", gpus=8), node("b", pool="gpu", ready=False)]]
    text = make_pool(container, kube).describe()
    assert "zones us-central1-a, us-central1-b" in text and "2 node(s), 1 usable; b is not Ready" in text


def test_concurrent_operation_errors_are_told_apart_from_others():
    from google.api_core import exceptions

    busy = (
        "Operation operation-1 is currently upgrading cluster c. Please wait and try again once it is done."
    )
    assert is_concurrent_operation(exceptions.FailedPrecondition(busy))
    assert is_concurrent_operation(exceptions.BadRequest(busy))
    assert is_concurrent_operation(
        exceptions.FailedPrecondition("Cluster is running incompatible operation op-1")
    )
    assert is_concurrent_operation(exceptions.TooManyRequests("concurrent operations quota"))
    assert not is_concurrent_operation(exceptions.BadRequest("Node count must be positive"))
    assert not is_concurrent_operation(exceptions.PermissionDenied(busy))


def test_gke_settings_are_required_one_field_at_a_time():
    cluster = ClusterConfig(backend="gke", max_nodes=4, project="p", location="l")
    with pytest.raises(
        BatchpilotError, match=r"^cluster.cluster_name: is required when cluster.backend is gke"
    ):
        require_gke_settings(cluster)


def test_the_smallest_usable_node_bounds_the_trainer_pods(kube):
    small = node("b", pool="gpu", gpus=8)
    small["status"]["allocatable"].update(cpu="7910m", memory="1869654592Ki")
    cordoned = node("c", pool="gpu", gpus=8, cordoned=True)
    cordoned["status"]["allocatable"].update(cpu="1", memory="1Gi")  # not usable: does not count
    kube.state.node_snapshots = [[node("a", pool="gpu", gpus=8), small, cordoned]]
    nodes = PoolNodes(api_client=kube.api_client(), node_pool="gpu", gpus_per_node=8)
    assert nodes.smallest_usable_allocatable() == Allocatable(cpu_millicores=7910, memory_bytes=32 * 2**30)
    kube.state.node_snapshots = [[cordoned]]
    assert nodes.smallest_usable_allocatable() is None


def use_kubeconfig(kube: KubeServer, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KUBECONFIG pointing at the Kubernetes API stand-in, and no in-cluster service account."""
    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(folder / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def test_an_http_endpoint_in_the_config_reaches_that_emulator_without_google_credentials(
    container, kube, tmp_path, monkeypatch
):
    use_kubeconfig(kube, tmp_path, monkeypatch)
    # No Application Default Credentials on this machine: an emulator must not need them...
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    container.state.polls_until_done = 0
    cluster = ClusterConfig(
        backend="gke", max_nodes=4, project="proj", location="us-central1", cluster_name="train",
        node_pool="gpu", image="registry.example/batchpilot:0.1.0",
        container_api_endpoint=f"{container.endpoint}/",
    )  # fmt: skip
    assert cluster.container_api_endpoint == container.endpoint  # the client adds /v1/...
    gke_node_pool(cluster).resize(2)  # the real client, built as the pipeline's tasks build it
    writes = [(r.method, r.path, r.body) for r in container.state.requests if r.method == "POST"]
    assert writes == [("POST", f"/v1/{REF.name}:setSize", {"nodeCount": 1})]
    # ...while an https:// endpoint (private or regional) is Google's API and asks for them.
    with pytest.raises(
        BatchpilotError,
        match=r"^cluster.project: GOOGLE_APPLICATION_CREDENTIALS \(.*absent\.json\) holds no usable",
    ):
        container_client(api_endpoint="https://container.us-central1.rep.googleapis.com")
    for bad in ("127.0.0.1:8080", "grpc://127.0.0.1:8080", "http://127.0.0.1:8080/v1"):
        with pytest.raises(ValidationError, match="container_api_endpoint"):
            ClusterConfig(backend="gke", max_nodes=1, container_api_endpoint=bad)


def test_a_real_launch_sizes_unsized_pods_from_the_ready_nodes(kube, tmp_path, monkeypatch):
    use_kubeconfig(kube, tmp_path, monkeypatch)
    cluster = ClusterConfig(
        backend="gke", max_nodes=2, devices_per_node=8, node_pool="gpu", accelerator_type="nvidia-h100-80gb"
    )
    with pytest.raises(BatchpilotError, match=r"^cluster.node_pool: node pool 'gpu' has no usable node"):
        trainer_pod_resources(cluster, read_nodes=True)
    kube.state.node_snapshots = [[node("a", pool="gpu", gpus=8)]]  # 8 CPUs, 32Gi allocatable
    sized = trainer_pod_resources(cluster, read_nodes=True)
    assert (sized.cpu, sized.memory_bytes) == (8, 32 * 2**30)  # no DaemonSet pod runs on "a"
    with pytest.raises(BatchpilotError, match=r"^cluster.machine_type: is needed"):
        trainer_pod_resources(cluster, read_nodes=False)  # a dry run asks no API
