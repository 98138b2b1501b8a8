"""Issue #14: TPU slices in the plan. A stage's node count is the host count of a valid slice of the TPU
type; each stage has its topology; invalid shapes are refused with the nearest valid ones, before
anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.config import load_config, resolved_runtime
from batchpilot.errors import BatchpilotError
from batchpilot.plan.stages import build_plan
from batchpilot.planning.launches import launch_summary
from batchpilot.planning.nodes import Placement, walk_nodes
from batchpilot.planning.table import plan_table
from batchpilot.planning.tpu import TPU_TYPES, check_host_range, slice_pool_name, topology_chips, tpu_slices
from helpers import write_manifest

TPU_EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "llama_5b_tpu.yaml"


def slices(accelerator="tpu-v6e-slice", machine="ct6e-standard-4t", chips=4):
    return tpu_slices(accelerator_type=accelerator, machine_type=machine, devices_per_node=chips)


@pytest.mark.parametrize(
    ("accelerator", "machine", "chips", "hosts"),
    [
        # GKE's tables: 4-chip VMs form 2x2 (1 VM), 2x4 (2), 4x4 (4), 4x8 (8) ... 16x16 (64).
        ("tpu-v6e-slice", "ct6e-standard-4t", 4, [1, 2, 4, 8, 16, 32, 64]),
        ("tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 4, [1, 2, 4, 8, 16, 32, 64]),
        # The 8-chip VM is a single-host 2x4 only; the 1-chip VM a 1x1.
        ("tpu-v6e-slice", "ct6e-standard-8t", 8, [1]),
        ("tpu-v5-lite-podslice", "ct5lp-hightpu-1t", 1, [1]),
        # v5p: 3-D shapes, 4 chips per VM: 2x2x1 = 1 VM ... 16x16x24 = 1536.
        ("tpu-v5p-slice", "ct5p-hightpu-4t", 4, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536]),
    ],
)
def test_host_counts_are_the_slices_of_the_machine_type(accelerator, machine, chips, hosts):
    assert slices(accelerator, machine, chips).host_counts() == hosts


def test_a_slice_has_chips_hosts_and_topology():
    shape = slices().for_hosts(8)
    assert (shape.topology, shape.chips, shape.hosts, shape.machine_type) == (
        "4x8",
        32,
        8,
        "ct6e-standard-4t",
    )
    assert shape.multi_host and not slices().for_hosts(1).multi_host
    assert slices("tpu-v5p-slice", "ct5p-hightpu-4t").for_hosts(4).topology == "2x2x4"
    assert topology_chips("16x16x24") == 6144
    assert slice_pool_name("v6e", "4x8") == "v6e-4x8"


def test_every_topology_is_a_whole_number_of_hosts():
    for tpu in TPU_TYPES.values():
        for machine in tpu.machines:
            for topology in machine.topologies:
                assert topology_chips(topology) % machine.chips_per_host == 0, (tpu.label, topology)


def test_no_slice_of_that_many_hosts_names_the_nearest():
    with pytest.raises(BatchpilotError) as error:
        slices().for_hosts(6)
    assert str(error.value).endswith("(fix: use 4 host(s) (4x4, 16 chips) or 8 host(s) (4x8, 32 chips))")


def test_host_range_must_end_on_a_slice():
    assert check_host_range(slices(), min_nodes=2, max_nodes=8) == [2, 4, 8]
    with pytest.raises(BatchpilotError, match=r"cluster.max_nodes: 12 ct6e-standard-4t hosts \(48 chips\)"):
        check_host_range(slices(), min_nodes=1, max_nodes=12)
    with pytest.raises(BatchpilotError, match=r"cluster.min_nodes: no tpu-v6e-slice slice has between 3"):
        check_host_range(slices("tpu-v6e-slice", "ct6e-standard-8t", 8), min_nodes=3, max_nodes=1)


def test_the_node_walk_only_picks_slice_host_counts():
    # Micro batch 2 on 4-chip hosts: a pass takes 8 samples per host. Without the slice rule 48 would go to
    # 6 hosts; with it, the largest slice that splits 48 is 2 hosts (4x4 = 4 hosts would need 64).
    free = walk_nodes(
        batch_sizes=[16, 32, 48, 64], micro_batch_size=2, placement=Placement(devices_per_node=4, max_nodes=8)
    )
    assert free == [2, 4, 6, 8]
    allowed = slices().host_counts()
    walked = walk_nodes(
        batch_sizes=[16, 32, 48, 64],
        micro_batch_size=2,
        placement=Placement(devices_per_node=4, max_nodes=8, allowed_nodes=allowed),
    )
    assert walked == [2, 2, 2, 8]


def test_the_tpu_example_grows_its_slice_with_the_batch():
    config = load_config(TPU_EXAMPLE)
    assert resolved_runtime(config) == "xla"
    plan = build_plan(config, micro_batch_size=2)
    assert [(s.global_batch_size, s.num_nodes, s.tpu_topology) for s in plan.stages] == [
        (16, 2, "2x4"),
        (32, 4, "4x4"),
        (64, 8, "4x8"),
        (128, 8, "4x8"),
        (256, 8, "4x8"),
    ]
    assert launch_summary(plan) == (
        "3 launch(es): stage-0 on 2 node(s) (2x4), stage-1 on 4 (4x4), stages-2-final on 8 (4x8)"
    )
    table = plan_table(plan)
    assert [column.name for column in table.columns][4:6] == ["nodes", "slice"]
    assert [row[5] for row in table.rows] == ["2x4", "4x4", "4x8", "4x8", "4x8"]


def test_a_gpu_plan_has_no_slice_column():
    config = load_config(TPU_EXAMPLE.parent / "llama_5b.yaml")
    plan = build_plan(config, micro_batch_size=2)
    assert resolved_runtime(config) == "eager"
    assert all(stage.tpu_topology is None for stage in plan.stages)
    assert "slice" not in [column.name for column in plan_table(plan).columns]


def tpu_config(tmp_path: Path, *, cluster=None, train=None, batch=None, explore=None, data=None) -> str:
    config = yaml.safe_load(TPU_EXAMPLE.read_text())
    for section, values in (
        ("cluster", cluster),
        ("train", train),
        ("batch", batch),
        ("explore", explore),
        ("data", data),
    ):
        config.setdefault(section, {}).update(values or {})
    path = tmp_path / "tpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


BAD_TPU_CONFIGS = {
    "no slice of max_nodes hosts": (
        {"cluster": {"max_nodes": 6}},
        [
            "cluster.max_nodes: 6 ct6e-standard-4t hosts (24 chips) form no tpu-v6e-slice slice (valid: 2x2=1, "
            "2x4=2, 4x4=4, 4x8=8, 8x8=16, 8x16=32, 16x16=64) (fix: use 4 host(s) (4x4, 16 chips) or 8 host(s) "
            "(4x8, 32 chips))"
        ],
    ),
    "devices_per_node is not the chips per host": (
        {"cluster": {"devices_per_node": 8}},
        [
            "cluster.devices_per_node: 8 is not the chips per host of ct6e-standard-4t (4) (fix: set "
            "cluster.devices_per_node to 4)"
        ],
    ),
    "unknown TPU type": (
        {"cluster": {"accelerator_type": "tpu-v9-slice"}},
        [
            "cluster.accelerator_type: 'tpu-v9-slice' is not a TPU type batchpilot knows (fix: use one of "
            "tpu-v5-lite-podslice, tpu-v6e-slice, tpu-v5p-slice)"
        ],
    ),
    "machine type of another TPU": (
        {"cluster": {"machine_type": "ct5lp-hightpu-4t"}},
        [
            "cluster.machine_type: 'ct5lp-hightpu-4t' is not a machine type of tpu-v6e-slice (v6e) (fix: use one "
            "of ct6e-standard-1t, ct6e-standard-4t, ct6e-standard-8t)"
        ],
    ),
    "a region and no zone for the slice pools": (
        {"cluster": {"tpu_zone": None}},
        [
            "cluster.tpu_zone: is not set and cluster.location 'us-east5' is a region, but batchpilot creates "
            "each stage's slice node pool in one zone (fix: set cluster.tpu_zone to a zone of us-east5 that "
            "offers tpu-v6e-slice)"
        ],
    ),
    "eager on TPU and what xla does not implement": (
        {
            "train": {"runtime": "eager", "parallelism": "ddp"},
            "batch": {"micro_batch_size": "explore"},
            "explore": {"study": True},
            "data": {"expansion_factor_real_data": 2},
        },
        [
            "train.runtime: is eager, but tpu-v6e-slice nodes have TPUs, which PyTorch reaches only through "
            "torch_xla (fix: set train.runtime: xla (or auto))",
        ],
    ),
    "what the xla runtime does not implement": (
        {
            "train": {"parallelism": "hsdp"},
            "batch": {"micro_batch_size": "explore"},
            "explore": {"study": True},
            "data": {"expansion_factor_real_data": 2},
        },
        [
            "train.parallelism: hsdp is not implemented for runtime xla, which shards parameters, gradients and "
            "optimizer state over every device of the slice (SPMD) (fix: set train.parallelism: fsdp (or auto))",
            "batch.micro_batch_size: is 'explore', but explore's probes and noise-scale study do not run on XLA "
            "(TPU) yet (fix: set an integer micro batch)",
            "explore.study: is true, but explore's probes and noise-scale study do not run on XLA (TPU) yet "
            "(fix: set explore.study: false (the trainers still measure the noise scale every step))",
            "data.expansion_factor_real_data: is 2.0, but loading hosts are not implemented for runtime xla "
            "(every host reads its own samples) (fix: set data.expansion_factor_real_data: 1)",
        ],
    ),
}


@pytest.mark.parametrize("command", ["config check", "plan", "compile"])
@pytest.mark.parametrize("case", BAD_TPU_CONFIGS)
def test_bad_tpu_configs_are_refused_before_anything_runs(tmp_path, capsys, case, command):
    changes, expected = BAD_TPU_CONFIGS[case]
    config = tpu_config(tmp_path, **changes)
    out = tmp_path / "out.yaml"
    argv = {
        "config check": ["config", "check", config],
        "plan": ["plan", "--config", config, "--out", str(out)],
        "compile": ["compile", "--config", config, "--out", str(out)],
    }[command]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"batchpilot: error: {line}" for line in expected]
    assert not out.exists()


def test_plan_json_records_each_stage_topology(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(TPU_EXAMPLE), "--out", str(out)]) == 0
    stages = json.loads(out.read_text())["stages"]
    assert [stage["tpu_topology"] for stage in stages] == ["2x4", "4x4", "4x8", "4x8", "4x8"]


def test_a_local_launch_of_runtime_xla_says_how_to_train_instead(tmp_path, capsys):
    """Local launches start torchrun (a process per device); XLA wants one process per host: refused with
    the command that does it, before any process starts."""
    config = {
        "name": "xla-local",
        "data": {"uri": write_manifest(tmp_path / "data", vocab_size=256), "seq_len": 32},
        "cluster": {"devices_per_node": 2, "max_nodes": 1},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "train": {
            "total_samples": 64,
            "lr": 1e-3,
            "runtime": "xla",
            "checkpoint_uri": f"file://{tmp_path}/c",
        },
        "explore": {"study": False},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = tmp_path / "plan.json"
    assert main(["plan", "--config", str(path), "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["launch", "--plan", str(plan), "--stage", "0", "--output-dir", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("batchpilot: error: train.runtime: is xla, but local launches start torchrun")
    assert "PJRT_DEVICE=CPU CPU_NUM_DEVICES=<nodes x devices_per_node> batchpilot train" in line
    assert not (tmp_path / "out").exists()
