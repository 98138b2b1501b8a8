"""hsdp shard groups that span nodes (#35): the plan picks the fewest nodes per group whose memory fits every
stage (configs/llama_70b.yaml: Llama-3-70B cannot be sharded within one node of 8 H100s), a configured
group must split every stage's nodes, and the choice reaches plan.json and the trainer's mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.errors import BatchpilotError
from batchpilot.planning.memory import check_shard_nodes, estimate_memory, shard_node_choices
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.stages import Stage
from helpers import run_batchpilot

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GIB = 2**30


def stage(name: str, nodes: int) -> Stage:
    return Stage(
        index=0, name=name, global_batch_size=8 * nodes, start_sample=0, end_sample=8 * nodes, num_nodes=nodes,
        data_parallel_size=8 * nodes, micro_batch_size=1, gradient_accumulation_steps=1, lr=1e-4, num_steps=1,
        world_size=8 * nodes, global_batch_to_load=8 * nodes, num_loading_hosts=nodes, is_final=name == "final",
    )  # fmt: skip


def test_shard_groups_are_the_common_divisors_of_the_stages_node_counts():
    stages = [stage("a", 16), stage("b", 24), stage("final", 64)]
    assert shard_node_choices(stages) == [1, 2, 4, 8]
    check_shard_nodes(stages, 8)
    with pytest.raises(BatchpilotError) as raised:
        check_shard_nodes(stages, 16)
    assert str(raised.value) == (
        "train.hsdp_shard_nodes: is 16, but b runs on 24 node(s), which do not split into groups of 16 (fix: use "
        "one that divides every stage's node count (1, 2, 4, 8), or leave it unset)"
    )


def test_a_group_of_k_nodes_shards_the_model_state_k_times_thinner():
    shape = ModelShape(
        num_params=70_553_706_496, num_layers=80, hidden_size=8192, vocab_size=128256, ffn_hidden_size=28672,
        largest_block_params=855_654_400, num_heads=64, kv_hidden_size=1024, gated_mlp=True, rms_norm=True,
    )  # fmt: skip
    one, four = (
        estimate_memory(
            shape=shape, strategy="hsdp", world_size=128, devices_per_node=8, micro_batch_size=1, seq_len=8192,
            mixed_precision=True, activation_checkpointing=True, shard_nodes=k,
        )
        for k in (1, 4)
    )  # fmt: skip
    assert (one.shard_degree, four.shard_degree) == (8, 32)
    assert one.parameters + one.gradients + one.optimizer == 16 * shape.num_params // 8
    assert four.parameters + four.gradients + four.optimizer == 16 * shape.num_params // 32
    assert one.total > 150 * GIB  # one node of H100s cannot hold a 70B model's state (issue #35: 172.6 GiB)


def test_the_70b_example_plans_hsdp_in_groups_of_4_nodes_and_every_stage_fits(tmp_path):
    out = tmp_path / "plan.json"
    done = run_batchpilot("plan", "--config", str(CONFIGS / "llama_70b.yaml"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "parallelism hsdp (sharded 32 ways within groups of 4 nodes)" in done.stdout
    document = json.loads(out.read_text())
    plan = document  # plan.json: the run document, the plan at its top level
    assert plan["parallelism"] == "hsdp" and plan["hsdp_shard_nodes"] == 4
    memory = plan["memory"]
    assert memory["fits"] is True and memory["hsdp_shard_nodes"] == 4
    assert all(item["shard_degree"] == 32 for item in memory["stages"])
    assert [s["num_nodes"] for s in plan["stages"]] == [16, 24, 32, 40, 48, 56, 64]
    # groups of 2 nodes would not fit: the plan takes the fewest that do
    assert all(item["total_bytes"] <= memory["device_memory_bytes"] for item in memory["stages"])


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ({"hsdp_shard_nodes": 3}, "train.hsdp_shard_nodes: is 3, but stage-0 runs on 16 node(s)"),
        (
            {"hsdp_shard_nodes": 2, "parallelism": "fsdp"},
            "train.hsdp_shard_nodes: is 2, but the trainers run fsdp, which has no shard groups",
        ),
        # 70 GiB of state per device: too much (under auto the plan would take fsdp instead)
        ({"hsdp_shard_nodes": 2, "parallelism": "hsdp"}, "train.parallelism: hsdp needs "),
    ],
)
def test_a_shard_group_that_cannot_work_is_refused_in_one_line(tmp_path, train, expected):
    config = yaml.safe_load((CONFIGS / "llama_70b.yaml").read_text())
    config["train"].update(train)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_batchpilot("plan", "--config", str(path), "--out", str(tmp_path / "plan.json"))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"batchpilot: error: {expected}"), done.stderr
    assert not (tmp_path / "plan.json").exists()


def test_explore_is_refused_for_a_model_one_node_cannot_hold(tmp_path):
    """explore probes on one node: Llama-3-70B at micro batch 1 with checkpointing needs 177 GiB per H100 there,
    so a config that leaves the micro batch to explore is refused before any node is asked for."""
    config = yaml.safe_load((CONFIGS / "llama_70b.yaml").read_text())
    config["batch"]["micro_batch_size"] = "explore"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_batchpilot("config", "check", "--config", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "batchpilot: error: batch.micro_batch_size: is explore, but explore probes on one node of 8 device(s), "
        "where even micro batch 1 with activation checkpointing needs 177.0 GiB"
    ), line
    assert line.endswith("(fix: give batch.micro_batch_size (the plan then spreads the model over the nodes its "
                         "memory check picks))")  # fmt: skip
    # Twin: the configured micro batch passes the same check.
    assert run_batchpilot("config", "check", "--config", str(CONFIGS / "llama_70b.yaml")).returncode == 0
