"""`train.tensor_parallel_size`: the plan's data-parallel size is the devices over it, the memory model splits
each device's matrices and activations, and what the trainer cannot split is refused before any launch, one
line per problem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from test_memory_model import GPT_5B, HEADS, LAYERS, SEQ, VOCAB, H

from batchpilot.cli import main
from batchpilot.planning.memory import estimate_memory
from helpers import tiny_config, write_manifest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = ROOT / "configs" / "llama_70b.yaml"
TINY_LLAMA = {
    "factory": "batchpilot.models.llama:build",
    "args": {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "max_seq_len": 32, "vocab_size": 258},
}


def write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def seventy_b(**train: object) -> dict:
    data = yaml.safe_load(LLAMA_70B.read_text())
    data["train"].update(train)
    return data


def test_the_70b_plan_at_tp8_splits_each_node_and_shards_over_the_rest(tmp_path, capsys):
    assert main(["plan", "--config", write(tmp_path, seventy_b(tensor_parallel_size=8)), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tensor_parallel_size"] == 8
    for stage in plan["stages"]:
        assert stage["data_parallel_size"] == stage["num_nodes"]  # 8 devices a node, one replica's part each
        assert (
            stage["global_batch_size"]
            == stage["micro_batch_size"] * stage["num_nodes"] * stage["gradient_accumulation_steps"]
        )
    memory = plan["memory"]
    assert memory["strategy"] == "hsdp" and memory["stages"][0]["tensor_parallel_size"] == 8
    assert memory["stages"][0]["total_bytes"] <= memory["device_memory_bytes"]


def test_the_plan_line_shows_the_split(tmp_path, capsys):
    assert main(["plan", "--config", write(tmp_path, seventy_b(tensor_parallel_size=8))]) == 0
    out = capsys.readouterr().out
    assert (
        "data_parallel_size 64 x gradient_accumulation_steps 16 (final stage, 64 node(s) x 8 device(s) / "
        in out
    )
    assert "tensor_parallel_size 8)" in out
    assert "each block split 8 ways within a node (tensor parallel)" in out


def test_auto_never_picks_ddp_under_tensor_parallelism(tmp_path, capsys):
    config = tiny_config(data_uri=write_manifest(tmp_path / "data"), checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = TINY_LLAMA
    config["cluster"]["devices_per_node"] = 2
    config["train"]["tensor_parallel_size"] = 2
    assert main(["plan", "--config", write(tmp_path, config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallelism"] == "hsdp"  # ddp would be the first that fits without tensor parallelism
    assert [s["data_parallel_size"] for s in plan["stages"]] == [s["num_nodes"] for s in plan["stages"]]


def test_what_the_trainer_cannot_split_is_refused_one_line_each(tmp_path, capsys):
    config = tiny_config(data_uri="file:///nowhere", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = TINY_LLAMA
    config["cluster"]["devices_per_node"] = 2
    config["data"].update(seq_len=30, expansion_factor_real_data=2)
    config["train"].update(tensor_parallel_size=4, parallelism="ddp")
    assert main(["config", "check", write(tmp_path, config)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    fields = [line.removeprefix("batchpilot: error: ").split(":")[0] for line in lines]
    assert fields[:4] == [
        "train.tensor_parallel_size",
        "train.parallelism",
        "data.seq_len",
        "data.expansion_factor_real_data",
    ], lines
    assert "does not divide cluster.devices_per_node (2)" in lines[0]
    assert all("(fix: " in line for line in lines[:4])


OWN_MODEL = """
from torch import nn


class Own(nn.Module):
    def __init__(self, vocab_size, n_embd):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList([nn.Linear(n_embd, n_embd)])
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(**args):
    return Own(**args)
"""


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        (
            {"factory": "own_model:build", "args": {"vocab_size": 258, "n_embd": 32}},
            "no tensor-parallel plan for own_model:build",
        ),
        (
            {**TINY_LLAMA, "args": {**TINY_LLAMA["args"], "n_head": 6, "n_kv_head": 3, "n_embd": 48}},
            "does not divide the model's n_head 6, n_kv_head 3",
        ),
    ],
    ids=["own-model", "uneven-heads"],
)
def test_a_model_that_cannot_be_split_is_refused_at_plan_time(tmp_path, capsys, monkeypatch, model, fragment):
    """A model of the user's own (a factory batchpilot has no plan for), or one whose heads do not split."""
    (tmp_path / "own_model.py").write_text(OWN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tiny_config(data_uri="file:///nowhere", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = model
    config["cluster"]["devices_per_node"] = 4
    config["train"].update(tensor_parallel_size=4, parallelism="fsdp")
    assert main(["plan", "--config", write(tmp_path, config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchpilot: error: train.tensor_parallel_size: is 4") and fragment in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_memory_model_splits_matrices_and_activations_over_the_group():
    """GPT-3 5B shape on 64 devices under fsdp at tp 2: each device holds half of every matrix and whole
    LayerNorms (the replicated part), sharded 32 ways; a block's activations are split but for the gathered
    inputs of the column-parallel projections (one per norm); the logits stay whole."""
    e = estimate_memory(
        shape=GPT_5B, strategy="fsdp", world_size=64, devices_per_node=8, micro_batch_size=4, seq_len=SEQ,
        mixed_precision=True, activation_checkpointing=False, tensor_parallel_size=2,
    )  # fmt: skip
    replicated = (2 * LAYERS + 1) * H
    per_device = (GPT_5B.num_params - replicated) / 2 + replicated
    assert (e.parameters, e.gradients, e.optimizer) == tuple(
        math.ceil(b * per_device / 32) for b in (4, 4, 8)
    )
    assert e.shard_degree == 32 and e.tensor_parallel_size == 2
    # Per token of a block at tp 1 (test_memory_model): 4h of projection inputs whole, the rest (two norms
    # 2 x (2h + 8), QKV and the output projection's input 8h, 32 fp32 log-sum-exps, GELU 16h) split in two;
    # the final norm's (2h + 8) split, the head's input (2h) and the 12 bytes per logit whole.
    block = 4 * H + (28 * H + 16 + 4 * HEADS) / 2
    head = (2 * H + 8) / 2 + 2 * H + 12 * VOCAB
    assert e.activations == 4 * SEQ * math.ceil(LAYERS * block + head)
    # NCCL: fsdp's communicator and the tensor-parallel group's, 2 x 32 channels x 4 MiB each.
    assert e.communication == 2 * 2 * 32 * 4 * 2**20
