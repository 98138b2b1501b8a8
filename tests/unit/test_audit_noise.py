"""The gradient noise scale (`train.noise`, `planning.noise`), the rules a one-line slip would break unseen:

- B_simple = S / |G|^2 of the smoothed terms is a measurement only when both are positive: a negative (or
  zero) smoothed S, or |G|^2, gives None, never a negative or zero batch;
- the moving average weights the newest step by (1 - decay) and each older one by a further factor decay,
  bias-corrected: after n steps it is the mean of the steps with weights decay^age over their sum;
- `state_dict` / `load_state_dict` carry every part of the average (decay included): a resumed average
  continues exactly as the uninterrupted one;
- which steps measure (`noise_measurement`): ddp, fsdp and hsdp with several ranks per shard group, on
  several data-parallel ranks, every step from the ranks' own gradients; accumulation 2 or more every step;
  otherwise a step at accumulation 1 is split in halves only when its micro batch is even
  (an odd micro batch cannot be halved: no measurement), every `measure_noise_every_steps`-th step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpilot.planning.noise import NoiseMeasurement, noise_measurement, splits_step, why_unmeasured
from batchpilot.train.noise import NoiseScaleEMA

STEPS = [(2.0, 30.0), (1.0, 10.0), (4.0, 50.0), (3.0, 20.0)]  # (|G|^2, S) per step, oldest first


def weighted_mean(values: list[float], decay: float) -> float:
    """The bias-corrected exponential average by its definition: weights decay^age, newest age 0."""
    weights = [decay ** (len(values) - 1 - k) for k in range(len(values))]
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


def test_a_negative_smoothed_s_is_no_measurement():
    ema = NoiseScaleEMA(decay=0.5)
    assert ema.add(g2=1.0, s=-4.0) is None
    # A later positive step that leaves the average of S negative is still no measurement:
    # smoothed S = (0.5 x -4 + 1) / 1.5 < 0.
    assert ema.add(g2=1.0, s=1.0) is None


def test_a_zero_smoothed_s_is_no_measurement_either():
    ema = NoiseScaleEMA(decay=0.5)
    ema.add(g2=1.0, s=-2.0)
    assert ema.add(g2=1.0, s=4.0) == pytest.approx(2.0)  # smoothed S = (0.5 x -2 + 4) / 1.5 > 0
    ema = NoiseScaleEMA(decay=0.5)
    ema.add(g2=1.0, s=-1.0)
    assert weighted_mean([-1.0, 0.5], 0.5) == 0.0
    assert ema.add(g2=1.0, s=0.5) is None  # smoothed S = (0.5 x -1 + 0.5) / 1.5 = 0


def test_a_non_positive_smoothed_g2_is_no_measurement():
    assert NoiseScaleEMA(decay=0.5).add(g2=-1.0, s=4.0) is None
    assert NoiseScaleEMA(decay=0.5).add(g2=0.0, s=4.0) is None


def test_the_average_weights_the_newest_step_by_one_minus_decay():
    decay = 0.8
    ema = NoiseScaleEMA(decay=decay)
    for n, (g2, s) in enumerate(STEPS, start=1):
        value = ema.add(g2=g2, s=s)
        seen = STEPS[:n]
        expected = weighted_mean([s for _, s in seen], decay) / weighted_mean([g for g, _ in seen], decay)
        assert value == pytest.approx(expected, rel=1e-12)


def test_a_resumed_average_continues_as_the_uninterrupted_one():
    uninterrupted = NoiseScaleEMA(decay=0.8)
    for g2, s in STEPS[:3]:
        uninterrupted.add(g2=g2, s=s)
    saved = dict(uninterrupted.state_dict())
    resumed = NoiseScaleEMA()  # the trainer's default decay: the checkpoint's must win
    resumed.load_state_dict(saved)
    assert resumed.value == uninterrupted.value
    g2, s = STEPS[3]
    assert resumed.add(g2=g2, s=s) == uninterrupted.add(g2=g2, s=s)
    assert resumed.state_dict() == uninterrupted.state_dict()


def measurement(**changes: object) -> NoiseMeasurement:
    layout: dict = dict(
        strategy="xla", world_size=8, micro_batch_size=4, accumulation=1, split_every_steps=5, shard_degree=1
    )
    return noise_measurement(**{**layout, **changes})


def test_accumulation_two_measures_every_step_from_its_first_pass():
    assert measurement(accumulation=2, split_every_steps=0, micro_batch_size=3) is NoiseMeasurement.EVERY_STEP


def test_ddp_on_several_ranks_measures_every_step_and_on_one_it_does_not():
    assert measurement(strategy="ddp", split_every_steps=0) is NoiseMeasurement.LOCAL_GRADIENTS
    assert measurement(strategy="ddp", world_size=1, split_every_steps=0) is NoiseMeasurement.NONE


def test_sharded_ranks_measure_from_their_own_gradients_where_a_reduce_scatter_reads_them():
    """fsdp and hsdp on several data-parallel ranks read each rank's gradient from the reduce-scatter, at any
    micro batch; hsdp whose shard groups are one rank, one data-parallel rank, and XLA do not."""
    for strategy in ("fsdp", "hsdp"):
        for micro in (1, 3):
            assert (
                measurement(strategy=strategy, shard_degree=2, micro_batch_size=micro, split_every_steps=0)
                is NoiseMeasurement.LOCAL_GRADIENTS
            )
    assert measurement(strategy="hsdp", shard_degree=1, micro_batch_size=1) is NoiseMeasurement.NONE
    assert measurement(strategy="hsdp", shard_degree=1) is NoiseMeasurement.SPLIT_STEPS
    assert measurement(strategy="fsdp", world_size=1, shard_degree=1) is NoiseMeasurement.SPLIT_STEPS
    assert measurement(strategy="xla", shard_degree=8, micro_batch_size=1) is NoiseMeasurement.NONE


def test_an_odd_micro_batch_at_accumulation_one_is_not_split_and_says_why():
    assert measurement(micro_batch_size=4) is NoiseMeasurement.SPLIT_STEPS
    assert measurement(micro_batch_size=3) is NoiseMeasurement.NONE
    assert measurement(micro_batch_size=1) is NoiseMeasurement.NONE
    assert measurement(micro_batch_size=4, split_every_steps=0) is NoiseMeasurement.NONE
    assert why_unmeasured(micro_batch_size=3, split_every_steps=5) == (
        "its micro batch 3 cannot be split in two equal halves"
    )
    assert why_unmeasured(micro_batch_size=4, split_every_steps=0) == (
        "train.measure_noise_every_steps is 0 (no step is split in two halves)"
    )


def test_every_nth_step_is_split_counting_the_first_step_as_one():
    split = [
        step
        for step in range(1, 13)
        if splits_step(NoiseMeasurement.SPLIT_STEPS, step=step, split_every_steps=5)
    ]
    assert split == [5, 10]
    assert not any(
        splits_step(NoiseMeasurement.EVERY_STEP, step=s, split_every_steps=5) for s in range(1, 13)
    )


def test_the_plan_says_which_stages_cannot_measure_and_fsdp_ranks_at_micro_batch_1_can():
    """At micro batch 1 and accumulation 1 on 2 one-process nodes: ddp's and fsdp's ranks read their own
    gradients (no note); hsdp's one-rank shard groups cannot, nor can one rank split a micro batch of 1: the
    plan names the stage and why."""
    import yaml

    from batchpilot.config import parse_config
    from batchpilot.plan.planner import make_run_document

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_adaptive.yaml"

    def notes(parallelism: str, max_nodes: int = 2, shard_nodes: int = 1) -> list[str]:
        data = yaml.safe_load(demo.read_text())
        data["batch"] = {"global_batch_size": max_nodes, "micro_batch_size": 1}
        data["cluster"].update(max_nodes=max_nodes, min_nodes=max_nodes)
        data["train"]["parallelism"] = parallelism
        if parallelism == "hsdp":
            data["train"]["hsdp_shard_nodes"] = shard_nodes
        plan = make_run_document(parse_config(data)).plan
        assert plan.parallelism == parallelism
        assert {(s.micro_batch_size, s.gradient_accumulation_steps) for s in plan.stages} == {(1, 1)}
        return [note for note in plan.notes if note.startswith("noise scale not measured")]

    assert notes("ddp") == notes("fsdp") == notes("hsdp", shard_nodes=2) == []
    assert notes("hsdp") == [
        "noise scale not measured in final: accumulation 1 under hsdp and its micro batch 1 cannot be split in "
        "two equal halves (fix: an even micro batch >= 2)"
    ]
