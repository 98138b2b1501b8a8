"""Ramp-up schedules in their three forms: thresholds, batch(consumed), and the errors users see."""

from fractions import Fraction

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.planning import explicit_schedule, maxtext_rampup, megatron_rampup, nearest_ramp
from batchpilot.planning.stages import sample_ranges


def batches_per_step(schedule, *, total_samples):
    """The global batch of every optimizer step, as training will step through them."""
    out = []
    for batch, start, end in sample_ranges(schedule, total_samples=total_samples):
        out += [batch] * ((end - start) // batch)
    return out


def test_megatron_small_schedule_literal():
    # start 1, increment 1, target 4 over 6 samples: 3 increments, one every 2 samples.
    schedule = megatron_rampup(start=1, increment=1, ramp_samples=6, target=4)
    assert [schedule.batch_at(c) for c in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    # Steps: 1,1 (to 2) -> 2 (to 4) -> 3 (to 7: overshoots 6) -> 4,4,...
    assert batches_per_step(schedule, total_samples=15) == [1, 1, 2, 3, 4, 4]


def test_megatron_gpt3_5b_step_counts():
    """[256, 256, 10M] to 2048: about 14,470 steps over the ramp versus 4,883 at a fixed 2048."""
    schedule = megatron_rampup(start=256, increment=256, ramp_samples=10_000_000, target=2048)
    assert schedule.batch_sizes == (256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert schedule.thresholds[1] == 1_428_572  # ceil(10M / 7)
    steps = batches_per_step(schedule, total_samples=10_000_000 + 2048 * 10)
    ramp_steps = sum(1 for batch in steps if batch < 2048)
    assert 14_460 <= ramp_steps <= 14_480
    assert ramp_steps == 14_470
    assert -(-10_000_000 // 2048) == 4_883


def test_megatron_batch_is_capped_at_target():
    schedule = megatron_rampup(start=16, increment=16, ramp_samples=4096, target=64)
    assert schedule.batch_at(10**12) == 64
    assert schedule.next_change_after(4096) is None


@pytest.mark.parametrize(
    ("start", "increment", "target", "message"),
    [
        (256, 300, 2048, "not a multiple of increment 300"),
        (2048, 256, 2048, "must be smaller than the target"),
        (4096, 256, 2048, "must be smaller than the target"),
        (0, 256, 2048, "must be positive"),
        (256, 0, 2048, "must be positive"),
    ],
)
def test_megatron_invalid(start, increment, target, message):
    with pytest.raises(BatchpilotError, match=message) as info:
        megatron_rampup(start=start, increment=increment, ramp_samples=1000, target=target)
    assert info.value.field == "batch.rampup"


def test_maxtext_levels_train_whole_steps_of_samples_per_increment():
    # 2 devices, per device 1 -> 3 by 1: global 2 -> 6 by 2, 10 samples over 2 increments = 5 per level.
    schedule = maxtext_rampup(
        per_device_start=Fraction(1),
        per_device_increment=Fraction(1),
        ramp_samples=10,
        target=6,
        num_devices=2,
    )
    # level 2: ceil(5/2)=3 steps (6 samples); level 4: ceil(5/4)=2 steps (8 samples).
    assert schedule.thresholds == (0, 6, 14)
    assert batches_per_step(schedule, total_samples=26) == [2] * 3 + [4] * 2 + [6] * 2


def test_maxtext_fractional_per_device_must_give_whole_global():
    with pytest.raises(BatchpilotError, match="not a whole number"):
        maxtext_rampup(
            per_device_start=Fraction(1, 2),
            per_device_increment=Fraction(1),
            ramp_samples=10,
            target=8,
            num_devices=3,
        )


def test_explicit_schedule_samples_suffixes_and_tokens():
    schedule = explicit_schedule("0:256 5M:512 10M:1024", target=1024, seq_len=2048)
    assert schedule.thresholds == (0, 5_000_000, 10_000_000)
    tokens = explicit_schedule("0:16 2K:32 512Kt:64", target=64, seq_len=128)
    assert tokens.thresholds == (0, 2000, 4000)  # 512,000 tokens / 128 tokens per sample
    # A token threshold that is not a whole number of samples rounds up to the first sample reaching it.
    assert explicit_schedule("0:16 1000t:32", target=32, seq_len=128).thresholds == (0, 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5:16 10:32", "must start at 0"),
        ("0:16 10:8 20:32", "increasing order"),
        ("0:16 10:32 5:64", "increasing order"),
        ("0:16 10:32", "ends at batch 32"),
        ("0:16 x:64", "is not a count"),
        ("0-16 10:64", "is not THRESHOLD:BATCH"),
        ("", "is empty"),
        ("0:16 1.5:64", "not a whole number"),
    ],
)
def test_explicit_schedule_invalid(text, message):
    with pytest.raises(BatchpilotError, match=message):
        explicit_schedule(text, target=64, seq_len=128)


def test_explicit_schedule_reports_every_bad_entry_and_suggests_the_ordered_schedule():
    with pytest.raises(BatchpilotError) as info:
        explicit_schedule("0:16 5X:32 1Y:48 4K:64", target=64, seq_len=128)
    assert str(info.value).splitlines() == [
        "batch.schedule (5X:32): '5X' is not a count (fix: write a number with an optional K, M, B or T "
        "suffix, e.g. 10M)",
        "batch.schedule (1Y:48): '1Y' is not a count (fix: write a number with an optional K, M, B or T "
        "suffix, e.g. 10M)",
    ]
    with pytest.raises(BatchpilotError) as info:
        explicit_schedule("0:32 1K:16 2K:64", target=64, seq_len=128)
    assert str(info.value).endswith(
        '(fix: list thresholds and batch sizes in increasing order, e.g. schedule: "0:16 1K:32 2K:64")'
    )


def test_nearest_ramp_keeps_the_shape_within_the_limit():
    """NeMo's [100, 4] to 2048 on 8-device nodes: the closest ramp of multiples of 8 within 64 levels."""
    found = nearest_ramp(
        start=Fraction(100),
        increment=Fraction(4),
        target=2048,
        max_levels=64,
        step=8,
        accept=lambda s, i: True,
    )
    assert found == (96, 32)  # 62 levels, start 96 ~ 100
    assert nearest_ramp(
        start=Fraction(16),
        increment=Fraction(16),
        target=2048,
        max_levels=64,
        step=8,
        accept=lambda s, i: s % 32 == 0,
    ) == (32, 32)
    assert (
        nearest_ramp(
            start=Fraction(1),
            increment=Fraction(1),
            target=8,
            max_levels=64,
            step=1,
            accept=lambda s, i: False,
        )
        is None
    )
