"""The batch trials in the pipeline: the node pool their branches hold, and the record of their outcome."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan
from batchpilot.workflow.pool import prepare_pool

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def planned_trials(document: RunDocument) -> TrialsPlan:
    """The trials the run document plans (`trials.enabled`); a document without them is refused."""
    if document.trials is None:
        raise BatchpilotError(
            "trials.enabled",
            f"is false in the config of the run document of {document.config.name}: it plans no batch trials",
            "set trials.enabled: true (and trials.tokens) in the config and make the plan again",
        )
    return document.trials


LOCAL_PARALLEL_BRANCHES = 2
"""Branches a local pipeline runs at once, whatever `trials.parallelism` says: kfp.local 2.17 runs at most two
iterations of a parallel-for at once (`ParallelExecutor.conservative_max`, kfp/local/orchestrator/
enhanced_dag_orchestrator.py), and a local config only runs under kfp.local (submit refuses it)."""


def parallel_branches(document: RunDocument) -> int:
    """Branches that run at once: `trials.parallelism`, at most `LOCAL_PARALLEL_BRANCHES` locally."""
    parallelism = planned_trials(document).parallelism
    if document.config.cluster.backend == "local":
        return min(parallelism, LOCAL_PARALLEL_BRANCHES)
    return parallelism


def trials_pool_nodes(document: RunDocument) -> int:
    """The nodes the trials hold at once: the warm-up's (the first stage's, when there is a warm-up) or any
    `parallel_branches` branches' together, whichever is more (the largest branches may run side by side).
    A local pool also refuses more processes than this machine has CPUs (`LocalNodePool.resize`).

    Raises:
        BatchpilotError: that is more than `cluster.max_nodes` (the branches would wait for nodes that never
            come); the fix names the parallelism that fits.
    """
    trials = planned_trials(document)
    nodes = sorted((branch.num_nodes for branch in trials.branches), reverse=True)
    parallel = parallel_branches(document)
    at_once = sum(nodes[:parallel])
    warmup = document.plan.stages[0].num_nodes if trials.warmup_samples else 0
    need = max(at_once, warmup)
    max_nodes = document.config.cluster.max_nodes
    if need > max_nodes:
        fits = max([1] + [k for k in range(1, len(nodes) + 1) if sum(nodes[:k]) <= max_nodes])
        raise BatchpilotError(
            "trials.parallelism",
            f"is {trials.parallelism}: {parallel} branches at once need up to {need} node(s) "
            f"({' + '.join(map(str, nodes[:parallel]))}), more than cluster.max_nodes {max_nodes}",
            f"set trials.parallelism to at most {fits}, or raise cluster.max_nodes",
        )
    return need


def prepare_trials_pool(document: RunDocument) -> int:
    """Resizes the pool to `trials_pool_nodes` and waits for them (within `cluster.capacity_timeout_s` when
    set, else `cluster.ready_timeout_s`); returns that node count. Before the warm-up, once for all the
    trials: each branch's own launch then finds its nodes in the pool."""
    config = document.config
    need = trials_pool_nodes(document)
    parallel, parallelism = parallel_branches(document), planned_trials(document).parallelism
    if parallel < parallelism:
        logger.warning(
            "trials: a local pipeline runs %d branches at once (kfp.local's limit), not trials.parallelism %d",
            parallel, parallelism,
        )  # fmt: skip
    logger.info("trials: the pool holds %d node(s) for the warm-up and %d branch(es) at once", need, parallel)
    prepare_pool(config, num_nodes=need, timeout_s=config.cluster.capacity_timeout_s or None)
    return need


def recorded_outcome(document: RunDocument) -> TrialsOutcome:
    """The trials' outcome the run document records, or a one-line error when they have not run."""
    if document.trials_outcome is None:
        raise BatchpilotError("trials", "the run document records no trials outcome", "run the trials first")
    return document.trials_outcome


TRIALS_FILE = "trials.json"
"""In a local run folder: the trials' plan and outcome, as the decide step saw them."""


def keep_trials_record(run_dir: str | Path, document: RunDocument) -> None:
    """Writes the run folder's trials.json (the trials and their outcome) and its plan.json as decided."""
    record = {"trials": planned_trials(document).to_dict(), "outcome": recorded_outcome(document).to_dict()}
    write_atomically(Path(run_dir) / TRIALS_FILE, json.dumps(record, indent=2) + "\n")
    write_atomically(Path(run_dir) / "plan.json", document.to_json())
