"""The canary: its arithmetic, node count, failure lines, report section and place in the compiled pipeline."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from batchpilot.cluster.canary import _FailureLines, canary_launch_spec, canary_nodes, canary_spec
from batchpilot.cluster.machines import expected_bus_bandwidth_bytes_per_s
from batchpilot.config import parse_config
from batchpilot.exitcodes import CANARY_FAILED_MARKER
from batchpilot.kfp.compile import compile_file
from batchpilot.report.sections import canary_section
from batchpilot.train.canary import (
    RankResult,
    bandwidth_problem,
    bus_bandwidth_bytes_per_s,
    canary_metrics,
    failure_line,
    nccl_network,
    run_canary,
    summarize,
    summary_line,
)
from batchpilot.workflow import canary as canary_step
from batchpilot.workflow.plan import plan
from helpers import REPO, gke_a3_config, tiny_config

MIB = 2**20


# --- bus bandwidth -------------------------------------------------------------------------------


def test_bus_bandwidth_is_the_nccl_tests_figure():
    # 256 MiB over 16 ranks in 10 ms: 256 MiB x 2 x 15/16 / 0.01 s.
    assert bus_bandwidth_bytes_per_s(num_bytes=256 * MIB, world_size=16, time_s=0.01) == pytest.approx(
        268435456 * 30 / 16 / 0.01
    )
    assert bus_bandwidth_bytes_per_s(num_bytes=4 * MIB, world_size=2, time_s=0.5) == pytest.approx(
        4 * MIB / 0.5
    )
    assert bus_bandwidth_bytes_per_s(num_bytes=4 * MIB, world_size=1, time_s=0.5) == 0.0  # nothing moves
    with pytest.raises(ValueError, match="positive"):
        bus_bandwidth_bytes_per_s(num_bytes=MIB, world_size=2, time_s=0.0)


def test_the_expected_figure_is_one_nodes_network_bandwidth_between_nodes_only():
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="a3-megagpu-8g", num_nodes=2) == 1600e9 / 8
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="a3-highgpu-8g", num_nodes=16) == 800e9 / 8
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="g2-standard-4", num_nodes=2) == 10e9 / 8
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="a2-highgpu-8g", num_nodes=2) == 100e9 / 8
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="a3-megagpu-8g", num_nodes=1) is None
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name="e2-standard-4", num_nodes=2) is None
    assert expected_bus_bandwidth_bytes_per_s(machine_type_name=None, num_nodes=2) is None


def test_a_bus_bandwidth_below_half_the_expected_figure_fails_the_canary():
    """TCP over the primary NIC gives a quarter of an A3's TCPX figure: the canary must fail on it."""
    problem = bandwidth_problem(measured=25e9, expected=100e9, machine="a3-highgpu-8g")
    assert problem is not None and "25%" in problem and "a3-highgpu-8g" in problem and "GPUDirect" in problem
    assert bandwidth_problem(measured=49e9, expected=100e9, machine="a3-highgpu-8g") is not None
    assert bandwidth_problem(measured=50e9, expected=100e9, machine="a3-highgpu-8g") is None
    assert bandwidth_problem(measured=1e6, expected=None, machine="e2-standard-4") is None


NCCL_LOG = """gke-train-h100-0:41:41 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>
gke-train-h100-0:41:41 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.21.5+cuda12.4
gke-train-h100-0:41:80 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
gke-train-h100-0:41:80 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gke-train-h100-0:41:80 [0] NCCL INFO Using network Socket
"""


def test_the_transport_nccl_chose_is_read_from_its_debug_log():
    assert nccl_network(NCCL_LOG) == "Socket"
    assert (
        nccl_network(NCCL_LOG.replace("Using network Socket", "Using network GPUDirectTCPX"))
        == "GPUDirectTCPX"
    )
    assert nccl_network("NCCL INFO cudaDriverVersion 12040\n") is None


def test_the_socket_transport_fails_a_canary_set_up_for_gpudirect():
    fallen = two_node_summary(time_s=0.004, networks=["GPUDirectTCPX", "GPUDirectTCPX", "Socket", "Socket"])
    assert fallen["nccl_networks"] == ["GPUDirectTCPX", "Socket"]
    assert fallen["transport_problem"] == (
        "NCCL uses its Socket transport (TCP over the primary NIC) on node(s) 1 although the pods are set up "
        "for GPUDirect-TCPX: its net plugin did not load (check the NCCL plugin installer DaemonSet, the pods' "
        "GPU NIC networks and the plugin's library path; docs/cluster.md, GPUDirect)"
    )
    assert two_node_summary(time_s=0.004, networks=["GPUDirectTCPX"] * 4)["transport_problem"] is None
    off = two_node_summary(time_s=0.004, networks=["Socket"] * 4, gpudirect="off")
    assert off["transport_problem"] is None  # TCP is what a pool without GPUDirect has


# --- node count ----------------------------------------------------------------------------------


def test_canary_nodes():
    # Without a plan (explore first): two nodes when allowed, else one.
    assert canary_nodes(max_nodes=16, first_launch_nodes=None, max_stage_nodes=None) == 2
    assert canary_nodes(max_nodes=1, first_launch_nodes=None, max_stage_nodes=None) == 1
    # With a plan: the first launch's nodes, at least two when a later stage spans several.
    assert canary_nodes(max_nodes=16, first_launch_nodes=8, max_stage_nodes=16) == 8
    assert canary_nodes(max_nodes=2, first_launch_nodes=1, max_stage_nodes=2) == 2
    assert canary_nodes(max_nodes=4, first_launch_nodes=1, max_stage_nodes=1) == 1


def test_canary_nodes_of_a_plan(tmp_path):
    config = parse_config(tiny_config(data_uri=f"file://{tmp_path}/d", checkpoint_uri=f"file://{tmp_path}/c"))
    document = plan(config, announce=False)
    assert [stage.num_nodes for stage in document.plan.stages] == [1, 2, 2]
    assert canary_step.canary_nodes(config, document) == 2  # the first launch is 1 node, stage 1 needs 2
    assert canary_step.canary_nodes(config) == 2


# --- the spec and the launch ---------------------------------------------------------------------


def test_on_gke_the_spec_rides_in_the_environment_as_the_run_document_does():
    config = parse_config(gke_a3_config())
    spec = canary_spec(config, num_nodes=2)
    assert spec["result_uri"] == "gs://bucket/ckpt/canary"
    assert spec["expected_bus_bandwidth_bytes_per_s"] == 800e9 / 8
    launch = canary_launch_spec(config, spec=spec, spec_path=None)
    assert launch.trainer_args == ("canary-rank", "--spec", "/tmp/batchpilot/plan.json")
    assert yaml.safe_load(launch.env["BATCHPILOT_PLAN_JSON"]) == spec
    assert (launch.num_nodes, launch.processes_per_node) == (2, 8)
    assert launch.labels["batchpilot.dev/stage"] == "canary" and launch.labels["batchpilot.dev/run"] == "tiny"
    # NCCL logs its version and chosen transport to a file per process, which each rank reads back.
    assert {k: launch.env[k] for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")} == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/tmp/batchpilot-nccl.%h.%p.log",
    }  # fmt: skip


# --- failure lines -------------------------------------------------------------------------------


def test_a_rank_without_its_planned_gpus_fails_with_one_line_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("RANK", "9")
    spec = {"config": gke_a3_config(), "num_nodes": 2, "result_uri": "gs://bucket/ckpt/canary"}
    assert run_canary(spec) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{CANARY_FAILED_MARKER} node 1 (rank 9, host ")
    assert "cluster.accelerator_type: nvidia-h100-80gb needs 8 CUDA device(s)" in line


def test_the_task_keeps_the_first_failure_line_of_the_job_log_whatever_the_chunks():
    out = io.StringIO()
    lines = _FailureLines(out)
    lines.write("[1]:step\n[0]:batchpilot canary fa")
    lines.write("iled: node 0 (rank 0, host a): gs://b/ckpt/canary/probe: denied\n")
    lines.write(f"[1]:{CANARY_FAILED_MARKER} node 1 (rank 1, host b): later\n")
    assert lines.first == "node 0 (rank 0, host a): gs://b/ckpt/canary/probe: denied"
    assert out.getvalue().count("\n") == 3  # every line still reaches the console


def result(rank: int, node: int, **kwargs: object) -> RankResult:
    return RankResult(rank=rank, node=node, local_rank=rank % 2, host=f"pod-{node}", devices=0, **kwargs)  # type: ignore[arg-type]


def test_failure_line_names_node_rank_host_and_what():
    line = failure_line(result(3, 1, error="file:///x/canary/probe-node1: Not a directory"))
    assert (
        line
        == f"{CANARY_FAILED_MARKER} node 1 (rank 3, host pod-1): file:///x/canary/probe-node1: Not a directory"
    )


# --- canary.json, metrics, report ----------------------------------------------------------------


def two_node_summary(*, time_s: float, networks: list[str] | None = None, gpudirect: str = "auto") -> dict:
    config = gke_a3_config(gpudirect=gpudirect)
    results = [
        result(0, 0, read_bytes=64 * MIB, read_s=0.5, checkpoint_write_ms=40.0, checkpoint_read_ms=10.0),
        result(1, 0),
        result(2, 1, read_bytes=64 * MIB, read_s=0.25, checkpoint_write_ms=80.0, checkpoint_read_ms=20.0),
        result(3, 1),
    ]
    for rank, network in enumerate(networks or []):
        results[rank].nccl_network = network
    spec = {"config": config, "expected_bus_bandwidth_bytes_per_s": 125e9}
    from dataclasses import asdict

    return asdict(summarize(results, spec=spec, backend="nccl", all_reduce_bytes=256 * MIB, time_s=time_s,
                            nccl_version="2.21.5" if networks else None))  # fmt: skip


def test_summary_metrics_and_line():
    summary = two_node_summary(time_s=0.004)  # 256 MiB x 2 x 3/4 / 4 ms = 100.7 GB/s
    assert [n["read_mb_per_s"] for n in summary["nodes"]] == pytest.approx(
        [64 * MIB / 1e6 / 0.5, 64 * MIB / 1e6 / 0.25]
    )
    assert summary["bandwidth_problem"] is None and summary["transport_problem"] is None
    metrics = canary_metrics(summary)
    assert metrics == pytest.approx({
        "num_nodes": 2.0, "world_size": 4.0, "bus_bandwidth_gb_per_s": 256 * MIB * 1.5 / 0.004 / 1e9,
        "expected_bus_bandwidth_gb_per_s": 125.0, "min_read_mb_per_s": 64 * MIB / 1e6 / 0.5,
        "max_checkpoint_write_ms": 80.0, "max_checkpoint_read_ms": 20.0,
    })  # fmt: skip
    line = summary_line(summary)
    assert "2 node(s) x 2 process(es) passed" in line and "(expected ~125 GB/s)" in line
    assert "checkpoint write/read 40/10, 80/20 ms" in line


def test_the_report_shows_the_canary_and_why_it_failed():
    healthy = canary_section(two_node_summary(time_s=0.004))
    assert "<h2>Canary</h2>" in healthy and "100.66 GB/s" in healthy and "81% of the ~125 GB/s" in healthy
    assert "failed" not in healthy and "<td>134</td>" in healthy  # node 0 read 64 MiB in 0.5 s
    slow = canary_section(two_node_summary(time_s=0.04))  # a tenth: 8%
    assert "The canary failed: all-reduce bus bandwidth 10.07 GB/s is 8% of the 125 GB/s expected" in slow
    fallen = canary_section(two_node_summary(time_s=0.004, networks=["Socket"] * 4))
    assert (
        "NCCL 2.21.5 over Socket" in fallen and "The canary failed: NCCL uses its Socket transport" in fallen
    )


# --- the compiled pipeline ------------------------------------------------------------------------


def upstream(tasks: dict, name: str) -> set[str]:
    """Every task `name` waits for, directly or through others (the compiled IR's dependentTasks)."""
    found: set[str] = set()
    todo = list(tasks[name].get("dependentTasks", []))
    while todo:
        task = todo.pop()
        if task not in found:
            found.add(task)
            todo += tasks[task].get("dependentTasks", [])
    return found


def compiled_tasks(config: dict, tmp_path: Path) -> dict:
    path, output = tmp_path / "config.yaml", tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    compile_file(path, output)
    spec = next(yaml.safe_load_all(output.read_text()))
    return spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]


def test_the_nemo_pipeline_runs_the_canary_before_explore_and_the_first_train_task(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    tasks = compiled_tasks(config, tmp_path)
    assert tasks["canary"]["taskInfo"]["name"] == "canary: devices, all-reduce, data, checkpoint"
    assert upstream(tasks, "canary") == {"prepare-explore-pool"}
    assert "canary" in upstream(tasks, "explore") and "canary" in upstream(tasks, "stages-0-3")
    assert tasks["canary"]["inputs"]["parameters"]["plan_json"]["runtimeValue"]["constant"] == ""


def test_without_explore_the_canary_follows_the_plan_and_precedes_the_first_launch(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    config["explore"] = {"study": False}
    tasks = compiled_tasks(config, tmp_path)
    assert upstream(tasks, "canary") == {"plan"}
    assert (
        tasks["canary"]["inputs"]["parameters"]["plan_json"]["taskOutputParameter"]["producerTask"] == "plan"
    )
    assert tasks["stages-0-3"]["dependentTasks"] == ["canary", "plan"]  # plan: its plan_json
