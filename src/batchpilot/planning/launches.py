"""Launches: consecutive stages on one node count, run as one distributed job.

A stage change on the same node count needs no new job: the trainer changes the global batch (and
with it accumulation and LR) at the stage's end sample in-process, exactly as it would across a stop.
Only a change of node count needs a resize and a new launch. The NeMo GPT-3 5B example's eight stages
(256..1024 on 8 nodes, then 10, 12, 14, 16) are five launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot.planning.stages import Plan, Stage


@dataclass(frozen=True)
class Launch:
    """One distributed job: stages `first_stage..last_stage` (inclusive) on `num_nodes` nodes."""

    index: int
    name: str
    """`stage-K` or `final` for one stage, `stages-A-B` or `stages-A-final` for several: a valid
    Kubernetes label value and KFP task name (lower case, digits, dashes)."""
    first_stage: int
    last_stage: int
    num_nodes: int
    stage_names: tuple[str, ...]
    tpu_topology: str | None = None
    """The TPU slice topology the launch runs on (None: GPU or CPU nodes)."""
    planned_nodes: int | None = None
    """The plan's node count when the launch trains on fewer (`num_nodes`); None: as planned."""

    @property
    def requested_nodes(self) -> int:
        """The node count the launch's pool is asked for: the plan's, whatever it got last time."""
        return self.planned_nodes or self.num_nodes

    @property
    def num_stages(self) -> int:
        return self.last_stage - self.first_stage + 1

    @property
    def stage_arg(self) -> str:
        """What `batchpilot train --stage` takes for this launch: `K`, or the range `A-B`."""
        if self.first_stage == self.last_stage:
            return str(self.first_stage)
        return f"{self.first_stage}-{self.last_stage}"

    def describe(self) -> str:
        """`stages-0-3: stage-0, stage-1, stage-2, stage-3 on 8 node(s)`."""
        fewer = f" (planned {self.planned_nodes})" if self.planned_nodes else ""
        return (
            f"{self.name}: {', '.join(self.stage_names)} on {self.num_nodes} node(s){fewer}{self.slice_text}"
        )

    @property
    def slice_text(self) -> str:
        """` (TPU slice 4x8)`, or nothing off TPUs."""
        return f" (TPU slice {self.tpu_topology})" if self.tpu_topology else ""


def launch_name(stages: Sequence[Stage]) -> str:
    """The name of a launch of `stages` (consecutive): the stage's own name for one stage."""
    if len(stages) == 1:
        return stages[0].name
    last = "final" if stages[-1].is_final else str(stages[-1].index)
    return f"stages-{stages[0].index}-{last}"


def launch_of(stages: Sequence[Stage], *, index: int) -> Launch:
    """The launch that trains `stages`, which must be consecutive and on one node count.

    Raises:
        ValueError: no stages, a gap, or two node counts (one job has one world size).
    """
    if not stages:
        raise ValueError("a launch needs at least one stage")
    indices = [stage.index for stage in stages]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise ValueError(f"stages {indices} are not consecutive")
    nodes = sorted({stage.num_nodes for stage in stages})
    planned = sorted({stage.planned_nodes for stage in stages}, key=lambda n: n or 0)
    if len(nodes) > 1 or len(planned) > 1:
        raise ValueError(
            f"stages {indices[0]}-{indices[-1]} run on {', '.join(map(str, nodes))} nodes; one launch runs "
            "on one node count"
        )
    return Launch(
        index=index,
        name=launch_name(stages),
        first_stage=indices[0],
        last_stage=indices[-1],
        num_nodes=nodes[0],
        stage_names=tuple(stage.name for stage in stages),
        tpu_topology=stages[0].tpu_topology,
        planned_nodes=planned[0],
    )


def launches(plan: Plan) -> list[Launch]:
    """The plan's launches in order: maximal runs of consecutive stages with equal planned node counts
    (one stage each when the plan says `stage_per_launch`). A launch that trains on fewer nodes than
    planned stays the launch it was: the grouping follows the plan, not the capacity a resize got."""
    groups: list[list[Stage]] = []
    for stage in plan.stages:
        if (
            groups
            and _planned(groups[-1][-1]) == _planned(stage)
            and groups[-1][-1].planned_nodes == stage.planned_nodes
            and not plan.stage_per_launch
        ):
            groups[-1].append(stage)
        else:
            groups.append([stage])
    return [launch_of(group, index=k) for k, group in enumerate(groups)]


def _planned(stage: Stage) -> int:
    return stage.planned_nodes or stage.num_nodes


def launch_containing(plan: Plan, stage_index: int) -> Launch:
    """The plan's launch that trains stage `stage_index`."""
    for launch in launches(plan):
        if launch.first_stage <= stage_index <= launch.last_stage:
            return launch
    raise ValueError(f"stage {stage_index} is not a stage of this plan (0..{len(plan.stages) - 1})")


def launch_summary(plan: Plan) -> str:
    """One line: `5 launch(es): stages-0-3 on 8 node(s), stage-4 on 10, ...`."""
    groups = launches(plan)
    parts = [(f"{launch.name} on {launch.num_nodes} node(s)" if k == 0 else f"{launch.name} on {launch.num_nodes}")
             + (f" ({launch.tpu_topology})" if launch.tpu_topology else "")
             for k, launch in enumerate(groups)]  # fmt: skip
    return f"{len(groups)} launch(es): {', '.join(parts)}"
