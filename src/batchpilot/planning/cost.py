"""Cost estimate: each stage's duration and node-hours from a measured per-device throughput."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.planning.stages import Plan


@dataclass(frozen=True)
class StageCost:
    """Estimated wall-clock time and node-hours of one stage."""

    index: int
    duration_s: float
    node_hours: float


@dataclass(frozen=True)
class CostEstimate:
    """Per-stage costs, the total, and the same run on a pool held at max_nodes throughout.

    A pool held at `max_nodes` cannot make the small-batch stages faster (their batch does not split over
    more nodes), so it pays for idle nodes; `static_pool_node_hours` is what that costs.
    """

    stages: tuple[StageCost, ...]
    samples_per_s_per_device: float
    static_pool_node_hours: float

    @property
    def duration_s(self) -> float:
        return sum(stage.duration_s for stage in self.stages)

    @property
    def node_hours(self) -> float:
        return sum(stage.node_hours for stage in self.stages)

    @property
    def saving_ratio(self) -> float:
        """Fraction of the static pool's node-hours that resizing per stage saves."""
        if self.static_pool_node_hours <= 0:
            return 0.0
        return 1.0 - self.node_hours / self.static_pool_node_hours


def estimate_cost(plan: Plan, *, samples_per_s_per_device: float) -> CostEstimate:
    """Estimates durations assuming throughput scales linearly with the stage's device count.

    Args:
        plan: the stages to cost.
        samples_per_s_per_device: measured training throughput of one device at the plan's micro batch.
    """
    if samples_per_s_per_device <= 0:
        raise ValueError("samples_per_s_per_device must be positive")
    stage_costs = []
    static = 0.0
    for stage in plan.stages:
        duration_s = stage.num_samples / (samples_per_s_per_device * stage.world_size)
        stage_costs.append(
            StageCost(
                index=stage.index, duration_s=duration_s, node_hours=duration_s / 3600 * stage.num_nodes
            )
        )
        static += duration_s / 3600 * plan.max_nodes
    return CostEstimate(
        stages=tuple(stage_costs),
        samples_per_s_per_device=samples_per_s_per_device,
        static_pool_node_hours=static,
    )
