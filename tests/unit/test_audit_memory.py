"""The per-device memory check (`planning.memory`), the rule a one-line slip would break unseen: an estimate
exactly at the device's memory fits (`<=`, not `<`), in the strategy `auto` picks, in a requested strategy's
check and in `MemoryPlan.fits`; one byte less does not.

The device sizes are derived from the memory model's own estimates of the stages (a plan made unchecked),
not written as numbers.
"""

from __future__ import annotations

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.planning import LRSchedule, megatron_rampup, plan_stages
from batchpilot.planning.memory import MemoryPlan, plan_memory
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.nodes import Placement

H, LAYERS, VOCAB, SEQ = 1024, 8, 32000, 1024
BLOCK = 12 * H * H + 13 * H
SHAPE = ModelShape(
    num_params=VOCAB * H + SEQ * H + LAYERS * BLOCK + 2 * H, num_layers=LAYERS, hidden_size=H,
    vocab_size=VOCAB, ffn_hidden_size=4 * H, largest_block_params=BLOCK, num_heads=16,
)  # fmt: skip
STAGES = plan_stages(
    schedule=megatron_rampup(start=64, increment=64, ramp_samples=100_000, target=256),
    total_samples=200_000,
    micro_batch_size=4,
    lr_schedule=LRSchedule(
        lr=1e-4,
        scaling="none",
        reference_batch=256,
        warmup_samples=0,
        decay="constant",
        decay_end_samples=0,
        min_lr_ratio=0,
    ),
    placement=Placement(devices_per_node=8, max_nodes=4, min_nodes=1),
).stages


def memory(requested: str, device_memory_bytes: int | None) -> MemoryPlan:
    return plan_memory(
        requested=requested, shape=SHAPE, stages=STAGES, devices_per_node=8, seq_len=SEQ, mixed_precision=True,
        activation_checkpointing=False, activation_bytes_per_sample=None, device_memory_bytes=device_memory_bytes,
    )  # fmt: skip


def peak_bytes(strategy: str) -> int:
    """The strategy's largest per-device estimate over the stages (planned with the memory unknown)."""
    return memory(strategy, None).peak.estimate.total


def test_auto_takes_ddp_when_its_peak_is_exactly_the_devices_memory():
    assert peak_bytes("ddp") > peak_bytes("fsdp")  # ddp replicates: a device one byte short needs sharding
    exactly = memory("auto", peak_bytes("ddp"))
    assert (exactly.strategy, exactly.fits) == ("ddp", True)
    assert memory("auto", peak_bytes("ddp") - 1).strategy != "ddp"


def test_a_requested_strategy_exactly_at_the_devices_memory_is_accepted():
    fsdp_peak = peak_bytes("fsdp")
    exactly = memory("fsdp", fsdp_peak)
    assert (exactly.strategy, exactly.fits) == ("fsdp", True)
    with pytest.raises(BatchpilotError, match=r"fsdp needs .* per device at stage"):
        memory("fsdp", fsdp_peak - 1)


def test_a_plan_read_back_exactly_at_the_devices_memory_fits():
    planned = memory("ddp", None)
    at_device = MemoryPlan(strategy="ddp", stages=planned.stages, device_memory_bytes=peak_bytes("ddp"))
    assert at_device.fits is True
    assert MemoryPlan.from_dict(at_device.to_dict()).fits is True
    short = MemoryPlan(strategy="ddp", stages=planned.stages, device_memory_bytes=peak_bytes("ddp") - 1)
    assert short.fits is False
