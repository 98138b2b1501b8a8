"""Plan notes of a recommendation and the study's advice (the probe process runner: test_explore_process.py)."""

from __future__ import annotations

import pytest

from batchpilot.explore.recommend import Recommendation, Topology, plan_notes
from batchpilot.explore.records import ProbeResult, Setting
from batchpilot.explore.search import SearchState
from batchpilot.explore.study import MultiplierResult, advise, format_samples


def state_with(sizes_tokens_per_s: dict[int, float]) -> SearchState:
    state = SearchState(settings=[Setting(False)], max_micro_batch_size=128, seq_len=10)
    for micro, tokens_per_s in sizes_tokens_per_s.items():
        step_s = micro * 10 / tokens_per_s
        state.add(
            ProbeResult(
                micro_batch_size=micro,
                activation_checkpointing=False,
                compile=False,
                fits=True,
                step_time_s=step_s,
                step_times_s=[step_s] * 3,
            )
        )
    return state


def recommendation(micro: int, tokens_per_s: float) -> Recommendation:
    return Recommendation(
        micro_batch_size=micro,
        activation_checkpointing=False,
        compile=False,
        estimated_speedup=2.0,
        confidence=80,
        samples_per_s=tokens_per_s / 10,
        tokens_per_s=tokens_per_s,
        peak_memory_bytes=1,
        base_micro_batch_size=1,
    )


def test_a_micro_batch_that_does_not_divide_the_plan_gets_nearby_global_batches_and_an_alternative():
    state = state_with({8: 900.0, 24: 1000.0})
    rec = recommendation(24, 1000.0)
    plan_notes(
        recommendation=rec, state=state, topology=Topology(64, devices_per_node=1, min_nodes=1, max_nodes=2)
    )
    assert (
        "micro_batch_size=24 does not divide global_batch_size 64 / data_parallel_size 2" in rec.plan_notes[0]
    )
    # The final stage runs on max_nodes (2 devices): multiples of 24 x 2 around 64.
    assert "nearby valid global batch sizes for it: 48 or 96" in rec.plan_notes[0]
    assert "micro_batch_size=8" in rec.plan_notes[1] and "0.90x" in rec.plan_notes[1]
    assert rec.plan_compatible_micro_batch_size == 8


def test_the_plan_takes_a_larger_compatible_size_when_it_is_as_fast_within_the_noise():
    topology = Topology(64, devices_per_node=1, min_nodes=1, max_nodes=2)
    # 24 is fastest but does not divide 64 / 2 devices; of 8 and 16, which do, 16 is 1% slower than 8:
    # timing cannot tell them apart, so the larger one is planned with.
    rec = recommendation(24, 1100.0)
    plan_notes(recommendation=rec, state=state_with({8: 1000.0, 16: 990.0, 24: 1100.0}), topology=topology)
    assert rec.plan_compatible_micro_batch_size == 16
    assert "or a larger one as fast within the timing noise" in rec.plan_notes[1]
    # 10% slower is a real difference: the faster, smaller size stays.
    rec = recommendation(24, 1100.0)
    plan_notes(recommendation=rec, state=state_with({8: 1000.0, 16: 900.0, 24: 1100.0}), topology=topology)
    assert rec.plan_compatible_micro_batch_size == 8


def test_a_dividing_micro_batch_reports_the_accumulation():
    rec = recommendation(8, 900.0)
    plan_notes(
        recommendation=rec,
        state=state_with({8: 900.0}),
        topology=Topology(64, devices_per_node=1, min_nodes=1, max_nodes=2),
    )
    assert rec.plan_notes == [
        "micro_batch_size=8 divides global_batch_size 64 / data_parallel_size 2 = 32: "
        "gradient_accumulation_steps 4 in the final stage"
    ]


def multipliers(*, g2: float, trace: float, micro: int) -> list[MultiplierResult]:
    return [
        MultiplierResult(
            multiplier=k,
            global_batch_size=k * micro,
            noise_scale=trace / g2,
            g2=g2,
            s=trace,
            grad_norm=1.0,
            coherence=0.5,
        )
        for k in (2, 4, 8, 16)
    ]


def test_advice_targets_a_valid_global_batch_near_the_critical_batch():
    report = advise(
        per_multiplier=multipliers(g2=2.0, trace=200.0, micro=8),
        micro_batch_size=8,
        configured_global_batch_size=64,
        devices_per_node=1,
        min_nodes=1,
        max_nodes=2,
        train_steps=4,
    )
    assert report.critical_batch_size == pytest.approx(100.0)
    assert report.recommended_global_batch_size == 104  # 96 and 104 are both 4 away: the larger wins
    assert report.lr_scaling == "sqrt"
    assert any("0.64x the critical batch" in line for line in report.reasoning)


def test_advice_above_the_critical_batch_stops_scaling_the_lr():
    report = advise(
        per_multiplier=multipliers(g2=10.0, trace=100.0, micro=4),
        micro_batch_size=4,
        configured_global_batch_size=256,
        devices_per_node=1,
        min_nodes=1,
        max_nodes=1,
        train_steps=0,
    )
    assert report.recommended_global_batch_size == 12 and report.lr_scaling == "none"


def test_an_unmeasurable_noise_scale_says_so_instead_of_guessing():
    report = advise(
        per_multiplier=multipliers(g2=-1.0, trace=5.0, micro=4),
        micro_batch_size=4,
        configured_global_batch_size=64,
        devices_per_node=1,
        min_nodes=1,
        max_nodes=1,
        train_steps=0,
    )
    assert report.critical_batch_size is None and report.recommended_global_batch_size is None
    assert "not measurable" in report.reasoning[0]


def test_batch_sizes_are_printed_for_people_and_small_noise_scales_are_not_zero():
    assert [format_samples(x) for x in (12345.6, 250.0, 48.2, 0.432)] == ["12,346", "250", "48", "0.43"]


def test_a_critical_batch_below_the_smallest_batch_measured_could_not_be_measured():
    # B_simple = S / |G|^2 = 0.35 samples at micro batch 4: below both batch sizes the study compares.
    noisy = advise(
        per_multiplier=multipliers(g2=10.0, trace=3.5, micro=4),
        micro_batch_size=4,
        configured_global_batch_size=64,
        devices_per_node=1,
        min_nodes=1,
        max_nodes=1,
        train_steps=0,
    )
    assert noisy.critical_batch_size is None and noisy.critical_batch_at_most == 4
    assert (
        noisy.recommended_global_batch_size == 4 and noisy.lr_scaling == "none"
    )  # at most 4: 64 is well above
    assert (
        "could not be measured" in noisy.reasoning[0]
        and "0.35 samples, below the smallest batch measured (4)" in noisy.reasoning[0]
    )
    at_the_edge = advise(  # exactly the smallest batch: measured
        per_multiplier=multipliers(g2=10.0, trace=40.0, micro=4),
        micro_batch_size=4,
        configured_global_batch_size=64,
        devices_per_node=1,
        min_nodes=1,
        max_nodes=1,
        train_steps=0,
    )
    assert (
        at_the_edge.critical_batch_size == pytest.approx(4.0) and at_the_edge.critical_batch_at_most is None
    )
