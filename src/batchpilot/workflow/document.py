"""The run document as the run stands: an adaptive ramp-up's stages as the decisions so far make them
(`adaptive.json`) and each launch on the nodes it got (`capacity.json`), without checking the config again:
the plan step checked it, and the document's hashes say it was not edited since.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction

from batchpilot import runstate
from batchpilot.plan.adaptive import is_adaptive
from batchpilot.plan.rundoc import RunDocument
from batchpilot.plan.stages import assemble_plan, with_noise_note
from batchpilot.planning.capacity import LaunchCapacity, apply_capacity


def current_document(document: RunDocument, *, capacity: bool = True) -> RunDocument:
    """The run document as the run stands: for an adaptive ramp-up, the plan rebuilt with the decisions
    the trainers recorded so far (`adaptive.json` beside the checkpoints); and each launch whose resize got
    fewer nodes than planned on the nodes it got (`capacity.json` beside the checkpoints; `capacity=False`:
    as planned, without reading it, e.g. for a dry run, which makes no storage call)."""
    config = document.config
    if is_adaptive(config):
        decisions = runstate.read_decisions(config.train.checkpoint_uri)
        plan = assemble_plan(config, micro_batch_size=document.plan.micro_batch_size, decisions=decisions)
        plan = replace(
            plan, parallelism=document.plan.parallelism, hsdp_shard_nodes=document.plan.hsdp_shard_nodes
        )
        plan = with_noise_note(config, plan)
        # The plan step's memory estimate and cost were for the stages planned then, not these.
        document = replace(document, plan=plan, decisions=tuple(decisions), memory=None, cost=None)
    if not capacity or config.cluster.fewer_nodes != "allow":  # only `allow` writes capacity records
        return document
    return with_capacity(document, runstate.read_capacity(config.train.checkpoint_uri))


def with_capacity(document: RunDocument, records: Sequence[LaunchCapacity]) -> RunDocument:
    """The document with each recorded launch on the nodes it got (records of other plans change nothing)."""
    if not records:
        return document
    config = document.config
    plan = apply_capacity(
        document.plan, records, expansion_factor=Fraction(str(config.data.expansion_factor_real_data)),
        pipeline_parallel_size=config.batch.pipeline_parallel_size,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )  # fmt: skip
    applied = tuple(
        r for r in records if any(s.planned_nodes for s in plan.stages[r.first_stage : r.last_stage + 1])
    )
    return replace(document, plan=plan, capacity=applied)
