"""The local node pool and `batchpilot pool`: sizes recorded in a file, capacity refused clearly."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.cluster.nodepool import LocalNodePool, NodePool, available_cpus, node_pool_for
from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError


def config_dict(root: Path, **cluster: object) -> dict:
    """A local config whose checkpoints (and the ledger's pool events beside them) go under `root`."""
    return {
        "name": "pooltest",
        "data": {"uri": "file://data", "seq_len": 32},
        "cluster": {"devices_per_node": 1, "max_nodes": 2, **cluster},
        "batch": {"global_batch_size": 64, "micro_batch_size": 16},
        "train": {"total_samples": 2048, "lr": 1e-3, "checkpoint_uri": f"file://{root / 'ckpt'}"},
    }


def write_config(folder: Path, **cluster: object) -> str:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config_dict(folder, **cluster)))
    return str(path)


def test_local_pool_records_the_size_and_another_instance_reads_it(tmp_path):
    state = tmp_path / "pool.json"
    pool = node_pool_for(parse_config(config_dict(tmp_path)), state_path=state)
    assert isinstance(pool, NodePool)
    assert pool.current_size() == 0
    pool.resize(2)
    assert json.loads(state.read_text())["num_nodes"] == 2
    other = LocalNodePool(state_path=state, devices_per_node=1, max_nodes=2)
    assert other.current_size() == 2
    other.wait_ready(2, timeout_s=1)
    assert "2 node(s) x 1 process(es)" in other.describe()


def test_wait_ready_refuses_when_fewer_nodes_are_recorded(tmp_path):
    pool = LocalNodePool(state_path=tmp_path / "pool.json", devices_per_node=1, max_nodes=2)
    pool.resize(1)
    with pytest.raises(BatchpilotError, match=r"1 node\(s\) recorded .* 2 are needed"):
        pool.wait_ready(2, timeout_s=1)


def test_a_modelled_resize_delay_makes_new_nodes_ready_that_much_later_and_a_shorter_wait_says_so(tmp_path):
    import time

    pool = LocalNodePool(
        state_path=tmp_path / "pool.json", devices_per_node=1, max_nodes=2, resize_delay_s=1.5
    )
    pool.resize(1)
    started = time.monotonic()
    pool.wait_ready(1, timeout_s=10)
    assert 1.3 <= time.monotonic() - started <= 3
    pool.resize(1)  # the same size again: ready already, nothing to wait for
    started = time.monotonic()
    pool.wait_ready(1, timeout_s=10)
    assert time.monotonic() - started < 0.5
    pool.resize(2)
    pool.resize(2)  # asked again while it grows: the nodes already coming, not a new delay
    with pytest.raises(
        BatchpilotError, match=r"cluster.local_resize_delay_s: .* ready in \d+ s, after the 0.5 s"
    ):
        pool.wait_ready(2, timeout_s=0.5)
    started = time.monotonic()
    pool.wait_ready(2, timeout_s=10)
    assert 0.5 <= time.monotonic() - started <= 1.6


def test_a_size_this_machine_cannot_host_is_refused_and_not_recorded(tmp_path):
    cpus = available_cpus()
    pool = LocalNodePool(state_path=tmp_path / "pool.json", devices_per_node=1, max_nodes=cpus + 1)
    pool.resize(1)
    with pytest.raises(BatchpilotError, match=rf"{cpus + 1} processes, but this machine has {cpus} CPU"):
        pool.resize(cpus + 1)
    assert pool.current_size() == 1


def test_a_corrupt_state_file_is_an_error_not_a_size(tmp_path):
    state = tmp_path / "pool.json"
    state.write_text("{not json")
    pool = LocalNodePool(state_path=state, devices_per_node=1, max_nodes=2)
    with pytest.raises(BatchpilotError, match="cannot read the local pool state"):
        pool.current_size()


def test_pool_cli_resize_status_scale_down(tmp_path, capsys):
    config = write_config(tmp_path, pool_state_path=str(tmp_path / "state.json"))
    assert main(["pool", "resize", "--config", config, "--nodes", "2"]) == 0
    assert "resized: 0 -> 2 node(s)" in capsys.readouterr().out
    assert main(["pool", "status", "--config", config]) == 0
    assert "local pool: 2 node(s)" in capsys.readouterr().out
    assert main(["pool", "scale-down", "--config", config]) == 0
    assert "scaled down: 2 -> 0 node(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "state.json").read_text())["num_nodes"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "3"], "--nodes: 3 is outside 0..2"),
        (["--nodes", "-1"], "--nodes: -1 is outside 0..2"),
        (["--nodes", "1", "--timeout-s", "0"], "--timeout-s: 0.0 is not positive"),
    ],
)
def test_pool_cli_bad_input_exits_2_with_one_line_and_resizes_nothing(tmp_path, capsys, argv, message):
    state = tmp_path / "state.json"
    config = write_config(tmp_path, pool_state_path=str(state))
    assert main(["pool", "resize", "--config", config, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not state.exists()


def test_pool_state_flag_overrides_the_config(tmp_path, capsys):
    config = write_config(tmp_path)
    state = tmp_path / "elsewhere.json"
    assert main(["pool", "resize", "--config", config, "--nodes", "1", "--pool-state", str(state)]) == 0
    assert json.loads(state.read_text())["num_nodes"] == 1


def test_gke_settings_on_a_local_backend_are_reported_as_ignored(tmp_path, batchpilot_log):
    node_pool_for(
        parse_config(config_dict(tmp_path, project="p", node_pool="gpu")), state_path=tmp_path / "s.json"
    )
    warnings = [r.getMessage() for r in batchpilot_log.records if r.levelno == logging.WARNING]
    assert any("ignoring gke settings project, node_pool" in message for message in warnings)


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"idle_nodes": 3}, "idle_nodes (3) must not exceed max_nodes (2)"),
        ({"tolerations": [{"key": "a", "efect": "NoSchedule"}]}, "tolerations[0] has unknown key 'efect'"),
        (
            {"tolerations": [{"key": "a", "operator": "In"}]},
            "tolerations[0].operator must be Equal or Exists",
        ),
        ({"pool_mode": "manual"}, "cluster.pool_mode: Input should be 'resize', 'autoscale' or 'static'"),
    ],
)
def test_cluster_settings_are_checked_when_the_config_loads(cluster, message, tmp_path):
    from batchpilot.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(config_dict(tmp_path, **cluster))
