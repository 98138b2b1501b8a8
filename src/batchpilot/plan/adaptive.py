"""The adaptive ramp-up's rule read from the config, and the batch sizes it may grow to."""

from __future__ import annotations

from collections.abc import Sequence

from batchpilot.config import AdaptiveRampup, Config
from batchpilot.plan.memory import does_not_fit
from batchpilot.plan.schedule import placement
from batchpilot.plan.stages import build_plan
from batchpilot.planning.adaptive import AdaptiveRule, AdaptiveRun, StageDecision
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.nodes import walk_nodes


def is_adaptive(config: Config) -> bool:
    """Whether the ramp-up's stages are decided at run time (`rampup: {adaptive: ...}`)."""
    return isinstance(config.batch.rampup, AdaptiveRampup)


def adaptive_rule(config: Config) -> AdaptiveRule:
    """The adaptive ramp-up's rule with the target resolved."""
    assert isinstance(config.batch.rampup, AdaptiveRampup)
    settings = config.batch.rampup.adaptive
    return AdaptiveRule(
        start=settings.start,
        target=config.batch.target_bound,
        smoothing=settings.smoothing,
        patience_samples=settings.patience_samples,
        max_growth=settings.max_growth,
        min_stage_samples=settings.min_stage_samples,
        ramp_samples=settings.samples,
        confidence=settings.confidence,
        scale=settings.scale,
    )


def accepted_batch_sizes(
    config: Config,
    *,
    micro_batch_size: int,
    target_nodes: int | None = None,
    memory: MemoryPlan | None = None,
    shape: ModelShape | None = None,
) -> tuple[list[int], dict[int, str]]:
    """The global batch sizes from the adaptive start to the target that the node schedule can place at
    `micro_batch_size` (on some allowed node count up to the target's), ascending; and, given the plan's
    `memory` and the model's `shape`, the placeable sizes left out because their stage would not fit the
    device (fsdp's share of the model grows on fewer nodes), each with the reason in one line."""
    rule = adaptive_rule(config)
    if target_nodes is None:  # the target stage's nodes, from a plan made here
        target_nodes = build_plan(config, micro_batch_size=micro_batch_size).stages[-1].num_nodes
    where = placement(config).capped(target_nodes)
    accepted: list[int] = []
    too_big: dict[int, str] = {}
    doubling = config.batch.rampup.adaptive.doubling  # type: ignore[union-attr]
    for size in range(rule.start, rule.target + 1):
        if size % micro_batch_size:
            continue
        if doubling and size != rule.target and not _is_doubling(size, rule.start):
            continue
        nodes = walk_nodes(batch_sizes=[size], micro_batch_size=micro_batch_size, placement=where)[0]
        if nodes is None:
            continue
        why = does_not_fit(config, memory, shape, num_nodes=nodes, micro_batch_size=micro_batch_size)
        if why is None or size == rule.target:  # the target's stage was checked with the plan
            accepted.append(size)
        else:
            too_big[size] = why
    return accepted, too_big


def _is_doubling(size: int, start: int) -> bool:
    """Whether `size` is start x 2^k."""
    ratio, remainder = divmod(size, start)
    return remainder == 0 and ratio & (ratio - 1) == 0


def adaptive_run(
    config: Config,
    *,
    micro_batch_size: int,
    decisions: Sequence[StageDecision],
    accepted: Sequence[int] | None = None,
) -> AdaptiveRun:
    """The adaptive ramp-up's rule, the accepted sizes (`accepted_batch_sizes` at `micro_batch_size`
    unless given: the trainer passes them without the sizes that would not fit), stage limit and
    `decisions`."""
    assert isinstance(config.batch.rampup, AdaptiveRampup)
    if accepted is None:
        accepted, _ = accepted_batch_sizes(config, micro_batch_size=micro_batch_size)
    return AdaptiveRun(
        rule=adaptive_rule(config),
        accepted=tuple(accepted),
        max_stages=config.batch.rampup.adaptive.max_stages,
        decisions=tuple(decisions),
    )
