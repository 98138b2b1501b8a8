"""The pure parts of TPU slice pools: the zone, GKE's refusals as one line, readiness by google.com/tpu."""

from __future__ import annotations

import pytest
from kubernetes import client

from batchpilot.cluster.readiness import GPU_RESOURCE, TPU_RESOURCE, NodeState, _node_state
from batchpilot.cluster.tpu_pool import _refused, tpu_node_pool, tpu_zone
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError


def tpu_cluster(**fields: object) -> ClusterConfig:
    settings: dict = {
        "backend": "gke", "devices_per_node": 4, "max_nodes": 8, "project": "p", "location": "us-east5-b",
        "cluster_name": "c", "node_pool": "v6e", "image": "img", "accelerator_type": "tpu-v6e-slice",
        "machine_type": "ct6e-standard-4t",
    }  # fmt: skip
    return ClusterConfig(**{**settings, **fields})


def test_the_slices_live_in_the_zonal_location_or_the_configured_zone():
    assert tpu_zone(tpu_cluster()) == "us-east5-b"
    with pytest.raises(BatchpilotError) as caught:
        tpu_zone(tpu_cluster(location="us-east5"))
    assert str(caught.value) == (
        "cluster.tpu_zone: a TPU slice node pool lives in one zone and cluster.location 'us-east5' is a region "
        "(fix: set cluster.tpu_zone to a zone of us-east5 that offers tpu-v6e-slice)"
    )
    # cluster.tpu_zone takes over the location.
    assert tpu_zone(tpu_cluster(location="us-east5", tpu_zone="us-east5-c")) == "us-east5-c"


def test_gke_refusals_become_one_line_naming_the_setting():
    message = (
        "POST http://127.0.0.1:1/v1/projects/p/locations/l/clusters/c/nodePools?%24alt=json: Invalid value for\n"
        'field "node_pool.name": "x". Must be a match of regex ...'
    )
    error = _refused("create node pool x", message, pool_name="x")
    assert str(error).startswith(
        'cluster.node_pool: GKE refused to create node pool x: Invalid value for field "node_pool.name"'
    )
    assert "\n" not in str(error) and "POST" not in str(error)
    other = _refused("create node pool x", "Node count 3 is not a valid size of TPU pod slice", pool_name="x")
    assert other.field == "cluster" and "Node count 3" in other.problem


def test_a_slice_pool_needs_the_machine_type_of_its_tpu_and_the_gke_settings():
    with pytest.raises(
        BatchpilotError, match=r"^cluster.machine_type: 'ct5p-hightpu-4t' is not a machine type"
    ):
        tpu_node_pool(tpu_cluster(machine_type="ct5p-hightpu-4t"))
    with pytest.raises(BatchpilotError, match=r"^cluster.image: is required"):
        tpu_node_pool(tpu_cluster(image=None))


def v1_node(allocatable: dict[str, str]) -> client.V1Node:
    return client.V1Node(
        metadata=client.V1ObjectMeta(name="n"),
        spec=client.V1NodeSpec(),
        status=client.V1NodeStatus(
            conditions=[client.V1NodeCondition(type="Ready", status="True")],
            allocatable={"cpu": "180", "memory": "700Gi", **allocatable},
        ),
    )


def test_a_tpu_node_is_usable_by_its_chips_and_a_gpu_node_by_its_gpus():
    tpu = _node_state(v1_node({TPU_RESOURCE: "4"}), device_resource=TPU_RESOURCE)
    assert tpu.allocatable_devices == 4 and tpu.problem(gpus_per_node=4) is None
    assert tpu.problem(gpus_per_node=8) == "n has 4 of 8 google.com/tpu allocatable"
    unpublished = _node_state(v1_node({GPU_RESOURCE: "8"}), device_resource=TPU_RESOURCE)
    assert unpublished.problem(gpus_per_node=4) == "n has 0 of 4 google.com/tpu allocatable"
    gpu = _node_state(v1_node({GPU_RESOURCE: "8", TPU_RESOURCE: "4"}))  # the default: GPUs, as before
    assert gpu.allocatable_devices == 8 and gpu.problem(gpus_per_node=8) is None
    cpu_only = NodeState("c", True, False, 0, 1000, 2**30)
    assert cpu_only.problem(gpus_per_node=0) is None
