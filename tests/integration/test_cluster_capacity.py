"""What a GPU pool does when the cloud has fewer machines than a stage asks for: a stockout, a quota, an
autoscaled pool in resize mode, and TPU slices that must not need quota for two slices at once.

Through the real google-cloud-container and kubernetes clients against the simulated cluster, whose
Container API enforces Compute Engine's stockout and quota rules (container_api_server.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from gke_sim import CLUSTER, LOCATION, PROJECT, SimulatedGke, simulated_gke
from test_cluster_tpu_pool import make_pool

from batchpilot.cluster.gke import GkeNodePool, PoolRef
from batchpilot.cluster.readiness import TPU_RESOURCE, PoolNodes
from batchpilot.errors import BatchpilotError

ZONES = ["us-central1-a", "us-central1-b"]


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g", zones=ZONES)
        yield cluster


def gpu_pool(gke: SimulatedGke, *, mode: str = "resize") -> GkeNodePool:
    return GkeNodePool(
        client=gke.container.client(),
        pool=PoolRef(PROJECT, LOCATION, CLUSTER, "gpu"),
        pool_mode=mode,
        idle_nodes=0,
        nodes=PoolNodes(api_client=gke.kube.api_client(), node_pool="gpu", gpus_per_node=8),
        operation_timeout_s=10,
        retry_initial_s=0.05,
        retry_maximum_s=0.1,
        poll_initial_s=0.02,
        poll_maximum_s=0.05,
        ready_poll_interval_s=0.05,
    )


def set_sizes(gke: SimulatedGke) -> list[int]:
    return [r.body["nodeCount"] for r in gke.container.state.requests if r.path.endswith(":setSize")]


def test_a_stockout_ends_the_readiness_wait_naming_the_zone_and_the_shortfall(gke, batchpilot_log):
    gke.container.state.zone_capacity = {"us-central1-b": 0}  # no a3 VM left in zone b
    pool = gpu_pool(gke)
    pool.resize(4)  # setSize itself succeeds: the instance group asks for 2 per zone
    assert set_sizes(gke) == [2] and pool.current_size() == 2
    with pytest.raises(BatchpilotError) as caught:
        pool.wait_ready(4, timeout_s=0.5)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        "cluster.ready_timeout_s: node pool 'gpu': 2 of 4 node(s)"
    )
    assert (
        "GCE_STOCKOUT: ZONE_RESOURCE_POOL_EXHAUSTED: The zone 'projects/proj/zones/us-central1-b'" in message
    )
    warnings = [r.getMessage() for r in batchpilot_log.records if r.levelno == logging.WARNING]
    assert sum("GCE_STOCKOUT" in w for w in warnings) == 1  # said once as it appeared, not at every poll


def test_a_quota_below_the_stage_is_one_line_naming_the_quota_and_nothing_grows(gke):
    gke.container.state.accelerator_quota = {"nvidia-h100-80gb": 16}  # two a3-highgpu-8g nodes
    pool = gpu_pool(gke)
    with pytest.raises(BatchpilotError) as caught:
        pool.resize(4)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("cluster.max_nodes: GKE refused to resize")
    assert "resource \"NVIDIA_H100_GPUS\": request requires '32.0' and is short '16.0'" in message
    assert "request more of that quota" in message
    assert pool.current_size() == 0
    pool.resize(2)  # within the quota
    pool.wait_ready(2, timeout_s=5)


def test_resize_mode_on_an_autoscaled_pool_is_refused_before_any_write(gke):
    gke.container.state.pools[gke.pool_path("gpu")]["autoscaling"] = {"enabled": True, "maxNodeCount": 4}
    with pytest.raises(
        BatchpilotError, match=r"^cluster.pool_mode: resize mode sets the size of gpu, but its autosc"
    ):
        gpu_pool(gke).resize(2)
    assert set_sizes(gke) == []


def test_the_stand_in_refuses_set_size_on_an_autoscaled_pool(gke):
    from google.api_core import exceptions

    gke.container.state.pools[gke.pool_path("gpu")]["autoscaling"] = {"enabled": True, "maxNodeCount": 4}
    with pytest.raises(exceptions.BadRequest, match="has autoscaling enabled"):
        gke.container.client().set_node_pool_size(request={"name": gke.pool_path("gpu"), "node_count": 1})


def test_a_slice_change_deletes_the_previous_slice_first_so_quota_for_one_slice_suffices(gke):
    gke.container.state.accelerator_quota = {"tpu-v6e-slice": 32}  # one 4x8 slice, not a 4x4 beside it
    pool = make_pool(gke, slice_change="delete-first")
    for hosts in (2, 4, 8):
        pool.resize(hosts)
        (state,) = pool.slice_pools()
        assert state.node_count == hosts
    assert gke.sim.pool_history[1:] == [  # after the fixture's gpu pool
        ("v6e-2x4", 2),
        ("v6e-2x4", 0),
        ("v6e-4x4", 4),
        ("v6e-4x4", 0),
        ("v6e-4x8", 8),
    ]
    nodes = [n for n in gke.sim.node_objects() if n["status"]["allocatable"].get(TPU_RESOURCE) == "4"]
    assert len(nodes) == 8


def test_create_first_needs_quota_for_both_slices_and_says_so(gke):
    gke.container.state.accelerator_quota = {"tpu-v6e-slice": 32}
    pool = make_pool(gke, slice_change="create-first")
    pool.resize(4)  # 4x4: 16 chips
    with pytest.raises(BatchpilotError) as caught:
        pool.resize(8)  # 4x8 beside the 4x4: 48 chips
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        "cluster.max_nodes: GKE refused to create node pool v6e-4x8"
    )
    assert "request requires '32.0' and is short '16.0'" in message
    assert [state.name for state in pool.slice_pools()] == ["v6e-4x4"]  # the previous slice is kept
