"""The pipeline's shape as a config fixes it, kfp-free and torch-free (the CLI reads it too): whether it
explores, its stage count and launch task groups, the plan a compiled pipeline can run, and the figures its
tasks show in the KFP UI.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from batchpilot.config import Config, explores
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import RunDocument
from batchpilot.plan.stages import num_stages
from batchpilot.planning.launches import launches
from batchpilot.planning.trials import BranchResult
from batchpilot.workflow.trials import planned_trials, recorded_outcome

logger = logging.getLogger(__name__)


def explore_in_pipeline(config: Config) -> bool:
    """Whether a pipeline compiled from `config` has an explore task: a micro batch to find, or a study."""
    return explores(config)


def expected_stage_count(config: Config) -> int:
    """The stage count a pipeline compiled from `config` has (independent of the micro batch)."""
    return num_stages(config)


def pipeline_launch_names(config: Config) -> tuple[str, ...]:
    """The launch task groups a pipeline compiled from `config` has.

    With an integer micro batch the node counts, hence the launches, are known now: one group per launch,
    named after it (`stages-0-3`, `stage-4`, ..., `final`). With `explore` they follow from the explored
    micro batch: one slot per stage (`launch-0`, `launch-1`, ...), of which the plan's launches take the
    first and the rest do nothing.
    """
    from batchpilot.plan.adaptive import is_adaptive
    from batchpilot.plan.stages import build_plan

    micro = config.batch.micro_batch_size
    if micro == "explore" or config.batch.global_batch_size == "auto" or is_adaptive(config):
        # Adaptive: a slot per stage the ramp may have (max_stages), each trained as its own launch.
        # With an auto target, the stages at max_global_batch_size are as many as any target can make.
        return tuple(f"launch-{k}" for k in range(num_stages(config)))
    return tuple(launch.name for launch in launches(build_plan(config, micro_batch_size=micro)))


def check_pipeline_launches(document: RunDocument, *, expected: Sequence[str], num_slots: int | None) -> None:
    """Refuses a plan whose launches a compiled pipeline cannot run: other launches than the compiled
    ones (`expected`, when the pipeline named them), or more than its `num_slots` groups (when given)."""
    names = [launch.name for launch in launches(document.plan)]
    if (expected and names != list(expected)) or (num_slots is not None and len(names) > num_slots):
        compiled = ", ".join(expected) if expected else f"at most {num_slots} launch(es)"
        raise BatchpilotError(
            "micro_batch_size",
            f"the plan's launches are {', '.join(names)} but this pipeline was compiled for {compiled}",
            "recompile it with `batchpilot compile` for this micro batch (or set `batch.micro_batch_size: "
            "explore`, whose pipeline takes any), and upload the result",
        )


def plan_metrics(document: RunDocument) -> dict[str, float]:
    """The plan's numbers for the KFP UI: the launch count and, with a cost estimate, its node-hours,
    hours and what a pool held at max_nodes would cost."""
    metrics = {
        "num_stages": float(len(document.plan.stages)),
        "num_launches": float(len(launches(document.plan))),
    }
    cost = document.cost
    if cost is not None:
        metrics |= {
            "estimated_node_hours": cost.node_hours,
            "estimated_hours": cost.duration_s / 3600,
            "static_pool_node_hours": cost.static_pool_node_hours,
        }
    return metrics


def trial_indices(document: RunDocument) -> list[int]:
    """The branch indices a pipeline's parallel-for runs, one task each."""
    return [branch.index for branch in planned_trials(document).branches]


def branch_metrics(document: RunDocument, result: BranchResult) -> dict[str, float]:
    """One branch's figures for the KFP UI: its batch, LR, nodes, whether it failed, and its last
    validation loss (and the samples after the warm-up it was taken at) when it trained to the end."""
    branch = planned_trials(document).branches[result.index]
    metrics = {
        "global_batch_size": float(branch.global_batch_size),
        "lr_multiplier": branch.lr_multiplier,
        "lr": branch.lr,
        "num_nodes": float(branch.num_nodes),
        "failed": 0.0 if result.status == "ok" else 1.0,
    }
    if result.final_loss is not None:
        metrics |= {"final_val_loss": result.final_loss, "samples": float(result.curve[-1][0])}
    return metrics


def trials_metrics(document: RunDocument) -> dict[str, float]:
    """The trials' decision for the KFP UI, as the report gives it (`report.trials_summary`)."""
    from batchpilot.report.sections import trials_summary  # the report's figures, one source

    recorded_outcome(document)
    return trials_summary(document)
