"""The canary step: a short job on the first launch's nodes that checks the devices, the process group,
the data and the checkpoint URI before anything trains."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot import runstate
from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.launches import launches
from batchpilot.workflow.pool import prepare_pool

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def canary_nodes(config: Config, document: RunDocument | None = None) -> int:
    """The canary's node count: the first launch's (at least 2 when a stage spans several nodes), or
    without a plan (the pipeline explores first) 2 when cluster.max_nodes allows (`cluster.canary`)."""
    from batchpilot.cluster.canary import canary_nodes as nodes

    if document is None:
        return nodes(max_nodes=config.cluster.max_nodes, first_launch_nodes=None, max_stage_nodes=None)
    return nodes(
        max_nodes=config.cluster.max_nodes, first_launch_nodes=launches(document.plan)[0].num_nodes,
        max_stage_nodes=max(stage.num_nodes for stage in document.plan.stages),
        flex_start=config.cluster.provisioning == "flex-start",
    )  # fmt: skip


def prepare_canary_pool(config: Config, document: RunDocument | None = None) -> int:
    """Brings the pool to `canary_nodes` (the pipeline's first resize when it explores: explore measures on
    one of them); returns the nodes the canary checks. When fewer come by `cluster.capacity_timeout_s`
    (a stockout, a quota, the local capacity limit): with `cluster.fewer_nodes: allow` those (at least
    one), else the shortfall fails the task."""
    from batchpilot.cluster.capacity import CapacityShortfall

    num_nodes = canary_nodes(config, document)
    try:
        prepare_pool(config, num_nodes=num_nodes, timeout_s=config.cluster.capacity_timeout_s)
    except CapacityShortfall as short:
        if config.cluster.fewer_nodes != "allow" or short.ready < 1:
            raise
        logger.warning(
            "canary: %d of %d node(s) came (cluster.fewer_nodes: allow): checking those",
            short.ready,
            num_nodes,
        )
        return short.ready
    return num_nodes


def canary(
    config: Config, document: RunDocument | None = None, *, work_dir: Path | None = None
) -> dict[str, float]:
    """Brings the pool to `canary_nodes`, runs the canary job there (devices, process group, data,
    checkpoint URI, an all-reduce: `batchpilot.train.canary`), reads its canary.json and returns its
    figures for KFP. With a run document its config is the one checked.

    Raises:
        BatchpilotError: the canary failed; the message is the failing rank's one line (what, where).
    """
    from batchpilot.cluster.canary import canary_spec, run_canary_job
    from batchpilot.planning.tpu import is_tpu
    from batchpilot.train.canary import canary_metrics, summary_line

    if document is not None:
        config = document.config
    if is_tpu(config.cluster.accelerator_type):
        logger.warning("canary: not run on TPU slices yet (its ranks are torchrun processes, one per device)")
        return {}
    num_nodes = prepare_canary_pool(config, document)
    if config.cluster.backend == "local" and work_dir is None:
        work_dir = Path(tempfile.mkdtemp(prefix="batchpilot-canary-"))
    code, failure = run_canary_job(
        config, spec=canary_spec(config, num_nodes=num_nodes), work_dir=work_dir,
        first_launch=_first_launch(document),
    )  # fmt: skip
    if failure is not None:  # the failing rank's line: what, where, and its own fix when it has one
        raise BatchpilotError("canary", failure)
    if code != 0:
        raise BatchpilotError(
            "canary", f"its job ended with exit code {code} before a rank said why", "see its lines above"
        )
    summary = read_canary(config)
    if summary is None:
        raise BatchpilotError("canary", "the job succeeded but wrote no canary.json", "see its lines above")
    logger.info("%s", summary_line(summary))
    return canary_metrics(summary)


def _first_launch(document: RunDocument | None) -> Any:
    """The first launch's spec as its train task will make it (for flex-start, whose request the canary
    uses and hands over), or None without a plan or off GKE."""
    if document is None or document.config.cluster.backend != "gke":
        return None
    from batchpilot.workflow.document import current_document
    from batchpilot.workflow.stage import cluster_spec

    current = current_document(document)
    return cluster_spec(current, launches(current.plan)[0])


def read_canary(config: Config) -> dict[str, Any] | None:
    """The last canary's canary.json under the checkpoint URI, or None when no canary ran there."""
    return runstate.read_canary(config.train.checkpoint_uri)
