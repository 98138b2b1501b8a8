"""hsdp that really shards: 2 local nodes x 2 processes (gloo), sharded within a node and replicated across.

The same training as ddp on the same 4 processes, and kill -9 of any rank then a resume ends with the
same parameters and metrics as the uninterrupted run. (How often hsdp reduces across nodes is in
test_sharding_units.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchpilot.runstate import read_metrics
from batchpilot.train.checkpoint import Checkpointer
from helpers import (
    assert_same_run,
    kill_9_then_resume,
    run_batchpilot,
    tiny_config,
    write_plan,
)

pytestmark = pytest.mark.slow

STEPS = 24


def two_by_two_config(data_uri: str, root: Path, parallelism: str) -> dict:
    """One stage of 24 steps at global batch 32 on 2 nodes x 2 processes, micro batch 2 (accumulation 4:
    noise scale and coherence are measured under hsdp), checkpointing every 4 steps."""
    config = tiny_config(
        data_uri=data_uri,
        checkpoint_uri=f"file://{root}/ckpt",
        batch__global_batch_size=32,
        batch__micro_batch_size=2,
        batch__schedule=None,
        train__total_samples=32 * STEPS,
        train__checkpoint_every_steps=4,
        train__parallelism=parallelism,
        train__measure_coherence=True,
    )
    config["cluster"]["devices_per_node"] = 2
    return config


def train_final(plan: str, out: Path):
    return run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))


def weights(root: Path) -> dict[str, torch.Tensor]:
    return Checkpointer(uri=f"file://{root}/ckpt").load().full_state()["model"]


@pytest.fixture(scope="module")
def runs(demo_data_uri, tmp_path_factory):
    """The uninterrupted runs under ddp and under hsdp, each on 2 nodes x 2 processes."""
    roots = {}
    for parallelism in ("ddp", "hsdp"):
        root = tmp_path_factory.mktemp(parallelism)
        plan = write_plan(root, two_by_two_config(demo_data_uri, root, parallelism))
        document = json.loads(Path(plan).read_text())
        assert document["parallelism"] == parallelism
        assert [(s["num_nodes"], s["world_size"]) for s in document["stages"]] == [(2, 4)]
        result = train_final(plan, root / "out")
        assert result.returncode == 0, result.stdout[-3000:]
        roots[parallelism] = root
    return roots


def test_hsdp_on_two_ranks_per_node_trains_as_ddp_does(runs):
    ddp = read_metrics(runs["ddp"] / "out" / "metrics.jsonl")
    hsdp = read_metrics(runs["hsdp"] / "out" / "metrics.jsonl")
    assert len(ddp) == len(hsdp) == STEPS
    for a, b in zip(ddp, hsdp, strict=True):
        assert a["consumed_samples"] == b["consumed_samples"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), a["step"]
    # The noise scale from each rank's own passes, coherence from the node's first two.
    assert sum(r["noise_scale"] is not None for r in hsdp) > STEPS // 2
    assert all(-1 <= r["gradient_coherence"] <= 1 for r in hsdp)
    checkpoint = Checkpointer(uri=f"file://{runs['hsdp']}/ckpt").load()
    assert checkpoint.meta["parallelism"] == "hsdp" and checkpoint.meta["world_size"] == 4
    expected, actual = weights(runs["ddp"]), weights(runs["hsdp"])
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.allclose(actual[name], expected[name], rtol=1e-3, atol=1e-5), name


def test_kill_9_under_hsdp_then_resume_is_identical(runs, demo_data_uri, tmp_path, fault_rng):
    plan = write_plan(tmp_path, two_by_two_config(demo_data_uri, tmp_path, "hsdp"))
    resumed = kill_9_then_resume(plan, tmp_path, steps=STEPS, fault_rng=fault_rng, kill_after=(5, STEPS - 6))
    assert "resumed from step" in resumed and "under hsdp" in resumed
    # Parameters and AdamW state (moments and step counts) bit for bit, and the same metrics.
    assert_same_run(runs["hsdp"], tmp_path)


def test_hsdp_in_shard_groups_of_two_nodes_trains_as_ddp_does(runs, demo_data_uri, tmp_path):
    """4 nodes of one process each, sharded in groups of 2 nodes (train.hsdp_shard_nodes: 2), replicated across
    the 2 groups: the plan carries the group to the trainers, which train as ddp does on the same 4 ranks."""
    config = two_by_two_config(demo_data_uri, tmp_path, "hsdp")
    config["cluster"].update(devices_per_node=1, max_nodes=4)
    config["train"]["hsdp_shard_nodes"] = 2
    plan = write_plan(tmp_path, config)
    document = json.loads(Path(plan).read_text())
    assert document["hsdp_shard_nodes"] == 2
    assert [(s["num_nodes"], s["world_size"]) for s in document["stages"]] == [(4, 4)]
    result = train_final(plan, tmp_path / "out")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "hsdp: parameters sharded 2 ways" in result.stdout
    ddp = read_metrics(runs["ddp"] / "out" / "metrics.jsonl")
    groups = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert len(groups) == STEPS
    for a, b in zip(ddp, groups, strict=True):
        assert a["consumed_samples"] == b["consumed_samples"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), a["step"]
