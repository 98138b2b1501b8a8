"""A launch on fewer nodes than planned (`planning.capacity`, `workflow.capacity`, `plan.memory`), the rules a
one-line slip would break unseen:

- `fewer_nodes` takes a node count that EVERY stage of the launch splits its global batch over, not one that
  some stage splits over;
- the launch moved to fewer nodes has its per-device memory checked again (fsdp's share grows as the world
  shrinks): the resize step refuses the move, in one line naming cluster.fewer_nodes, when a moved stage
  needs more than the device; a stage that needs exactly the device's memory fits.

The memory limits are derived from plans of the same config on 2 and on 1 node (the memory model's own
estimates there), not written as numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import RunDocument
from batchpilot.plan.stages import build_plan
from batchpilot.planning.capacity import fewer_nodes
from batchpilot.planning.launches import launches
from batchpilot.planning.nodes import Placement
from batchpilot.workflow.capacity import prepare_launch_pool
from batchpilot.workflow.plan import plan
from helpers import tiny_config


def test_the_node_count_splits_every_stages_batch_not_only_one():
    config = tiny_config(data_uri="file:///data", checkpoint_uri="file:///ckpt")
    config["cluster"].update(devices_per_node=4, max_nodes=4)
    config["batch"].update(global_batch_size=64, micro_batch_size=2, schedule="0:16 960:64")
    stages = build_plan(parse_config(config), micro_batch_size=2).stages
    assert [s.global_batch_size for s in stages] == [16, 64]
    placement = Placement(devices_per_node=4, max_nodes=4, min_nodes=1)
    # Micro batch 2 on 4 devices a node: 64 splits over 4, 2 or 1 node(s), 16 over 2 or 1 (not 4: 2 x 16 > 16).
    assert fewer_nodes(stages[1:], available=4, placement=placement) == 4
    assert fewer_nodes(stages[:1], available=4, placement=placement) == 2
    assert fewer_nodes(stages, available=4, placement=placement) == 2
    assert fewer_nodes(list(reversed(stages)), available=4, placement=placement) == 2


def fsdp_document(tmp_path: Path, *, max_nodes: int, **cluster: object) -> RunDocument:
    """The tiny model under fsdp, batches 32 then 64 on one launch of `max_nodes` node(s) of 1 device."""
    config = tiny_config(data_uri="file:///data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["cluster"].update(pool_state_path=str(tmp_path / "pool.json"), max_nodes=max_nodes, **cluster)
    config["batch"]["schedule"] = "0:32 960:64"
    config["train"]["parallelism"] = "fsdp"
    return plan(parse_config(config), announce=False)


def peak_bytes(document: RunDocument) -> int:
    assert document.memory is not None
    return max(item.estimate.total for item in document.memory.stages)


@pytest.fixture(scope="module")
def needs(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, int]:
    """The per-device peak of the launch on its 2 planned nodes and on 1 node (fsdp shards over fewer)."""
    on_two = fsdp_document(tmp_path_factory.mktemp("two"), max_nodes=2)
    on_one = fsdp_document(tmp_path_factory.mktemp("one"), max_nodes=1)
    assert [(g.name, g.num_nodes) for g in launches(on_two.plan)] == [("stages-0-final", 2)]
    assert [(g.name, g.num_nodes) for g in launches(on_one.plan)] == [("stages-0-final", 1)]
    assert peak_bytes(on_one) > peak_bytes(on_two)
    return peak_bytes(on_two), peak_bytes(on_one)


def test_a_launch_moved_to_nodes_where_it_does_not_fit_is_refused(tmp_path, needs):
    _, on_one = needs
    document = fsdp_document(
        tmp_path, max_nodes=2, device_memory_bytes=on_one - 1, local_capacity_nodes=1, fewer_nodes="allow"
    )
    with pytest.raises(BatchpilotError) as refused:
        prepare_launch_pool(document, slot=0)
    assert str(refused.value).startswith("cluster.fewer_nodes: stage-0 on 1 node(s) needs ")
    assert "under fsdp (shard degree 1), more than the device's" in str(refused.value)
    assert not (tmp_path / "ckpt" / "capacity.json").exists()  # nothing recorded: the launch does not move


def test_a_launch_moved_to_nodes_it_exactly_fits_trains_there(tmp_path, needs):
    _, on_one = needs
    document = fsdp_document(
        tmp_path, max_nodes=2, device_memory_bytes=on_one, local_capacity_nodes=1, fewer_nodes="allow"
    )
    assert prepare_launch_pool(document, slot=0) == 1
