"""`batchpilot explore` under fsdp: every probe is a node of 2 real processes (gloo), as the stages run."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import yaml
from test_explore_cli import explore, explore_config

from helpers import processes_with, run_batchpilot

# The tiny GPT; on rank 1 a micro batch above 32 also holds 1 GiB, as if its activations did, so only
# that rank exceeds the memory budget while rank 0 waits for it inside FSDP's collectives.
HOG_MODEL = """
import os

import torch

from batchpilot.models.gpt import GPT, GPTConfig

HELD = []


class Hog(GPT):
    def forward(self, idx):
        if idx.shape[0] > 32 and os.environ.get("RANK") == "1":
            HELD.append(torch.ones(2**28))
        return super().forward(idx)


def hog(**args):
    return Hog(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=257))
"""


@pytest.mark.slow
def test_fsdp_probes_run_as_a_node_of_processes_and_a_rank_over_budget_does_not_fit(tmp_path, demo_data_uri):
    (tmp_path / "hog_model.py").write_text(textwrap.dedent(HOG_MODEL))
    tag = f"explore-sharded-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "BATCHPILOT_TEST_TAG": tag}
    config_path = explore_config(
        tmp_path,
        demo_data_uri,
        factory="hog_model:hog",
        activation_checkpointing=[False],
        accumulation_multipliers=[2],
        study_train_steps=1,
        sections={"cluster__devices_per_node": 2, "train__parallelism": "fsdp"},
    )
    result = explore(
        config_path, tmp_path, "--micro-batch-sizes", "1,32,64", "--memory-budget-bytes", "900MiB", env=env
    )
    assert result.returncode == 0, result.stderr
    assert "probes run as 2 processes under fsdp (what the stages run)" in result.stdout
    document = json.loads((tmp_path / "out" / "explore.json").read_text())
    assert (document["probe_parallelism"], document["processes_per_probe"]) == ("fsdp", 2)
    probes = {p["micro_batch_size"]: p for p in document["probes"]}
    assert sorted(probes) == [1, 32, 64]
    # Per-device peaks: each rank's own resident set, the larger of the two; they grow with the batch.
    assert probes[1]["fits"] and probes[32]["fits"]
    assert 0 < probes[1]["peak_memory_bytes"] < probes[32]["peak_memory_bytes"] < 900 * 2**20
    assert probes[32]["samples_per_s"] == pytest.approx(32 / probes[32]["step_time_s"])
    assert not probes[64]["fits"]
    assert probes[64]["error"].startswith("rank 1 of 2: resident memory ")
    assert "explore.memory_budget_bytes" in probes[64]["error"]
    assert probes[64]["duration_s"] < 60  # ended at once, not at rank 0's collective timeout
    # The study ran sharded too: a pass's gradient is that of micro x 2 processes.
    noise = document["noise_scale"]
    assert noise["processes"] == 2 and noise["micro_batch_size"] == 32
    assert [row["global_batch_size"] for row in noise["per_multiplier"]] == [32 * 2 * 2]
    assert not [pid for pid, _, env in processes_with("batchpilot") if env.get("BATCHPILOT_TEST_TAG") == tag]


@pytest.mark.slow
def test_tensor_parallel_probes_split_each_block_over_a_node_and_plan_from_it(tmp_path, demo_data_uri):
    """train.tensor_parallel_size 2 on a node of 2 devices: each probe is 2 processes splitting a Llama's
    blocks and training one data-parallel rank's samples, so a device's throughput is half the group's; the
    study's small batch is one micro batch; a plan takes the exploration for this layout and refuses it
    for another."""
    config_path = explore_config(
        tmp_path,
        demo_data_uri,
        activation_checkpointing=[False],
        accumulation_multipliers=[2],
        study_train_steps=1,
        sections={
            "cluster__devices_per_node": 2,
            "train__parallelism": "fsdp",
            "train__tensor_parallel_size": 2,
        },
    )
    config = yaml.safe_load(Path(config_path).read_text())
    config["model"] = {
        "factory": "batchpilot.models.llama:build",
        "args": {
            "n_layer": 1,
            "n_head": 2,
            "n_kv_head": 2,
            "n_embd": 32,
            "max_seq_len": 32,
            "vocab_size": 258,
        },
    }
    Path(config_path).write_text(yaml.safe_dump(config))
    result = explore(config_path, tmp_path, "--micro-batch-sizes", "2,4")
    assert result.returncode == 0, result.stderr
    assert "probes run as 2 processes under fsdp, each block split 2 ways" in result.stdout
    explored = tmp_path / "out" / "explore.json"
    document = json.loads(explored.read_text())
    assert (document["probe_parallelism"], document["processes_per_probe"]) == ("fsdp", 2)
    assert document["fingerprint"]["train.tensor_parallel_size"] == 2
    for probe in document["probes"]:
        assert probe["fits"], probe
        assert probe["samples_per_s"] == pytest.approx(probe["micro_batch_size"] / 2 / probe["step_time_s"])
    noise = document["noise_scale"]
    assert noise["processes"] == 1  # one data-parallel rank: the pass's gradient is one micro batch's
    assert [row["global_batch_size"] for row in noise["per_multiplier"]] == [noise["micro_batch_size"] * 2]
    planned = run_batchpilot("plan", "--config", config_path, "--explore", str(explored), "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["tensor_parallel_size"] == 2
    config["train"]["tensor_parallel_size"] = 1
    other = tmp_path / "tp1.yaml"
    other.write_text(yaml.safe_dump(config))
    refused = run_batchpilot("plan", "--config", str(other), "--explore", str(explored))
    assert refused.returncode == 2
    assert "train.tensor_parallel_size 2 there, 1 here" in refused.stderr
