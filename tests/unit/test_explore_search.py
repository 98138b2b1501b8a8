"""The micro-batch search against a synthetic device: few probes, the fastest size, honest confidence."""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator

import pytest

from batchpilot.config import parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.explore.records import ProbeRequest, ProbeResult, Setting
from batchpilot.explore.runner import probe_request, search_micro_batch
from batchpilot.explore.search import SearchState
from helpers import tiny_config

SEQ_LEN = 32


def device(
    *, peak_at: int, frontier: int, ac_frontier: int, ac_cost: float = 1.3, crash_at: set[int] = frozenset()
):
    """A fake device: throughput rises, peaks at `peak_at` (not a power of two), then falls; memory ends
    at `frontier` (activation checkpointing off) or `ac_frontier` (on, `ac_cost` slower per sample)."""

    def measure(request: ProbeRequest) -> ProbeResult:
        micro, ac = request.micro_batch_size, request.activation_checkpointing
        result = ProbeResult(micro_batch_size=micro, activation_checkpointing=ac, compile=False, fits=False)
        result.peak_memory_bytes = 100 + micro * (1 if ac else 3)
        if micro in crash_at:
            result.error = "RuntimeError: boom"
            return result
        if micro > (ac_frontier if ac else frontier):
            result.error = "peak resident memory exceeds explore.memory_budget_bytes"
            return result
        return timed(result, peak_at=peak_at, slower=ac_cost if ac else 1.0)

    return measure


def timed(result: ProbeResult, *, peak_at: int, slower: float) -> ProbeResult:
    """`result` fitting, with five passes of a throughput that rises, peaks at `peak_at` and falls (`slower`
    times the pass time: activation checkpointing's recomputation)."""
    micro = result.micro_batch_size
    efficiency = micro / (micro + 4) * (1 - 0.004 * abs(micro - peak_at))
    step_s = micro * SEQ_LEN / (1000 * efficiency) * slower
    times = [step_s * (1 + 0.002 * ((i % 3) - 1)) for i in range(5)]
    result.fits = True
    result.step_time_s = sorted(times)[2]
    result.tokens_per_s = micro * SEQ_LEN / result.step_time_s
    result.samples_per_s = micro / result.step_time_s
    result.step_times_s = times
    result.repeats = len(times)
    return result


MIB = 2**20


def budget_device(*, peak_at: int, budget: int, ac_cost: float = 1.35, ac_mib_per_sample: float = 1.7):
    """A device whose memory decides what fits, as explore's CPU budget does: peak = 333 MiB + 1.9 MiB per sample
    (1.7 with activation checkpointing, `ac_cost` slower); throughput as `device`'s. With a 370 MiB budget
    19 fit without checkpointing and 21 with it, the demo model's figures in bench/explore_search.py."""

    def measure(request: ProbeRequest) -> ProbeResult:
        micro, ac = request.micro_batch_size, request.activation_checkpointing
        result = ProbeResult(micro_batch_size=micro, activation_checkpointing=ac, compile=False, fits=False)
        result.peak_memory_bytes = int(333 * MIB + micro * (ac_mib_per_sample if ac else 1.9) * MIB)
        if result.peak_memory_bytes > budget:
            result.error = "peak resident memory exceeds explore.memory_budget_bytes"
            return result
        return timed(result, peak_at=peak_at, slower=ac_cost if ac else 1.0)

    return measure


def config(*, accelerator: bool = False, **explore):
    raw = tiny_config(data_uri="file:///nowhere", checkpoint_uri="file:///nowhere/ckpt")
    raw["batch"]["global_batch_size"] = 256
    if accelerator:  # probes on a GPU: no CPU budget to predict the frontier with
        raw["cluster"]["accelerator_type"] = "nvidia-l4"
    raw["explore"] = {"max_probes": 40, **explore}
    return parse_config(raw)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged_lines(name: str) -> Iterator[list[str]]:
    """The messages logger `name` logs at INFO and above while the block runs."""
    handler = _Lines()
    logger = logging.getLogger(name)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def search(measure, *, sizes=None, accelerator=False, **explore):
    with logged_lines("batchpilot.explore.runner") as lines:
        state, recommendation, stopped = search_micro_batch(
            config=config(accelerator=accelerator, **explore),
            max_probes=config(**explore).explore.max_probes,
            max_minutes=5,
            micro_batch_sizes=sizes,
            measure=measure,
        )
    return state, recommendation, stopped, lines


def exhaustive(measure, upper: int) -> tuple[int, float]:
    """(probes, best tokens/s) of a sweep of every size of both settings up to the first that does not fit."""
    probes, best = 0, 0.0
    for ac in (False, True):
        for micro in range(1, upper + 1):
            probes += 1
            result = measure(_request(micro, ac))
            if not result.fits:
                break
            best = max(best, result.tokens_per_s)
    return probes, best


def _request(micro: int, ac: bool) -> ProbeRequest:
    return ProbeRequest(
        factory="f:g",
        model_args={},
        data_uri="file:///x",
        split="train",
        seq_len=SEQ_LEN,
        seed=0,
        verify_checksums=False,
        micro_batch_size=micro,
        activation_checkpointing=ac,
        compile=False,
        warmup_steps=1,
        timed_steps=3,
        min_timed_s=0.0,
        memory_budget_bytes=1,
    )


@pytest.mark.parametrize(
    ("peak_at", "frontier", "ac_frontier"), [(40, 100, 220), (150, 90, 200), (23, 256, 256), (6, 50, 120)]
)
def test_search_is_within_3_percent_of_an_exhaustive_sweep_with_at_most_40_percent_of_its_probes(
    peak_at, frontier, ac_frontier
):
    measure = device(peak_at=peak_at, frontier=frontier, ac_frontier=ac_frontier)
    sweep_probes, best_tokens_per_s = exhaustive(measure, 256)
    state, recommendation, stopped, _ = search(measure)
    assert stopped == "converged"
    assert recommendation.tokens_per_s >= 0.97 * best_tokens_per_s
    assert len(state.results) <= 0.4 * sweep_probes


def test_the_fastest_size_need_not_be_a_power_of_two_and_the_search_finds_it():
    measure = device(peak_at=40, frontier=100, ac_frontier=220)
    state, recommendation, _, _ = search(measure)
    assert recommendation.micro_batch_size not in {2**k for k in range(10)}
    assert recommendation.activation_checkpointing is False
    phases = [r.micro_batch_size for r in state.results[:7]]
    # grow while a larger size may still win: 64 is slower than 32, so by concavity nothing above 64 is faster
    assert phases == [1, 2, 4, 8, 16, 32, 64]
    assert all(r.micro_batch_size <= 64 for r in state.results if not r.activation_checkpointing)


def test_activation_checkpointing_wins_when_it_fits_a_faster_size():
    # Without checkpointing only 12 fit; with it (10% slower per sample) the 150 peak fits.
    measure = device(peak_at=150, frontier=12, ac_frontier=200, ac_cost=1.1)
    state, recommendation, _, _ = search(measure)
    assert recommendation.activation_checkpointing is True
    assert recommendation.micro_batch_size > 12
    first_ac = next(r for r in state.results if r.activation_checkpointing)
    assert first_ac.micro_batch_size >= 8  # starts near the frontier, not at 1


def test_every_probe_prints_a_recommendation_line_with_speedup_and_confidence():
    _, recommendation, _, lines = search(device(peak_at=40, frontier=100, ac_frontier=220))
    interim = [line for line in lines if line.startswith("current recommendation:")]
    assert len(interim) == len([line for line in lines if line.startswith("probe ")])
    assert "micro_batch_size=1 (activation checkpointing off), estimated 1.00x the base" in interim[0]
    assert interim[-1] == recommendation.line()
    confidences = [int(line.rsplit("confidence ", 1)[1].split("/")[0]) for line in interim]
    assert all(0 <= c <= 99 for c in confidences)
    assert confidences[-1] > confidences[0]


def test_confidence_stays_low_when_the_budget_stops_the_search_early():
    _, early, stopped, _ = search(device(peak_at=40, frontier=100, ac_frontier=220), max_probes=4)
    _, full, _, _ = search(device(peak_at=40, frontier=100, ac_frontier=220))
    assert stopped == "max_probes"
    assert early.confidence < 50 < full.confidence <= 99


def test_a_crashing_probe_does_not_fit_and_the_search_goes_on():
    measure = device(peak_at=40, frontier=100, ac_frontier=220, crash_at={64})
    state, recommendation, _, lines = search(measure)
    crashed = [r for r in state.results if r.micro_batch_size == 64 and not r.activation_checkpointing]
    assert crashed and not crashed[0].fits and crashed[0].error == "RuntimeError: boom"
    assert any("does not fit (RuntimeError: boom" in line for line in lines)
    assert recommendation.micro_batch_size < 64 and len(state.results) > 8


def test_an_impossible_budget_is_one_clear_error():
    with pytest.raises(
        BatchpilotError, match=r"explore.memory_budget_bytes: no setting fits even micro_batch_size=1"
    ):
        search(device(peak_at=4, frontier=0, ac_frontier=0))


def test_a_model_that_crashes_at_every_size_names_the_factory():
    with pytest.raises(BatchpilotError, match=r"model.factory: .*micro_batch_size=1: RuntimeError: boom"):
        search(device(peak_at=4, frontier=10, ac_frontier=10, crash_at=set(range(1, 300))))


def test_explicit_sizes_sweep_every_setting_and_skip_sizes_past_the_frontier():
    state, _, stopped, _ = search(
        device(peak_at=6, frontier=5, ac_frontier=8), sizes=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    )
    probed = [(r.activation_checkpointing, r.micro_batch_size) for r in state.results]
    assert stopped == "swept"
    assert probed == [(False, m) for m in range(1, 7)] + [(True, m) for m in range(1, 10)]


def test_recommended_speedup_is_relative_to_the_base_probe():
    _, recommendation, _, _ = search(device(peak_at=40, frontier=100, ac_frontier=220))
    base = 1 / (1 + 4) * (1 - 0.004 * 39)
    best = (
        recommendation.micro_batch_size
        / (recommendation.micro_batch_size + 4)
        * (1 - 0.004 * abs(recommendation.micro_batch_size - 40))
    )
    assert math.isclose(recommendation.estimated_speedup, best / base, rel_tol=0.01)


def machine_with_moods(measure, *, seed: int, pairing: bool = True):
    """`measure` on a shared machine whose speed drops by a third for a whole probe, at random.

    With `pairing`, a probe given a reference also reports the per-pass ratio to it, which the mood
    cannot change (both passes of a pair run in the same mood).
    """
    rng = random.Random(seed)

    def moody(request: ProbeRequest) -> ProbeResult:
        result = measure(request)
        if not result.fits:
            return result
        slow = 1.5 if rng.random() < 0.5 else 1.0
        result.step_times_s = [t * slow for t in result.step_times_s]
        result.step_time_s = (result.step_time_s or 0.0) * slow
        result.tokens_per_s = (result.tokens_per_s or 0.0) / slow
        reference = request.reference_micro_batch_size
        if pairing and reference is not None:
            own = result.tokens_per_s * slow
            base = measure(_request(reference, request.reference_activation_checkpointing)).tokens_per_s
            result.pair_ratios = [own / base * (1 + 0.003 * (i % 3 - 1)) for i in range(5)]
            result.relative_throughput = sorted(result.pair_ratios)[2]
        return result

    return moody


@pytest.mark.parametrize("seed", range(6))
def test_pairing_with_the_base_keeps_the_search_within_3_percent_on_a_moody_machine(seed):
    true = device(peak_at=40, frontier=100, ac_frontier=220)
    _, best = exhaustive(true, 256)
    _, recommendation, _, _ = search(machine_with_moods(true, seed=seed))
    measured = true(_request(recommendation.micro_batch_size, recommendation.activation_checkpointing))
    assert measured.tokens_per_s >= 0.97 * best


def test_probes_are_paired_with_the_base_only_when_that_is_safe():
    cfg = config()
    base = ProbeResult(micro_batch_size=2, activation_checkpointing=False, compile=False, fits=True)
    paired = probe_request(config=cfg, micro_batch_size=8, setting=Setting(True), reference=base)
    assert (paired.reference_micro_batch_size, paired.reference_activation_checkpointing) == (2, False)
    # Not with itself, not with a larger reference (it could raise the peak), not when compiled.
    for micro, setting in ((2, Setting(False)), (1, Setting(False)), (8, Setting(False, compile=True))):
        request = probe_request(config=cfg, micro_batch_size=micro, setting=setting, reference=base)
        assert request.reference_micro_batch_size is None
    assert (
        probe_request(config=cfg, micro_batch_size=8, setting=Setting(False)).reference_micro_batch_size
        is None
    )


def test_paired_and_unpaired_runs_of_one_size_are_not_mixed_in_the_noise_estimate():
    # The base size measured again has no reference (it would be paired with itself): its repeats are
    # compared by pass time, not a ratio of 1.0 against a throughput.
    state = SearchState(settings=[Setting(False)], max_micro_batch_size=8, seq_len=SEQ_LEN)
    for step_s in (0.010, 0.0101):
        state.add(
            ProbeResult(
                micro_batch_size=1,
                activation_checkpointing=False,
                compile=False,
                fits=True,
                step_time_s=step_s,
                tokens_per_s=SEQ_LEN / step_s,
                step_times_s=[step_s] * 3,
            )
        )
    assert state.between_process_noise() == pytest.approx(0.007, abs=0.001)
    assert state.points(Setting(False))[0].tokens_per_s == pytest.approx(SEQ_LEN / 0.01005, rel=1e-3)


def test_the_memory_frontier_is_predicted_from_the_peaks_and_a_slower_setting_stops_where_it_cannot_win():
    """Past 16 the line through the peaks at 8 and 16 says 19 is the last size that fits: grown to at once (no
    probe at 32, no bisection). Checkpointing (35% slower) is probed from where the setting without it stops
    fitting (20), then only where one pass could beat the best (28, which does not fit), then dropped. The
    search stays within 2% of the sweep's best with at most a quarter of its probes (#34's target)."""
    measure = budget_device(peak_at=14, budget=370 * MIB)
    sweep_probes, best_tokens_per_s = exhaustive(measure, 256)
    state, recommendation, stopped, _ = search(measure, memory_budget_bytes=370 * MIB)
    probes = [(r.micro_batch_size, r.activation_checkpointing) for r in state.results]
    assert probes[:6] == [(1, False), (2, False), (4, False), (8, False), (16, False), (19, False)]
    assert [micro for micro, ac in probes if ac] == [20, 28]
    assert stopped == "converged"
    assert recommendation.tokens_per_s >= 0.98 * best_tokens_per_s
    assert len(state.results) <= 0.25 * sweep_probes and sweep_probes == 42


def test_without_a_budget_the_frontier_is_bisected():
    """A GPU's limit is its own (no budget to predict against): 24 and 20 are probed after 32 fails."""
    measure = budget_device(peak_at=14, budget=370 * MIB)
    state, _, _, _ = search(measure, memory_budget_bytes=370 * MIB, accelerator=True)
    probes = [r.micro_batch_size for r in state.results if not r.activation_checkpointing]
    assert probes[:8] == [1, 2, 4, 8, 16, 32, 24, 20]


def test_checkpointing_that_fits_no_larger_size_is_dropped_after_one_probe():
    """Checkpointing recomputes the forward: it can only win at sizes the setting without it cannot fit. Here it
    saves no memory, so its one probe, where the setting without it stops fitting (20), does not fit either."""
    measure = budget_device(peak_at=40, budget=370 * MIB, ac_mib_per_sample=1.9)
    state, recommendation, stopped, _ = search(measure, memory_budget_bytes=370 * MIB)
    assert [r.micro_batch_size for r in state.results if r.activation_checkpointing] == [20]
    assert stopped == "converged" and recommendation.activation_checkpointing is False


def noisy_plateau(*, seed: int, noise: float = 0.03):
    """A device whose throughput rises to a plateau at 8 (every size from 8 to the frontier, 19, equally fast)
    measured with `noise` relative error per probe (a shared machine) and as much between a probe's passes."""
    rng = random.Random(seed)

    def measure(request: ProbeRequest) -> ProbeResult:
        micro, ac = request.micro_batch_size, request.activation_checkpointing
        result = ProbeResult(micro_batch_size=micro, activation_checkpointing=ac, compile=False, fits=False)
        result.peak_memory_bytes = int(333 * MIB + micro * (1.7 if ac else 1.9) * MIB)
        if result.peak_memory_bytes > 370 * MIB:
            result.error = "peak resident memory exceeds explore.memory_budget_bytes"
            return result
        step_s = (
            micro * SEQ_LEN / (1000 * min(micro, 8) / 8) * (1.35 if ac else 1.0) * (1 + rng.gauss(0, noise))
        )
        times = [step_s * (1 + rng.gauss(0, noise)) for _ in range(5)]
        result.fits, result.step_times_s, result.repeats = True, times, len(times)
        result.step_time_s = sorted(times)[2]
        result.tokens_per_s = micro * SEQ_LEN / result.step_time_s
        result.samples_per_s = micro / result.step_time_s
        return result

    return measure


@pytest.mark.parametrize("seed", range(5))
def test_on_a_noisy_plateau_the_search_stops_where_a_probe_cannot_resolve_the_difference(seed):
    """A gap whose bound beats the best by less than twice the typical measurement noise is not probed: on a
    plateau measured with 3% noise the lines through noisy points always promise a few percent more somewhere,
    and chasing that would spend the probes of a sweep. Every size of the plateau is a right answer."""
    state, recommendation, stopped, _ = search(noisy_plateau(seed=seed), memory_budget_bytes=370 * MIB)
    assert stopped == "converged"
    assert 8 <= recommendation.micro_batch_size <= 19 and recommendation.activation_checkpointing is False
    assert len(state.results) <= 10  # a quarter of a sweep's 40 (19 without checkpointing, 21 with)


def test_no_probe_goes_above_the_size_cap_even_where_memory_would_fit_far_more():
    """The demo's plan splits into micro batches of at most 16 while its memory would fit hundreds: the
    predicted memory frontier never takes a probe past the cap."""
    measure = budget_device(peak_at=40, budget=2048 * MIB)
    state, recommendation, stopped, _ = search(
        measure, memory_budget_bytes=2048 * MIB, max_micro_batch_size=16
    )
    assert max(r.micro_batch_size for r in state.results) == 16
    assert stopped == "converged" and recommendation.micro_batch_size == 16
