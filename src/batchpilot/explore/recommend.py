"""The recommendation after any number of probes: the fastest measured size, its speed-up over the base
probe, a confidence score, and what it means for the plan (divisibility, nearby valid global batches).

Confidence (0-99) estimates how sure we are that the recommended size is within `EQUIVALENCE` (3%) of
the fastest fitting one, from what was measured:
- timing: for every other measured size, the probability (normal approximation, from the relative
  standard errors of the two throughputs) that it is not more than 3% faster than the recommendation;
  the product over all of them;
- coverage: how much faster the unprobed sizes may be (the gap bounds of `search`): 1 when no gap may
  beat the recommendation by more than 3%, less in proportion when one may;
- a factor 0.9 while no size was measured twice (the noise between processes is then unknown).
It is capped at 99: a measurement never proves the optimum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from batchpilot.explore.search import EQUIVALENCE, Point, SearchState, gaps
from batchpilot.planning.nodes import data_parallel_size, nearest_valid_batch_sizes

UNMEASURED_BETWEEN_NOISE_FACTOR = 0.9


@dataclass
class Recommendation:
    """The recommended configuration of one device (the explore.json `recommendation`)."""

    micro_batch_size: int
    activation_checkpointing: bool
    compile: bool
    estimated_speedup: float
    confidence: int
    samples_per_s: float
    tokens_per_s: float
    peak_memory_bytes: int
    base_micro_batch_size: int
    reasoning: list[str] = field(default_factory=list)
    plan_notes: list[str] = field(default_factory=list)
    plan_compatible_micro_batch_size: int | None = None
    plan_compatible_activation_checkpointing: bool | None = None
    plan_compatible_compile: bool | None = None

    def line(self) -> str:
        """`current recommendation: micro_batch_size=24 (activation checkpointing off), ...`."""
        label = "on" if self.activation_checkpointing else "off"
        compiled = ", compiled" if self.compile else ""
        return (
            f"current recommendation: micro_batch_size={self.micro_batch_size} (activation checkpointing "
            f"{label}{compiled}), estimated {self.estimated_speedup:.2f}x the base, confidence "
            f"{self.confidence}/100"
        )


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def timing_confidence(best: Point, others: list[Point]) -> float:
    """P(no other measured size is truly more than EQUIVALENCE faster than `best`)."""
    probability = 1.0
    for other in others:
        margin = (best.tokens_per_s - other.tokens_per_s) / best.tokens_per_s + EQUIVALENCE
        spread = max(math.hypot(best.rel_noise, other.rel_noise), 1e-6)
        probability *= _normal_cdf(margin / spread)
    return probability


def coverage_confidence(state: SearchState, best: Point) -> float:
    """1 when no unprobed size may beat `best` by more than EQUIVALENCE, less as the bound rises."""
    bound = max((g.bound_tokens_per_s for g in gaps(state)), default=0.0)
    return min(1.0, (1 + EQUIVALENCE) * best.tokens_per_s / max(bound, best.tokens_per_s))


def confidence_score(state: SearchState, best: Point) -> tuple[int, list[str]]:
    """The 0-99 score and one line per factor."""
    others = [p for p in state.all_points() if p != best]
    timing = timing_confidence(best, others)
    coverage = coverage_confidence(state, best)
    between = state.between_process_noise()
    repeats = 1.0 if between is not None else UNMEASURED_BETWEEN_NOISE_FACTOR
    score = min(99, math.floor(99 * timing * coverage * repeats))
    noise = (
        f"repeated probes differ by {between:.1%} (one probe's relative spread)"
        if between is not None
        else "no size measured twice yet, so the noise between processes is unknown (x0.9)"
    )
    return score, [
        f"timing: {timing:.2f} = P(none of the {len(others)} other measured sizes is more than "
        f"{EQUIVALENCE:.0%} faster), from a {best.rel_noise:.1%} relative standard error here; {noise}",
        f"coverage: {coverage:.2f} = how close the best measured size is to the highest throughput an "
        "unprobed size may reach (pass time never shrinks with the batch; throughput assumed concave)",
    ]


def recommend(state: SearchState) -> Recommendation | None:
    """The fastest measured size so far (None while nothing fits)."""
    best, base = state.best(), state.base()
    if best is None or base is None:
        return None
    base_tokens_per_s = next(
        p.tokens_per_s for p in state.points(base.setting) if p.micro_batch_size == base.micro_batch_size
    )
    score, reasons = confidence_score(state, best)
    return Recommendation(
        micro_batch_size=best.micro_batch_size,
        activation_checkpointing=best.setting.activation_checkpointing,
        compile=best.setting.compile,
        estimated_speedup=best.tokens_per_s / base_tokens_per_s,
        confidence=score,
        samples_per_s=best.samples_per_s,
        tokens_per_s=best.tokens_per_s,
        peak_memory_bytes=best.peak_memory_bytes,
        base_micro_batch_size=base.micro_batch_size,
        reasoning=[
            f"fastest of {len(state.all_points())} fitting measured sizes: {best.tokens_per_s:,.0f} tokens/s "
            f"at micro_batch_size={best.micro_batch_size} ({best.setting.label()}), vs "
            f"{base_tokens_per_s:,.0f} at the base probe (micro_batch_size={base.micro_batch_size})",
            *reasons,
        ],
    )


def plan_choice(compatible: list[Point]) -> Point | None:
    """The micro batch a plan should use among those it can: the fastest, or a larger one as fast.

    Sizes whose throughputs differ by less than `EQUIVALENCE` or by less than two standard errors of
    the timing noise are equally fast as far as the measurements can tell; among those the largest wins,
    because a larger micro batch needs fewer accumulation passes (less per-pass overhead) for the same
    global batch.
    """
    fastest = max(compatible, key=lambda p: p.tokens_per_s, default=None)
    if fastest is None:
        return None

    def as_fast(point: Point) -> bool:
        tolerance = max(EQUIVALENCE, 2 * math.hypot(point.rel_noise, fastest.rel_noise))
        return point.tokens_per_s >= fastest.tokens_per_s * (1 - tolerance)

    return max((p for p in compatible if as_fast(p)), key=lambda p: (p.micro_batch_size, p.tokens_per_s))


@dataclass(frozen=True)
class Topology:
    """What the plan needs of a micro batch: the target batch and the devices it is split over."""

    global_batch_size: int
    devices_per_node: int
    min_nodes: int
    max_nodes: int
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # Why a micro batch does not fit every stage of the ramp-up (None: it fits); unset = final stage only.
    stage_error: Callable[[int], str | None] | None = None

    @property
    def data_parallel_size(self) -> int | None:
        return data_parallel_size(
            num_nodes=self.max_nodes,
            devices_per_node=self.devices_per_node,
            pipeline_parallel_size=self.pipeline_parallel_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def divides(self, micro_batch_size: int) -> bool:
        """Whether the plan can use this micro batch: the final stage, and every stage when known."""
        dp = self.data_parallel_size
        if dp is None or self.global_batch_size % (micro_batch_size * dp):
            return False
        return self.stage_error is None or self.stage_error(micro_batch_size) is None


def plan_notes(*, recommendation: Recommendation, state: SearchState, topology: Topology) -> None:
    """Fills `plan_notes` and `plan_compatible_micro_batch_size` of `recommendation`."""
    micro, target, dp = (
        recommendation.micro_batch_size,
        topology.global_batch_size,
        topology.data_parallel_size,
    )
    compatible = [p for p in state.all_points() if topology.divides(p.micro_batch_size)]
    fastest_compatible = plan_choice(compatible)
    if fastest_compatible is not None:
        recommendation.plan_compatible_micro_batch_size = fastest_compatible.micro_batch_size
        recommendation.plan_compatible_activation_checkpointing = (
            fastest_compatible.setting.activation_checkpointing
        )
        recommendation.plan_compatible_compile = fastest_compatible.setting.compile
    final_divides = dp is not None and target % (micro * dp) == 0
    if final_divides and not topology.divides(micro):
        assert topology.stage_error is not None
        notes = [
            f"micro_batch_size={micro} fits the final stage but not the ramp-up: {topology.stage_error(micro)}"
        ]
        if fastest_compatible is not None:
            notes.append(
                f"the plan uses micro_batch_size={fastest_compatible.micro_batch_size} "
                f"({fastest_compatible.setting.label()}), the fastest measured size that fits every stage "
                "(or a larger one as fast within the timing noise): "
                f"{fastest_compatible.tokens_per_s / recommendation.tokens_per_s:.2f}x the recommendation's throughput"
            )
        recommendation.plan_notes = notes
        return
    if topology.divides(micro):
        recommendation.plan_notes = [
            f"micro_batch_size={micro} divides global_batch_size {target} / data_parallel_size {dp} = "
            f"{target // (dp or 1)}: gradient_accumulation_steps {target // (micro * (dp or 1))} in the final stage"
        ]
        return
    below, above = nearest_valid_batch_sizes(
        target,
        node_range=range(topology.max_nodes, topology.max_nodes + 1),  # the final stage's node count
        micro_batch_size=micro,
        devices_per_node=topology.devices_per_node,
        pp=topology.pipeline_parallel_size,
        tp=topology.tensor_parallel_size,
    )
    nearby = " or ".join(str(b) for b in (below, above) if b is not None) or "none"
    notes = [
        f"micro_batch_size={micro} does not divide global_batch_size {target} / data_parallel_size {dp} "
        f"(max_nodes {topology.max_nodes} x devices_per_node {topology.devices_per_node}); nearby valid "
        f"global batch sizes for it: {nearby} (set batch.global_batch_size and the ramp-up accordingly)"
    ]
    if fastest_compatible is not None:
        ratio = fastest_compatible.tokens_per_s / recommendation.tokens_per_s
        notes.append(
            f"or keep global_batch_size {target} with micro_batch_size={fastest_compatible.micro_batch_size} "
            f"({fastest_compatible.setting.label()}), the fastest measured size that divides it "
            "(or a larger one as fast within the timing noise): "
            f"{ratio:.2f}x the recommendation's throughput"
        )
    recommendation.plan_notes = notes
