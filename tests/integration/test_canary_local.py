"""The canary as the local pipeline runs it: a real 2-node x 1-process torchx local_cwd job over gloo.

Each test starts two torchrun agents (one per "node"); their start-up dominates the 6-8 s each takes, so
the module is `slow`, as every torchrun test is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.storage import open_storage
from batchpilot.workflow.canary import canary, read_canary
from helpers import tiny_config

pytestmark = pytest.mark.slow


def local_config(tmp_path: Path, *, data_uri: str, checkpoint_uri: str):
    config = tiny_config(data_uri=data_uri, checkpoint_uri=checkpoint_uri)
    config["cluster"]["pool_state_path"] = str(tmp_path / "pool.json")
    return parse_config(config)


def test_a_two_node_canary_writes_its_figures_beside_the_checkpoints(tmp_path, demo_data_uri, batchpilot_log):
    config = local_config(tmp_path, data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt")
    metrics = canary(config, work_dir=tmp_path / "work")
    summary = json.loads((tmp_path / "ckpt" / "canary" / "canary.json").read_text())
    assert (summary["num_nodes"], summary["processes_per_node"], summary["backend"]) == (2, 1, "gloo")
    assert summary["all_reduce_bytes"] == 4 * 2**20 and summary["bus_bandwidth_bytes_per_s"] > 0
    assert summary["expected_bus_bandwidth_bytes_per_s"] is None  # a local pool has no machine type
    assert [n["node"] for n in summary["nodes"]] == [0, 1]
    for node in summary["nodes"]:
        assert node["read_bytes"] > 0 and node["read_mb_per_s"] > 0, node
        assert node["checkpoint_write_ms"] > 0 and node["checkpoint_read_ms"] > 0, node
    assert sorted(p.name for p in (tmp_path / "ckpt" / "canary").iterdir()) == [
        "canary.json"
    ]  # probes deleted
    assert metrics["num_nodes"] == 2 and metrics["bus_bandwidth_gb_per_s"] == pytest.approx(
        summary["bus_bandwidth_bytes_per_s"] / 1e9
    )
    assert any(
        r.getMessage().startswith("canary: 2 node(s) x 1 process(es) passed") for r in batchpilot_log.records
    )
    assert read_canary(config) == summary  # what the report reads


def test_a_checkpoint_uri_that_cannot_be_written_fails_with_one_line_naming_it(tmp_path, demo_data_uri):
    (tmp_path / "afile").write_text("not a folder")
    checkpoint_uri = f"file://{tmp_path}/afile/ckpt"
    config = local_config(tmp_path, data_uri=demo_data_uri, checkpoint_uri=checkpoint_uri)
    with pytest.raises(BatchpilotError) as failed:
        canary(config, work_dir=tmp_path / "work")
    message = str(failed.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("canary: node 0 (rank 0, host ")
    assert f"{checkpoint_uri}/canary/probe-node0-" in message and "Not a directory" in message


def test_missing_data_shards_fail_the_canary_with_one_line_naming_the_data_uri(tmp_path, demo_data_uri):
    data = tmp_path / "data"
    shutil.copytree(demo_data_uri.removeprefix("file://"), data)
    (shard,) = data.glob("train-*.bin")
    shard.unlink()
    config = local_config(tmp_path, data_uri=f"file://{data}", checkpoint_uri=f"file://{tmp_path}/ckpt")
    with pytest.raises(BatchpilotError) as failed:
        canary(config, work_dir=tmp_path / "work")
    message = str(failed.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("canary: node 0 (rank 0, host ")
    assert f"file://{shard}: is listed in the manifest but does not exist" in message
    assert not (tmp_path / "ckpt" / "canary" / "canary.json").exists()


def test_a_canary_on_gcs_reads_and_writes_through_the_emulator(
    tmp_path, demo_data_uri, gcs_client, gcs_bucket
):
    local, remote = open_storage(demo_data_uri), open_storage(f"gs://{gcs_bucket}/data")
    for name in local.list():
        remote.write(name, local.read(name))
    config = local_config(
        tmp_path, data_uri=f"gs://{gcs_bucket}/data", checkpoint_uri=f"gs://{gcs_bucket}/ckpt"
    )
    metrics = canary(config, work_dir=tmp_path / "work")
    assert metrics["min_read_mb_per_s"] > 0 and metrics["max_checkpoint_write_ms"] > 0
    assert open_storage(f"gs://{gcs_bucket}/ckpt/canary").list() == ["canary.json"]


def test_a_bus_bandwidth_below_half_the_expected_figure_fails_the_canary_after_writing_its_figures(
    tmp_path, demo_data_uri, monkeypatch
):
    """The ranks compare the measured bus bandwidth with the spec's figure: far below it (here an expected
    figure no loopback reaches) the canary fails with the rank's one line, and canary.json keeps the figures."""
    from batchpilot.cluster import canary as cluster_canary

    real = cluster_canary.canary_spec

    def expecting_a_fabric(config, *, num_nodes):
        return {**real(config, num_nodes=num_nodes), "expected_bus_bandwidth_bytes_per_s": 1e15}

    monkeypatch.setattr(cluster_canary, "canary_spec", expecting_a_fabric)
    config = local_config(tmp_path, data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt")
    with pytest.raises(BatchpilotError) as failed:
        canary(config, work_dir=tmp_path / "work")
    message = str(failed.value)
    assert len(message.splitlines()) == 1 and "all-reduce bus bandwidth" in message, message
    assert "of the 1000000 GB/s expected (below 50%)" in message, message
    summary = read_canary(config)
    assert summary is not None and summary["bandwidth_problem"] is not None
