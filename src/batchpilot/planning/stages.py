"""The stage list: maximal ranges of consumed samples with one global batch size, each with its nodes."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import (
    check_pipeline_microbatches,
    global_batch_to_load,
    gradient_accumulation_steps,
    num_loading_hosts,
)
from batchpilot.planning.lr import LRSchedule
from batchpilot.planning.nodes import Placement, schedule_nodes
from batchpilot.planning.rampup import BatchSchedule
from batchpilot.planning.tpu import TpuSlices
from batchpilot.planning.units import format_count

MAX_STAGES = 64
"""The most stages a plan may have: each stage resizes the node pool, launches the job on it and writes a
checkpoint (minutes of idle accelerators each), and a compiled pipeline holds one task group per stage.
A ramp with more stages is refused with a coarser ramp of the same shape that stays within this."""


@dataclass(frozen=True)
class Stage:
    """One stage of the plan (the `plan.json` contract in docs/architecture.md, plus derived fields)."""

    index: int
    name: str
    global_batch_size: int
    start_sample: int
    end_sample: int
    num_nodes: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    lr: float
    num_steps: int
    world_size: int
    global_batch_to_load: int
    num_loading_hosts: int
    is_final: bool
    tpu_topology: str | None = None
    """The TPU slice topology of the stage's node pool, e.g. `4x8` (None: GPU or CPU nodes)."""
    planned_nodes: int | None = None
    """The node count the plan gave the stage when its launch trains on fewer (`cluster.fewer_nodes:
    allow` after a partial resize, `batchpilot.planning.capacity`); None: it trains on the planned count."""

    @property
    def num_samples(self) -> int:
        return self.end_sample - self.start_sample


@dataclass(frozen=True)
class Plan:
    """The ordered stages tiling [0, trained_samples), and what was asked for."""

    stages: tuple[Stage, ...]
    total_samples: int
    micro_batch_size: int
    devices_per_node: int
    max_nodes: int
    lr_schedule: LRSchedule
    notes: tuple[str, ...] = ()
    parallelism: str = "ddp"
    """How the trainers spread the model: ddp, fsdp or hsdp (train.parallelism, `auto` resolved)."""
    hsdp_shard_nodes: int = 1
    """hsdp: the nodes one shard group spans (train.hsdp_shard_nodes, or the memory model's choice)."""
    tensor_parallel_size: int = 1
    """Devices of one node that split each block (train.tensor_parallel_size); a stage's data-parallel size is
    its devices over this."""
    stage_per_launch: bool = False
    """Every stage is its own launch (an adaptive ramp-up: the next stage's batch is decided when one ends)."""

    @property
    def trained_samples(self) -> int:
        return self.stages[-1].end_sample

    @property
    def num_steps(self) -> int:
        return sum(stage.num_steps for stage in self.stages)

    def stage_at(self, consumed_samples: int) -> Stage:
        """The stage that a step starting at `consumed_samples` belongs to."""
        if not 0 <= consumed_samples < self.trained_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, {self.trained_samples})")
        starts = [stage.start_sample for stage in self.stages]
        return self.stages[bisect.bisect_right(starts, consumed_samples) - 1]

    def select(self, text: str, *, allow_all: bool = False) -> tuple[Stage, ...]:
        """The stages `--stage TEXT` names: an index, `final`, or (with `allow_all`) `all` or a range
        `A-B` of consecutive stages (inclusive; B may be `final`), which one job trains in turn.

        Raises:
            BatchpilotError: TEXT names no stage of this plan.
        """
        last = len(self.stages) - 1
        choices = f"0..{last}" + (", final, all or a range such as 0-2" if allow_all else " or final")
        if allow_all and text == "all":
            return self.stages
        if text == "final":
            return self.stages[-1:]
        first, dash, end = text.partition("-")
        end = str(last) if end == "final" else end
        if dash and allow_all and first.isdigit() and end.isdigit() and int(first) <= int(end) <= last:
            return self.stages[int(first) : int(end) + 1]
        if dash or not text.isdigit() or int(text) > last:
            raise BatchpilotError("--stage", f"{text!r} is not a stage of this plan", f"use {choices}")
        return (self.stages[int(text)],)

    def micro_batches_label(self) -> str:
        """The micro batch the stages train with: `16`, or per stage when they differ (`4 (stage-0), 16
        (final)`: stages that take a faster size, `faster_micro_batches`)."""
        sizes = {stage.micro_batch_size for stage in self.stages}
        if len(sizes) == 1:
            return str(sizes.pop())
        return ", ".join(f"{stage.micro_batch_size} ({stage.name})" for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_samples": self.total_samples,
            "trained_samples": self.trained_samples,
            "num_steps": self.num_steps,
            "micro_batch_size": self.micro_batch_size,
            "devices_per_node": self.devices_per_node,
            "max_nodes": self.max_nodes,
            # wsd's settings only where set: a plan without them reads as before
            "lr_schedule": {k: v for k, v in asdict(self.lr_schedule).items() if v is not None},
            "parallelism": self.parallelism,
            **({"hsdp_shard_nodes": self.hsdp_shard_nodes} if self.hsdp_shard_nodes > 1 else {}),
            **({"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}),
            "notes": list(self.notes),
            "stages": [_stage_dict(stage) for stage in self.stages],
            **({"stage_per_launch": True} if self.stage_per_launch else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            stages=tuple(Stage(**stage) for stage in data["stages"]),
            total_samples=data["total_samples"],
            micro_batch_size=data["micro_batch_size"],
            devices_per_node=data["devices_per_node"],
            max_nodes=data["max_nodes"],
            lr_schedule=_lr_schedule(data["lr_schedule"]),
            notes=tuple(data.get("notes", ())),
            parallelism=data["parallelism"],
            hsdp_shard_nodes=data.get("hsdp_shard_nodes", 1),
            tensor_parallel_size=data.get("tensor_parallel_size", 1),
            stage_per_launch=data.get("stage_per_launch", False),
        )


def _stage_dict(stage: Stage) -> dict[str, Any]:
    """A stage for plan.json; `planned_nodes` only where the launch trains on fewer nodes than planned."""
    data = asdict(stage)
    if data["planned_nodes"] is None:
        del data["planned_nodes"]
    return data


def stage_name(index: int, *, num_stages: int) -> str:
    """`stage-K` for ramp-up stages, `final` for the last one (plan, logs, pipeline task groups)."""
    return "final" if index == num_stages - 1 else f"stage-{index}"


def sample_ranges(schedule: BatchSchedule, *, total_samples: int) -> list[tuple[int, int, int]]:
    """(global_batch_size, start_sample, end_sample) per stage, stepping exactly as training will.

    A ramp-up stage ends at the first step boundary at or after the next threshold; the final stage
    trains whole steps of the target batch up to `total_samples` (a remainder smaller than one step is
    not trained, as in Megatron).
    """
    ranges: list[tuple[int, int, int]] = []
    consumed = 0
    while consumed < total_samples:
        batch = schedule.batch_at(consumed)
        change = schedule.next_change_after(consumed)
        if change is not None and consumed + -(-(change - consumed) // batch) * batch <= total_samples:
            steps = -(-(change - consumed) // batch)
        else:
            steps = (total_samples - consumed) // batch
        if steps == 0:
            break
        ranges.append((batch, consumed, consumed + steps * batch))
        consumed += steps * batch
    if schedule.ramp_end_sample == 0 and total_samples < schedule.target:
        raise BatchpilotError(
            "train.total_samples",
            f"{total_samples:,} samples are fewer than one step of the global batch {schedule.target:,}",
            "train for longer, or lower batch.global_batch_size",
        )
    if not ranges or ranges[-1][0] != schedule.target:
        raise BatchpilotError(
            "train.total_samples",
            f"{total_samples} samples end before the ramp-up reaches the target batch {schedule.target} "
            f"(the ramp ends at {format_count(schedule.ramp_end_sample)} samples)",
            "train for longer or shorten the ramp-up",
        )
    return ranges


def plan_stages(
    *,
    schedule: BatchSchedule,
    total_samples: int,
    micro_batch_size: int,
    placement: Placement,
    lr_schedule: LRSchedule,
    expansion_factor: Fraction = Fraction(1),
    num_pipeline_microbatches: int | None = None,
    tpu: TpuSlices | None = None,
    each_stage_alone: bool = False,
) -> Plan:
    """Turns a batch schedule into validated stages with node counts on `placement` (with `tpu`, whose host
    counts are `placement.allowed_nodes`, each stage's slice topology).

    Raises:
        BatchpilotError: a stage that the micro batch cannot place (one line naming every such stage), or
            another per-stage rule (accumulation, loading hosts, pipeline microbatches) broken.
    """
    if micro_batch_size <= 0:
        raise BatchpilotError("batch.micro_batch_size", f"must be positive, got {micro_batch_size}")
    ranges = sample_ranges(schedule, total_samples=total_samples)
    devices_per_node, max_nodes = placement.devices_per_node, placement.max_nodes

    def nodes_for(batch_sizes: list[int], cap: int) -> list[int]:
        return schedule_nodes(
            batch_sizes=batch_sizes, micro_batch_size=micro_batch_size, placement=placement.capped(cap)
        )

    batches = [batch for batch, _, _ in ranges]
    if each_stage_alone:
        # Stages decided one at a time (adaptive): each batch gets the most nodes up to the target's that
        # split it, whatever the stages after it, so a stage keeps its node count as later ones are added.
        target_nodes = nodes_for(batches[-1:], max_nodes)[0]
        nodes = [nodes_for([batch], target_nodes)[0] for batch in batches]
    else:
        nodes = nodes_for(batches, max_nodes)
    stages = []
    for index, ((batch, start, end), num_nodes) in enumerate(zip(ranges, nodes, strict=True)):
        dp = placement.data_parallel_size(num_nodes)
        assert dp is not None
        if num_pipeline_microbatches is not None:
            check_pipeline_microbatches(
                num_pipeline_microbatches=num_pipeline_microbatches,
                pipeline_parallel_size=placement.pipeline_parallel_size,
                per_pass_batch=micro_batch_size * dp,
            )
        is_final = index == len(ranges) - 1
        stages.append(
            Stage(
                index=index,
                name=stage_name(index, num_stages=len(ranges)),
                global_batch_size=batch,
                start_sample=start,
                end_sample=end,
                num_nodes=num_nodes,
                data_parallel_size=dp,
                micro_batch_size=micro_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps(
                    global_batch_size=batch, micro_batch_size=micro_batch_size, data_parallel_size=dp
                ),
                lr=lr_schedule.peak(batch),
                num_steps=(end - start) // batch,
                world_size=num_nodes * devices_per_node,
                global_batch_to_load=global_batch_to_load(
                    global_batch_size=batch, expansion_factor=expansion_factor
                ),
                num_loading_hosts=num_loading_hosts(
                    num_hosts=num_nodes,
                    expansion_factor=expansion_factor,
                    # a node's data-parallel ranks each take a micro batch (a tensor-parallel group shares one)
                    samples_per_host_pass=micro_batch_size * dp // num_nodes,
                ),
                is_final=is_final,
                tpu_topology=tpu.for_hosts(num_nodes).topology if tpu else None,
            )
        )
    notes = _notes(stages, total_samples=total_samples, max_nodes=max_nodes)
    return Plan(
        stages=tuple(stages),
        total_samples=total_samples,
        micro_batch_size=micro_batch_size,
        devices_per_node=devices_per_node,
        max_nodes=max_nodes,
        lr_schedule=lr_schedule,
        notes=notes,
        tensor_parallel_size=placement.tensor_parallel_size,
    )


def _notes(stages: list[Stage], *, total_samples: int, max_nodes: int) -> tuple[str, ...]:
    notes = []
    final = stages[-1]
    if final.num_nodes < max_nodes:
        notes.append(
            f"the final stage uses {final.num_nodes} of max_nodes={max_nodes}: global_batch_size "
            f"{final.global_batch_size} does not split evenly over more nodes"
        )
    remainder = total_samples - final.end_sample
    if remainder:
        notes.append(
            f"the last {remainder} samples do not fill a step of {final.global_batch_size} and are not trained"
        )
    return tuple(notes)


MIN_MICRO_GAIN = 0.03
"""A stage trains with a larger micro batch than the plan's only when explore measured it this much faster
(explore's confidence is about being within 3% of the fastest: smaller gains are within its noise)."""


def faster_micro_batches(
    stages: Sequence[Stage],
    *,
    speeds: Mapping[int, float],
    base: int,
    fits: Callable[[Stage, int], bool],
    min_gain: float = MIN_MICRO_GAIN,
) -> tuple[Stage, ...]:
    """Each stage's micro batch: among the measured sizes (`speeds`: micro batch -> throughput per device,
    in any one unit), the fastest that splits the stage's batch over its data-parallel ranks into whole
    passes, fits its devices (`fits(stage, micro)`) and beats the plan's `base` by at least `min_gain`;
    else the stage keeps its own. The plan's micro batch splits every stage's batch (the node walk placed
    them with it), so a larger one is a stage's own choice: a stage on more nodes may take a size that the
    first stage's batch does not split into, and, sharded over more devices, may hold one."""
    floor = speeds.get(base)
    if floor is None:
        return tuple(stages)
    chosen = []
    for stage in stages:
        candidates = [
            micro
            for micro, speed in speeds.items()
            if micro > stage.micro_batch_size
            and speed >= floor * (1 + min_gain)
            and stage.global_batch_size % (micro * stage.data_parallel_size) == 0
            and fits(stage, micro)
        ]
        if not candidates:
            chosen.append(stage)
            continue
        micro = max(candidates, key=lambda size: (speeds[size], size))
        chosen.append(
            replace(
                stage,
                micro_batch_size=micro,
                gradient_accumulation_steps=gradient_accumulation_steps(
                    global_batch_size=stage.global_batch_size,
                    micro_batch_size=micro,
                    data_parallel_size=stage.data_parallel_size,
                ),
            )
        )
    return tuple(chosen)


def _lr_schedule(data: dict[str, Any]) -> LRSchedule:
    """plan.json's `lr_schedule` (JSON lists back to tuples: the schedule is frozen, hence hashable)."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return LRSchedule(**values)
