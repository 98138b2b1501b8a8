"""Issue #23: an adaptive ramp-up never grows to a stage that would not fit the device. The node walk
places some batch sizes on fewer nodes than the stage before (272 = micro 2 x 8 GPUs x 17 runs on 1 node
with 17 passes when 17 nodes exceed the target's 16); under fsdp a 1-node stage holds an eighth of the
model per GPU, which for a ~40B model is more than an H100 has. Those sizes are left out of the accepted
sizes, each with its reason; the rest are kept."""

from __future__ import annotations

import yaml

from batchpilot.config import parse_config
from batchpilot.plan.adaptive import accepted_batch_sizes
from batchpilot.plan.planner import make_run_document
from batchpilot.planning.nodes import Placement, walk_nodes
from batchpilot.train.shape import model_shape
from helpers import REPO


def large_adaptive_config() -> dict:
    data = yaml.safe_load((REPO / "configs" / "llama_5b.yaml").read_text())
    data["model"]["args"]["n_layer"] = 400  # llama_5b's blocks, 400 of them: about 41B parameters
    data["batch"]["rampup"] = {"adaptive": {"start": 128, "samples": 2_000_000, "patience_samples": 4096}}
    data["train"].update(activation_checkpointing=True, parallelism="fsdp")
    data["explore"] = {"study": False}
    return data


def test_sizes_whose_stage_would_not_fit_are_never_accepted():
    config = parse_config(large_adaptive_config())
    shape = model_shape(factory=config.model.factory, args=config.model.args)
    document = make_run_document(config, shape=shape)
    micro = document.plan.micro_batch_size
    assert document.memory is not None and document.memory.strategy == "fsdp"
    everything, none_left_out = accepted_batch_sizes(config, micro_batch_size=micro)
    assert none_left_out == {}  # without the memory plan, only placement counts
    accepted, too_big = accepted_batch_sizes(
        config, micro_batch_size=micro, memory=document.memory, shape=shape
    )
    assert 272 in everything and 272 in too_big and 272 not in accepted
    assert walk_nodes(
        batch_sizes=[272], micro_batch_size=micro, placement=Placement(devices_per_node=8, max_nodes=16)
    ) == [1]
    assert too_big[272].startswith("on 1 node(s) it needs ") and "under fsdp (shard degree 8)" in too_big[272]
    assert sorted(accepted + list(too_big)) == everything
    assert 128 in accepted and 256 in accepted and accepted[-1] == config.batch.target_bound
