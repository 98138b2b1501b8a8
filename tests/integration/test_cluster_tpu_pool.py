"""TPU slice node pools through the real google-cloud-container and kubernetes clients, against the
simulated GKE cluster (Container API and Kubernetes API stand-ins with GKE's TPU rules)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_api_server import ContainerServer
from gke_sim import CLUSTER, LOCATION, PROJECT, SimulatedGke, simulated_gke
from google.api_core import exceptions
from google.cloud import container_v1
from kube_api_server import KubeServer, kube_server_running, node

from batchpilot.cluster.gke import ContainerCalls, PoolRef
from batchpilot.cluster.labels import CREATED_BY_LABEL
from batchpilot.cluster.nodepool import NodePool, node_pool_for
from batchpilot.cluster.readiness import TPU_RESOURCE, PoolNodes
from batchpilot.cluster.tpu_pool import TpuSlicePool
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.planning.launches import launches
from batchpilot.planning.tpu import tpu_slices
from batchpilot.workflow.pool import prepare_pool, scale_down

ZONE = f"{LOCATION}-b"
PARENT = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}"


@pytest.fixture
def gke() -> Iterator[SimulatedGke]:
    # Nodes register NotReady, then publish their chips a little later: readiness has to wait for both.
    with simulated_gke(ready_delay_s=0.15, gpu_delay_s=0.15) as cluster:
        yield cluster


def make_pool(
    gke: SimulatedGke,
    *,
    node_pool: str = "v6e",
    ready_timeout_s: float = 10,
    pool_mode: str = "resize",
    slice_change: str = "delete-first",
) -> TpuSlicePool:
    return TpuSlicePool(
        calls=ContainerCalls(
            client=gke.container.client(),
            operation_timeout_s=20,
            retry_initial_s=0.05,
            retry_maximum_s=0.1,
            poll_initial_s=0.02,
            poll_maximum_s=0.05,
        ),
        pool=PoolRef(PROJECT, LOCATION, CLUSTER, node_pool),
        slices=tpu_slices(
            accelerator_type="tpu-v6e-slice", machine_type="ct6e-standard-4t", devices_per_node=4
        ),
        zone=ZONE,
        api_client=gke.kube.api_client(),
        ready_timeout_s=ready_timeout_s,
        ready_poll_interval_s=0.05,
        pool_mode=pool_mode,
        slice_change=slice_change,
    )


def pools(gke: SimulatedGke) -> list[str]:
    return sorted(pool["name"] for pool in gke.container.state.pools.values())


def nodes_of(gke: SimulatedGke, pool: str) -> list[dict]:
    return [
        n for n in gke.sim.node_objects() if n["metadata"]["labels"]["cloud.google.com/gke-nodepool"] == pool
    ]


def writes(container: ContainerServer) -> list[tuple[str, str]]:
    """(method, pool name) of every create and delete request."""
    found = []
    for request in container.state.requests:
        if request.method == "POST" and request.path.endswith("/nodePools"):
            found.append(("create", (request.body or {})["nodePool"]["name"]))
        elif request.method == "DELETE":
            found.append(("delete", request.path.rsplit("/", 1)[-1]))
    return found


def create_by_hand(gke: SimulatedGke, name: str, *, topology: str, node_count: int) -> None:
    """A slice pool made without batchpilot (no CREATED_BY_LABEL), through the real client."""
    node_pool = container_v1.NodePool(
        name=name,
        initial_node_count=node_count,
        locations=[ZONE],
        config=container_v1.NodeConfig(machine_type="ct6e-standard-4t"),
        placement_policy=container_v1.NodePool.PlacementPolicy(tpu_topology=topology),
    )
    gke.container.client().create_node_pool(parent=PARENT, node_pool=node_pool)


def test_create_first_brings_each_slice_up_before_it_deletes_the_previous_one(gke):
    pool = make_pool(gke, slice_change="create-first")
    assert isinstance(pool, NodePool)
    for hosts, topology in ((2, "2x4"), (4, "4x4"), (8, "4x8")):
        pool.resize(hosts)
        assert pools(gke) == [f"v6e-{topology}"]
        nodes = nodes_of(gke, f"v6e-{topology}")
        assert len(nodes) == hosts and pool.current_size() == hosts
        for found in nodes:  # resize returned only once every host was Ready with its 4 chips
            labels = found["metadata"]["labels"]
            assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
            assert labels["cloud.google.com/gke-tpu-topology"] == topology
            assert labels[CREATED_BY_LABEL] == "v6e"
            assert found["status"]["allocatable"][TPU_RESOURCE] == "4"
            assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in found["spec"][
                "taints"
            ]
        pool.wait_ready(hosts, timeout_s=1)
    # The next slice was up before the previous one went: never fewer hosts than the stage had.
    assert gke.sim.pool_history == [
        ("v6e-2x4", 2),
        ("v6e-4x4", 4),
        ("v6e-2x4", 0),
        ("v6e-4x8", 8),
        ("v6e-4x4", 0),
    ]
    assert writes(gke.container) == [
        ("create", "v6e-2x4"),
        ("create", "v6e-4x4"),
        ("delete", "v6e-2x4"),
        ("create", "v6e-4x8"),
        ("delete", "v6e-4x4"),
    ]
    (create,) = [r for r in gke.container.state.requests if r.method == "POST"][-1:]
    assert create.body == {
        "nodePool": {
            "name": "v6e-4x8",
            "initialNodeCount": 8,
            "locations": [ZONE],
            "config": {"machineType": "ct6e-standard-4t", "labels": {CREATED_BY_LABEL: "v6e"}},
            "placementPolicy": {"tpuTopology": "4x8"},
        }
    }
    assert "v6e-4x8 (4x8, 8 host(s), batchpilot's): 8 node(s), 8 usable" in pool.describe()


def test_scaling_to_zero_deletes_only_the_slices_batchpilot_created(gke):
    gke.add_pool("cpu", machine_type="e2-standard-4", zones=[ZONE], per_zone=1)
    create_by_hand(gke, "v6e-8x8", topology="8x8", node_count=16)  # named like batchpilot's, made by hand
    pool = make_pool(gke)
    pool.resize(8)
    assert pools(gke) == ["cpu", "v6e-4x8", "v6e-8x8"]
    assert pool.current_size() == 8 + 16
    pool.resize(0)
    assert pools(gke) == ["cpu", "v6e-8x8"]
    assert (
        not nodes_of(gke, "v6e-4x8")
        and len(nodes_of(gke, "cpu")) == 1
        and len(nodes_of(gke, "v6e-8x8")) == 16
    )
    assert writes(gke.container)[-1] == ("delete", "v6e-4x8")
    pool.resize(0)  # nothing left to delete: no request
    assert writes(gke.container)[-1] == ("delete", "v6e-4x8") and len(writes(gke.container)) == 3


def test_a_rerun_finds_its_slice_and_creates_nothing(gke):
    make_pool(gke).resize(4)
    before = len(writes(gke.container))
    retry = make_pool(gke)  # a KFP retry: a new process, the same config
    assert retry.current_size() == 4
    retry.resize(4)
    retry.wait_ready(4, timeout_s=1)
    assert len(writes(gke.container)) == before and pools(gke) == ["v6e-4x4"]


def test_a_slice_made_by_hand_is_used_and_kept(gke, batchpilot_log):
    create_by_hand(gke, "v6e-2x4", topology="2x4", node_count=2)
    pool = make_pool(gke)
    pool.resize(2)
    pool.resize(4)
    assert pools(gke) == ["v6e-2x4", "v6e-4x4"]
    assert writes(gke.container) == [("create", "v6e-2x4"), ("create", "v6e-4x4")]  # the first by hand
    assert "batchpilot did not create it" in batchpilot_log.text


def test_a_host_count_that_forms_no_slice_is_refused_before_any_request(gke):
    with pytest.raises(BatchpilotError) as caught:
        make_pool(gke).resize(3)
    message = str(caught.value)
    assert message.startswith("cluster: 3 ct6e-standard-4t host(s) (12 chips) form no tpu-v6e-slice slice")
    assert "fix: use 2 host(s) (2x4, 8 chips) or 4 host(s) (4x4, 16 chips)" in message
    assert not writes(gke.container)


def test_a_pool_of_the_slice_name_with_another_shape_is_refused(gke):
    create_by_hand(gke, "v6e-4x4", topology="2x4", node_count=2)
    with pytest.raises(BatchpilotError, match=r"^cluster.node_pool: node pool v6e-4x4 exists as 2 ct6e"):
        make_pool(gke).resize(4)


def test_gke_refusing_the_create_is_one_line_naming_the_setting(gke):
    long_name = "a-node-pool-name-of-thirty-seven-chars"  # + "-2x4": 42 characters, GKE allows 40
    with pytest.raises(BatchpilotError) as caught:
        make_pool(gke, node_pool=long_name).resize(2)
    message = str(caught.value)
    assert message.startswith(
        f"cluster.node_pool: GKE refused to create node pool {long_name}-2x4: Invalid value"
    )
    assert "no longer than 40 characters" in message and "(fix: use a shorter cluster.node_pool" in message
    assert "\n" not in message
    assert pools(gke) == []


def test_the_stand_in_refuses_what_gke_refuses_for_tpu_slices(gke):
    client = gke.container.client()

    def create(name: str, **fields: object) -> None:
        spec = {"name": name, "locations": [ZONE], "config": {"machine_type": "ct6e-standard-4t"}, **fields}
        client.create_node_pool(parent=PARENT, node_pool=container_v1.NodePool(spec))

    with pytest.raises(
        exceptions.BadRequest, match="Node count 3 is not a valid size of TPU pod slice with topology 4x8"
    ):
        create("a", initial_node_count=3, placement_policy={"tpu_topology": "4x8"})
    with pytest.raises(
        exceptions.BadRequest, match=r"tpu_topology.*\"3x3\" is not a topology of ct6e-standard-4t"
    ):
        create("b", initial_node_count=2, placement_policy={"tpu_topology": "3x3"})
    with pytest.raises(exceptions.BadRequest, match="must be in exactly one zone"):
        create(
            "c",
            initial_node_count=2,
            placement_policy={"tpu_topology": "2x4"},
            locations=[ZONE, f"{LOCATION}-c"],
        )
    create("slice", initial_node_count=8, placement_policy={"tpu_topology": "4x8"})
    with pytest.raises(exceptions.Conflict, match="Already exists"):
        create("slice", initial_node_count=8, placement_policy={"tpu_topology": "4x8"})
    name = f"{PARENT}/nodePools/slice"
    for count in (16, 0, 8):  # a multi-host slice cannot be resized, not even to its own size
        with pytest.raises(exceptions.BadRequest, match=r"multi-host TPU slice .* cannot be resized"):
            client.set_node_pool_size(request={"name": name, "node_count": count})
    with pytest.raises(
        exceptions.BadRequest, match="Maximum node count 0 is not a valid size of TPU pod slice"
    ):
        client.set_node_pool_autoscaling(
            request={"name": name, "autoscaling": {"enabled": True, "total_max_node_count": 8}}
        )
    client.set_node_pool_autoscaling(
        request={"name": name, "autoscaling": {"enabled": True, "max_node_count": 8}}
    )
    # A single-host slice pool is an ordinary pool: each node is a slice of its own.
    create("single", initial_node_count=3, placement_policy={"tpu_topology": "2x2"})
    client.set_node_pool_size(request={"name": f"{PARENT}/nodePools/single", "node_count": 1})
    assert len(nodes_of(gke, "slice")) == 8
    client.delete_node_pool(request={"name": name})
    assert not nodes_of(gke, "slice") and "slice" not in gke.sim.pools


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    with kube_server_running() as server:
        yield server


def tpu_node(name: str, *, chips: int, ready: bool = True) -> dict:
    found = node(name, pool="v6e-2x4", ready=ready)
    found["status"]["allocatable"][TPU_RESOURCE] = str(chips)
    return found


def test_readiness_counts_the_tpu_chips_not_gpus(kube):
    gpu_node = node("g", pool="v6e-2x4", gpus=8)  # GPUs are no TPU chips
    kube.state.node_snapshots = [[tpu_node("a", chips=0), tpu_node("b", chips=4, ready=False), gpu_node]]
    nodes = PoolNodes(
        api_client=kube.api_client(), node_pool="v6e-2x4", gpus_per_node=4, device_resource=TPU_RESOURCE
    )
    with pytest.raises(BatchpilotError) as caught:
        nodes.wait(2, timeout_s=0.1, poll_interval_s=0.02)
    message = str(caught.value)
    assert "0 of 2 node(s) usable" in message
    assert "a has 0 of 4 google.com/tpu allocatable" in message and "b is not Ready" in message
    assert "g has 0 of 4 google.com/tpu allocatable" in message
    kube.state.node_snapshots = [[tpu_node("a", chips=4), tpu_node("b", chips=4)]]
    assert [state.name for state in nodes.wait(2, timeout_s=1, poll_interval_s=0.02)] == ["a", "b"]


def tpu_config(**cluster: object) -> dict:
    return {
        "name": "tputest",
        "data": {"uri": "gs://bucket/data", "seq_len": 32},
        "cluster": {
            "backend": "gke",
            "devices_per_node": 4,
            "max_nodes": 8,
            "project": PROJECT,
            "location": ZONE,
            "cluster_name": CLUSTER,
            "node_pool": "v6e",
            "image": "registry.example/batchpilot:0.1.0",
            "accelerator_type": "tpu-v6e-slice",
            "machine_type": "ct6e-standard-4t",
            "ready_timeout_s": 20,
            "operation_timeout_s": 20,
            **cluster,
        },
        "batch": {"global_batch_size": 64, "micro_batch_size": 16},
        "train": {"total_samples": 2048, "lr": 1e-3, "checkpoint_uri": "gs://bucket/ckpt"},
    }


def test_the_pipeline_steps_drive_tpu_slices_from_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with simulated_gke() as gke:
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        gke.container.state.polls_until_done = 0
        # The cluster is zonal: its location is the slices' zone (the paths use it as the location).
        config = parse_config(tpu_config(container_api_endpoint=gke.container.endpoint))
        assert isinstance(node_pool_for(config), TpuSlicePool)
        change = prepare_pool(config, num_nodes=4)
        assert (change.before, change.after) == (0, 4) and "v6e-4x4" in change.description
        assert pools(gke) == ["v6e-4x4"] and len(nodes_of(gke, "v6e-4x4")) == 4
        down = scale_down(config)  # the exit handler: JobSets of the run first, then every slice
        assert (down.before, down.after) == (4, 0) and pools(gke) == [] and not gke.sim.node_objects()


def test_settings_a_tpu_slice_cannot_have_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with simulated_gke() as gke:
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        endpoint = gke.container.endpoint
        for cluster, error in (
            ({"location": LOCATION}, r"^cluster.tpu_zone: a TPU slice node pool lives in one zone"),
            ({"devices_per_node": 8}, r"^cluster.devices_per_node: 8 is not the chips per host"),
        ):
            with pytest.raises(BatchpilotError, match=error):
                node_pool_for(parse_config(tpu_config(container_api_endpoint=endpoint, **cluster)))
        assert not gke.container.state.requests


def test_autoscale_mode_bounds_each_premade_slice_pool_to_none_or_one_slice(gke):
    for topology in ("2x4", "4x4"):  # made beforehand, empty, one per shape
        create_by_hand(gke, f"v6e-{topology}", topology=topology, node_count=0)
    made = len(writes(gke.container))
    pool = make_pool(gke, pool_mode="autoscale")
    pool.resize(2)
    pool.wait_ready(2, timeout_s=1)  # the hosts come with the pending pods: only the bounds are checked
    with pytest.raises(BatchpilotError, match=r"^cluster.pool_mode: v6e-4x4 autoscales to at most 0 node"):
        pool.wait_ready(4, timeout_s=1)
    pool.resize(4)
    pool.wait_ready(4, timeout_s=1)
    scaling = [
        (r.path.rsplit("/", 1)[-1], r.body)
        for r in gke.container.state.requests
        if "setAutoscaling" in r.path
    ]
    assert scaling == [  # the per-zone maximum GKE checks for a slice; the minimum is 0 (unset)
        ("v6e-2x4:setAutoscaling", {"autoscaling": {"enabled": True, "maxNodeCount": 2}}),
        ("v6e-4x4:setAutoscaling", {"autoscaling": {"enabled": True, "maxNodeCount": 4}}),
    ]
    with pytest.raises(
        BatchpilotError, match=r"^cluster.pool_mode: autoscale mode uses a slice pool made beforehand"
    ):
        pool.resize(8)
    pool.resize(0)  # the autoscaler removes idle slices: nothing to write
    assert len(writes(gke.container)) == made and len(scaling) == 2
    assert pools(gke) == ["v6e-2x4", "v6e-4x4"]


def test_static_mode_only_checks_the_premade_slice(gke):
    create_by_hand(gke, "v6e-2x4", topology="2x4", node_count=2)
    pool = make_pool(gke, pool_mode="static")
    pool.resize(2)
    pool.resize(0)
    with pytest.raises(
        BatchpilotError, match=r"^cluster.pool_mode: static mode uses a slice pool made beforehand"
    ):
        pool.resize(4)
    assert pools(gke) == ["v6e-2x4"] and len(nodes_of(gke, "v6e-2x4")) == 2
    assert writes(gke.container) == [("create", "v6e-2x4")]  # the one made by hand
    assert not [r for r in gke.container.state.requests if ":set" in r.path]


def test_a_create_and_a_delete_that_meet_another_operation_are_retried(gke, batchpilot_log):
    pool = make_pool(gke)
    gke.container.state.conflicts = 2
    pool.resize(2)
    gke.container.state.conflicts = 1
    pool.resize(0)
    assert writes(gke.container) == [("create", "v6e-2x4")] * 3 + [("delete", "v6e-2x4")] * 2
    assert pools(gke) == [] and batchpilot_log.text.count("retrying") == 3


def test_the_next_launchs_slice_comes_up_beside_the_current_one_and_its_resize_only_deletes_the_old(gke):
    """cluster.capacity_ahead with create-first: the 4x4 slice of the next launch is brought up while the 2x4
    slice still trains (both there), and the next launch's resize creates nothing, only deletes the 2x4."""
    pool = make_pool(gke, slice_change="create-first")
    pool.resize(2)
    assert pool.create_ahead(4) == 6  # both slices' hosts up
    assert pools(gke) == ["v6e-2x4", "v6e-4x4"]
    assert len(nodes_of(gke, "v6e-2x4")) == 2 and len(nodes_of(gke, "v6e-4x4")) == 4
    pool.resize(4)
    assert pools(gke) == ["v6e-4x4"]
    assert writes(gke.container) == [("create", "v6e-2x4"), ("create", "v6e-4x4"), ("delete", "v6e-2x4")]


def test_a_slice_ahead_is_refused_with_delete_first(gke):
    pool = make_pool(gke)  # delete-first: the quota may hold one slice only
    pool.resize(2)
    with pytest.raises(BatchpilotError, match=r"cluster.tpu_slice_change: is delete-first .* create-first"):
        pool.create_ahead(4)
    assert pools(gke) == ["v6e-2x4"]


def test_the_ahead_step_brings_up_the_next_launchs_slice_once_the_trainers_progress_says_it_is_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gcs_bucket: str
):
    """cluster.capacity_ahead on TPU slices (create-first) through the pipeline's step: launch-0 trains on a
    2x4 slice; once its trainer's progress record (in the run's bucket) leaves less than the lead, the step
    brings up final's 4x4 beside it and records an early pool event; the slice launch-0 trains on stays."""
    from batchpilot import runstate
    from batchpilot.plan.planner import make_run_document
    from batchpilot.workflow import ahead
    from batchpilot.workflow.ahead import bring_next_nodes

    monkeypatch.setattr(ahead, "END_POLL_S", 0.1)
    with simulated_gke() as gke:
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        gke.container.state.polls_until_done = 0
        raw = tpu_config(container_api_endpoint=gke.container.endpoint, tpu_slice_change="create-first")
        raw["batch"].update(schedule="0:128 1024:256", global_batch_size=256)
        raw["train"]["checkpoint_uri"] = f"gs://{gcs_bucket}/ckpt"
        raw["explore"] = {"study": False}
        document = make_run_document(parse_config(raw))
        first, following = [(s.first_stage, s.last_stage, s.num_nodes) for s in launches(document.plan)]
        assert (first[2], following[2]) == (2, 4)
        prepare_pool(document.config, num_nodes=2)  # launch-0's slice, as its resize task left it
        end = document.plan.stages[first[1]].end_sample
        runstate.write_progress(
            document.config.train.checkpoint_uri,
            stages=[first[0], first[1]],
            progress={"consumed": end - 100, "at_s": time.time(), "samples_per_s": 100.0},  # 1 s left
        )
        said = bring_next_nodes(document, launch_index=0, poll_s=0.1)
        assert "slice of 4 host(s) is up beside this launch's (2 -> 6 node(s))" in said, said
        assert pools(gke) == ["v6e-2x4", "v6e-4x4"]
        early = [
            e
            for e in runstate.read_events(document.config.train.checkpoint_uri, kind="pool")
            if e.get("early")
        ]
        assert [(e["before"], e["after"]) for e in early] == [(2, 6)]
