"""Pools labelled with their run, the run's Lease, and orphaned pools, against the simulated GKE cluster
(the real google-cloud-container and kubernetes clients on the Container API and Kubernetes API
stand-ins)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
from gke_sim import SimulatedGke, simulated_gke

from batchpilot.cli import main
from batchpilot.cluster.labels import IDLE_POOL_LABEL, RUN_POOL_LABEL
from batchpilot.cluster.ownership import lease_name, renew_lease
from batchpilot.config import Config, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.workflow.pool import prepare_pool, scale_down

NS = "batchpilot"


@pytest.fixture
def gke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        cluster.add_pool("gpu", machine_type="a3-highgpu-8g")
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield cluster


def config_of(gke: SimulatedGke, name: str, *, idle_nodes: int = 0) -> Config:
    return parse_config({
        "name": name,
        "data": {"uri": "gs://bucket/data", "seq_len": 128},
        "cluster": {
            "backend": "gke", "devices_per_node": 8, "max_nodes": 2, "idle_nodes": idle_nodes,
            "project": "proj", "location": "us-central1", "cluster_name": "train", "node_pool": "gpu",
            "image": "registry.example/batchpilot:0.1.0", "machine_type": "a3-highgpu-8g",
            "accelerator_type": "nvidia-h100-80gb", "namespace": NS, "ready_timeout_s": 10,
            "container_api_endpoint": gke.container.endpoint, "orphan_ttl_s": 600,
        },
        "batch": {"global_batch_size": 64, "micro_batch_size": 4},
        "train": {"total_samples": 640, "lr": 1e-3, "checkpoint_uri": "gs://bucket/ckpt"},
    })  # fmt: skip


def labels(gke: SimulatedGke) -> dict[str, str]:
    pool = gke.container.client().get_node_pool(name=gke.pool_path("gpu"))
    return dict(pool.config.resource_labels)


def leases(gke: SimulatedGke) -> list[str]:
    return sorted(name for _, name in gke.kube.state.leases)


def expire(gke: SimulatedGke, run: str) -> None:
    """The run's Lease as its last renewal left it, an hour ago (nothing renews it any more)."""
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    renew_lease(gke.kube.api_client(), namespace=NS, run=run, ttl_s=600, now=lambda: an_hour_ago)


def test_a_resize_labels_the_pool_with_its_run_and_the_end_of_the_run_releases_it(gke):
    config = config_of(gke, "alpha", idle_nodes=1)
    prepare_pool(config, num_nodes=2)
    assert labels(gke) == {RUN_POOL_LABEL: "alpha", IDLE_POOL_LABEL: "1"}
    assert leases(gke) == ["batchpilot-run-alpha"]
    lease = gke.kube.state.leases[(NS, "batchpilot-run-alpha")]["spec"]
    assert lease["holderIdentity"] == "alpha" and lease["leaseDurationSeconds"] >= 600
    scale_down(config)
    assert gke.sim.pool_size("gpu") == 1 and labels(gke) == {} and leases(gke) == []


def test_a_pool_of_another_live_run_is_refused_and_an_orphaned_one_taken_over(gke):
    prepare_pool(config_of(gke, "alpha"), num_nodes=2)
    with pytest.raises(BatchpilotError, match=r"gpu belongs to run alpha, which is still alive \(Lease "):
        prepare_pool(config_of(gke, "beta"), num_nodes=1)
    assert gke.sim.pool_size("gpu") == 2 and labels(gke)[RUN_POOL_LABEL] == "alpha"
    expire(gke, "alpha")  # alpha's exit hook never ran
    prepare_pool(config_of(gke, "beta"), num_nodes=1)
    assert gke.sim.pool_size("gpu") == 1 and labels(gke)[RUN_POOL_LABEL] == "beta"


def test_pool_scale_down_orphaned_scales_down_only_pools_whose_run_is_gone(gke, tmp_path, capsys):
    prepare_pool(config_of(gke, "alpha", idle_nodes=1), num_nodes=2)
    config_path = tmp_path / "other.yaml"
    config_path.write_text(config_of(gke, "other").model_dump_json())
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpu: run alpha is alive (Lease ")
    assert gke.sim.pool_size("gpu") == 2
    expire(gke, "alpha")
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"gpu: orphaned by run alpha (Lease {lease_name('alpha')} expired); scaled down 2 -> 1 node(s)"
    )
    assert gke.sim.pool_size("gpu") == 1 and labels(gke) == {} and leases(gke) == []


def test_the_container_api_stand_in_refuses_labels_gcp_does_not_accept(gke):
    from google.api_core import exceptions
    from google.cloud import container_v1

    request = container_v1.UpdateNodePoolRequest(
        name=gke.pool_path("gpu"), resource_labels=container_v1.ResourceLabels(labels={"Run": "x"})
    )
    with pytest.raises(exceptions.BadRequest, match=r"resource_labels\.key"):
        gke.container.client().update_node_pool(request=request)


def tpu_config_of(gke: SimulatedGke, name: str) -> Config:
    return parse_config({
        "name": name,
        "data": {"uri": "gs://bucket/data", "seq_len": 128},
        "cluster": {
            "backend": "gke", "devices_per_node": 4, "max_nodes": 2, "project": "proj",
            "location": "us-central1", "tpu_zone": "us-central1-a", "cluster_name": "train", "node_pool": "v6e",
            "image": "registry.example/batchpilot:0.1.0", "accelerator_type": "tpu-v6e-slice",
            "machine_type": "ct6e-standard-4t", "cpu_per_node": 170, "memory_per_node_bytes": "680GiB",
            "namespace": NS, "ready_timeout_s": 10, "container_api_endpoint": gke.container.endpoint,
            "orphan_ttl_s": 600,
        },
        "batch": {"global_batch_size": 64, "micro_batch_size": 4},
        "train": {"total_samples": 640, "lr": 1e-3, "checkpoint_uri": "gs://bucket/ckpt", "parallelism": "fsdp"},
    })  # fmt: skip


def test_an_orphaned_tpu_slice_is_deleted_and_a_live_runs_slice_left(gke, tmp_path, capsys):
    prepare_pool(tpu_config_of(gke, "alpha"), num_nodes=2)  # the 2x4 slice: a pool of its own
    slice_labels = dict(
        gke.container.client().get_node_pool(name=gke.pool_path("v6e-2x4")).config.resource_labels
    )
    assert slice_labels == {RUN_POOL_LABEL: "alpha", IDLE_POOL_LABEL: "0"}
    assert leases(gke) == ["batchpilot-run-alpha"]
    config_path = tmp_path / "other.yaml"
    config_path.write_text(config_of(gke, "other").model_dump_json())
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert "v6e-2x4: run alpha is alive (Lease " in capsys.readouterr().out
    assert gke.sim.pool_size("v6e-2x4") == 2
    expire(gke, "alpha")  # alpha's exit hook never ran
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert (
        f"v6e-2x4: TPU slice orphaned by run alpha (Lease {lease_name('alpha')} expired); deleted"
        in capsys.readouterr().out.splitlines()
    )
    assert "v6e-2x4" not in gke.sim.pools and leases(gke) == []


def test_an_orphaned_autoscaled_pool_gets_its_bounds_set_to_the_idle_size(gke, tmp_path, capsys):
    prepare_pool(config_of(gke, "alpha", idle_nodes=1), num_nodes=2)
    full = gke.pool_path("gpu")
    gke.container.state.pools[full]["autoscaling"] = {"enabled": True, "totalMaxNodeCount": 2}
    expire(gke, "alpha")
    config_path = tmp_path / "other.yaml"
    config_path.write_text(config_of(gke, "other").model_dump_json())
    assert main(["pool", "scale-down", "--orphaned", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpu: orphaned by run alpha (")
    scaling = gke.container.state.pools[full]["autoscaling"]
    assert (scaling["totalMinNodeCount"], scaling["totalMaxNodeCount"]) == (1, 1)
    assert not [
        r for r in gke.container.state.requests if r.path.endswith(":setSize") and r.body["nodeCount"] == 1
    ]


def test_a_kueue_queue_whose_quota_can_never_hold_the_launch_refuses_before_the_pool_is_touched(gke):
    """Issue #37: with `cluster.kueue_queue`, the LocalQueue's ClusterQueue is read before any node is asked
    for; a launch its quota can never hold would wait for ever, so it is refused in one line, pool untouched."""
    from kueue_controller import KueueController

    kueue = KueueController()
    kueue.add_flavor("h100", node_labels={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"})
    kueue.add_cluster_queue("team", quota={"h100": {"nvidia.com/gpu": "8"}})
    kueue.add_local_queue(NS, "team-a", cluster_queue="team")
    gke.sim.kueue = kueue
    base = config_of(gke, "alpha")
    config = base.model_copy(update={"cluster": base.cluster.model_copy(update={"kueue_queue": "team-a"})})
    calls = len(gke.container.state.requests)
    with pytest.raises(BatchpilotError) as refused:
        prepare_pool(config, num_nodes=2)
    assert str(refused.value).startswith(
        "cluster.kueue_queue: a launch on 2 node(s) asks LocalQueue team-a for nvidia.com/gpu 16; ClusterQueue team "
        "can never hold it: flavor h100: nvidia.com/gpu 16 > 8"
    )
    assert gke.container.state.requests[calls:] == [] and gke.sim.pool_size("gpu") == 0
    assert labels(gke) == {} and leases(gke) == []  # not claimed either
    prepare_pool(config, num_nodes=1)  # 8 GPUs: the quota holds it
    assert gke.sim.pool_size("gpu") == 1
