"""Node scheduling per stage (NeMo launcher rule) and the batch arithmetic around it."""

from fractions import Fraction

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.planning import (
    gradient_accumulation_steps,
    num_loading_hosts,
    schedule_nodes,
    unschedulable_stages,
)
from batchpilot.planning.batch import check_pipeline_microbatches, global_batch_to_load
from batchpilot.planning.nodes import Placement, data_parallel_size


def test_nemo_gpt3_5b_node_schedule():
    nodes = schedule_nodes(
        batch_sizes=[256, 512, 768, 1024, 1280, 1536, 1792, 2048],
        micro_batch_size=4,
        placement=Placement(devices_per_node=8, max_nodes=16),
    )
    assert nodes == [8, 8, 8, 8, 10, 12, 14, 16]


def test_min_nodes_is_respected_and_nodes_never_decrease():
    nodes = schedule_nodes(
        batch_sizes=[32, 64, 96, 128],
        micro_batch_size=4,
        placement=Placement(devices_per_node=4, max_nodes=4),
    )
    assert nodes == [2, 2, 3, 4]
    with pytest.raises(BatchpilotError) as info:
        schedule_nodes(
            batch_sizes=[32, 64, 96, 128],
            micro_batch_size=4,
            placement=Placement(devices_per_node=4, max_nodes=4, min_nodes=3),
        )
    # 64 cannot use 3 nodes (48 per pass) and 2 is below min_nodes.
    assert info.value.field == "stage 1 (global_batch_size=64)"
    assert "48 or 96" in str(info.value)


def test_no_node_count_fits_names_stage_and_suggests_batches():
    with pytest.raises(BatchpilotError) as info:
        schedule_nodes(
            batch_sizes=[100, 256], micro_batch_size=4, placement=Placement(devices_per_node=8, max_nodes=8)
        )
    message = str(info.value)
    assert message.startswith("stage 0 (global_batch_size=100): no node count in [1, 8]")
    assert "96 or 128" in message


def test_pipeline_and_tensor_parallel_shrink_data_parallel_size():
    assert (
        data_parallel_size(num_nodes=2, devices_per_node=8, pipeline_parallel_size=2, tensor_parallel_size=2)
        == 4
    )
    assert data_parallel_size(num_nodes=1, devices_per_node=2, pipeline_parallel_size=4) is None
    nodes = schedule_nodes(
        batch_sizes=[8, 16],
        micro_batch_size=1,
        placement=Placement(devices_per_node=8, max_nodes=4, pipeline_parallel_size=4),
    )
    assert nodes == [4, 4]


def test_gradient_accumulation_steps():
    assert (
        gradient_accumulation_steps(global_batch_size=2048, micro_batch_size=4, data_parallel_size=128) == 4
    )
    with pytest.raises(BatchpilotError, match="not divisible by micro_batch_size 3"):
        gradient_accumulation_steps(global_batch_size=64, micro_batch_size=3, data_parallel_size=2)


def test_expansion_factor_loading_hosts():
    assert global_batch_to_load(global_batch_size=64, expansion_factor=Fraction(2)) == 128
    assert global_batch_to_load(global_batch_size=64, expansion_factor=Fraction(1, 2)) == 32
    with pytest.raises(BatchpilotError, match="not a whole number"):
        global_batch_to_load(global_batch_size=3, expansion_factor=Fraction(1, 2))
    assert num_loading_hosts(num_hosts=4, expansion_factor=Fraction(2), samples_per_host_pass=8) == 2
    assert num_loading_hosts(num_hosts=3, expansion_factor=Fraction(1, 2), samples_per_host_pass=8) == 3
    with pytest.raises(BatchpilotError, match="fractional number of loading hosts"):
        num_loading_hosts(num_hosts=3, expansion_factor=Fraction(2), samples_per_host_pass=8)
    with pytest.raises(BatchpilotError, match=r"share .* is fractional"):
        num_loading_hosts(num_hosts=3, expansion_factor=Fraction(3, 2), samples_per_host_pass=1)


def test_pipeline_microbatches():
    check_pipeline_microbatches(num_pipeline_microbatches=8, pipeline_parallel_size=4, per_pass_batch=32)
    with pytest.raises(BatchpilotError, match="not a multiple of pipeline_parallel_size 4"):
        check_pipeline_microbatches(num_pipeline_microbatches=6, pipeline_parallel_size=4, per_pass_batch=24)
    with pytest.raises(BatchpilotError, match="does not divide the per-pass batch"):
        check_pipeline_microbatches(num_pipeline_microbatches=8, pipeline_parallel_size=4, per_pass_batch=12)


def test_every_stage_that_cannot_fit_is_named_on_one_line_with_fitting_micro_batches():
    """NeMo's 5B ramp at micro batch 3: five stages cannot split; 2 and 4 fit them all."""
    with pytest.raises(BatchpilotError) as info:
        schedule_nodes(
            batch_sizes=[256, 512, 768, 1024, 1280, 1536, 1792, 2048],
            micro_batch_size=3,
            placement=Placement(devices_per_node=8, max_nodes=16),
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("stage 7 (global_batch_size=2048): no node count in [1, 16]")
    assert "; nor stage(s) 6 (1792), 4 (1280), 3 (1024), 1 (512), 0 (256) (fix:" in message
    assert "or micro_batch_size 2 or 4 (each fits every stage)" in message


def test_loading_hosts_divide_the_chosen_node_counts():
    """Factor 4: only multiples of 4 nodes; before, the walk chose 10 and 14 and the trainer refused them."""
    batches = [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    nodes = schedule_nodes(
        batch_sizes=batches,
        micro_batch_size=4,
        placement=Placement(devices_per_node=8, max_nodes=16, loading_factor=4),
    )
    assert nodes == [8, 8, 8, 8, 8, 8, 8, 16]
    assert schedule_nodes(
        batch_sizes=batches,
        micro_batch_size=4,
        placement=Placement(devices_per_node=8, max_nodes=16, loading_factor=2),
    ) == [8, 8, 8, 8, 10, 12, 14, 16]
    with pytest.raises(BatchpilotError, match=r"^data\.expansion_factor_real_data: 32 divides no node count"):
        schedule_nodes(
            batch_sizes=batches,
            micro_batch_size=4,
            placement=Placement(devices_per_node=8, max_nodes=16, loading_factor=32),
        )


def test_unschedulable_stages_are_those_micro_batch_1_cannot_place():
    # 8 devices per node: 100 and 108 leave a remainder of 4 on every node count, at any micro batch.
    assert unschedulable_stages(
        batch_sizes=[100, 104, 108, 2048], placement=Placement(devices_per_node=8, max_nodes=16)
    ) == [0, 2]
    assert (
        unschedulable_stages(
            batch_sizes=[96, 128], placement=Placement(devices_per_node=8, max_nodes=16, min_nodes=3)
        )
        == []
    )
    assert unschedulable_stages(
        batch_sizes=[16, 32], placement=Placement(devices_per_node=8, max_nodes=4, min_nodes=3)
    ) == [0]
