"""The stage steps: the run document as the run stands (an adaptive ramp-up's decisions, fewer nodes),
the launch a `--stage` or a pipeline slot names, and running its trainers (torchx locally, a JobSet or
Volcano Job on GKE)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot import runstate
from batchpilot.config import Config, resolved_runtime
from batchpilot.config.identity import checkpoint_continuation
from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.adaptive import AdaptiveRun
from batchpilot.planning.launches import Launch, launch_containing, launch_of, launches
from batchpilot.storage import open_storage
from batchpilot.workflow.document import current_document

if TYPE_CHECKING:
    from batchpilot.cluster.launch_spec import LaunchSpec

logger = logging.getLogger(__name__)


def select_launch(document: RunDocument, stage: str | int) -> Launch:
    """The launch `--stage` names: an index, `final`, a range `A-B` of stages on one node count, or a
    launch's name (`stages-0-3`). One stage of a larger launch runs alone (e.g. to repeat it).

    Raises:
        BatchpilotError: no such stage, or a range whose stages run on different node counts.
    """
    plan = document.plan
    groups = launches(plan)
    text = str(stage)
    named = [launch for launch in groups if launch.name == text]
    if named:
        return named[0]
    chosen = plan.select(text, allow_all=True)
    try:
        launch = launch_of(chosen, index=launch_containing(plan, chosen[0].index).index)
    except ValueError as error:
        choices = ", ".join(f"{g.stage_arg} ({g.name}, {g.num_nodes} node(s))" for g in groups)
        raise BatchpilotError("--stage", str(error), f"give one launch of this plan: {choices}") from None
    return launch


def plan_file(document: RunDocument, folder: Path) -> Path:
    """The run document as `folder/plan.json`, for trainers started by torchx (written when it differs)."""
    path = folder / "plan.json"
    text = document.to_json()
    if not path.is_file() or path.read_text() != text:
        write_atomically(path, text)
    return path


def check_checkpoint_run(config: Config) -> None:
    """Refuses, before any trainer starts, to continue a checkpoint another run wrote under
    `train.checkpoint_uri` (the trainers check it again as they load it); a continuation is said. Local
    launches only: a gke train task's trainers make the same check on the nodes, where the bucket's
    credentials are, and `follow` reports their one line as the launch's."""
    uri = config.train.checkpoint_uri
    meta = runstate.latest_meta(uri)
    if meta is None:
        return
    branch = runstate.read_branch(open_storage(uri))
    how = checkpoint_continuation(config, meta, branch=branch, where=uri)
    consumed = f"{meta.get('consumed_samples', 0):,}"
    logger.info("%s: its checkpoint at sample %s is of %s", uri, consumed, how.describe())


def run_stage(
    document: RunDocument,
    *,
    stage: str | int,
    work_dir: Path | None = None,
    audit: bool = False,
    log_dir: Path | None = None,
) -> int:
    """Launches the trainers of the stage(s) `stage` names (see `select_launch`) at their node count;
    returns 0, 75 (preempted) or 1.

    Local (torchx `local_cwd`): trainers read `work_dir/plan.json` and write metrics and logs under
    `work_dir` (default: runs/<name>). GKE: a JobSet or Volcano Job carrying the run document.
    """
    from batchpilot.cluster import launch as launcher
    from batchpilot.cluster.launch_spec import stage_launch_spec

    document = current_document(document)
    config = document.config
    chosen = select_launch(document, stage)
    if (
        config.cluster.backend == "local"
    ):  # gke: the trainers check it as they load it (their line is the launch's)
        check_checkpoint_run(config)
    logger.info("launch %s", chosen.describe())
    if config.cluster.backend == "gke":
        if work_dir is not None or log_dir is not None:
            raise BatchpilotError(
                "--out" if work_dir is not None else "--log-dir",
                "applies to local launches; gke trainers write checkpoints to train.checkpoint_uri",
                "remove the option",
            )
        return launcher.run_cluster(cluster_spec(document, chosen, audit=audit), cluster=config.cluster)
    if resolved_runtime(config) == "xla":
        raise BatchpilotError(
            "train.runtime",
            "is xla, but local launches start torchrun processes (one per device), not one XLA process per host",
            "train the stage directly: PJRT_DEVICE=CPU CPU_NUM_DEVICES=<nodes x devices_per_node> batchpilot train "
            "--plan plan.json --stage K (one process stands in for every host), or set train.runtime: eager",
        )
    folder = (work_dir or Path(f"runs/{config.name}")).absolute()
    spec = stage_launch_spec(
        run_name=config.name, launch=chosen, devices_per_node=document.plan.devices_per_node,
        plan_path=str(plan_file(document, folder)), output_dir=str(folder), audit=audit,
    )  # fmt: skip
    return launcher.run_local(spec, log_dir=log_dir or folder / "torchx")


def render_stage_job(document: RunDocument, *, stage: str | int, audit: bool = False) -> str:
    """The JobSet or Volcano Job of a gke launch as YAML, without any API call."""
    from batchpilot.cluster import launch
    from batchpilot.cluster.gke import require_gke_settings

    config = document.config
    if config.cluster.backend != "gke":
        raise BatchpilotError(
            "--dry-run", "renders the JobSet or Volcano Job of a gke config", "this config's backend is local"
        )
    require_gke_settings(config.cluster)
    document = current_document(document, capacity=False)
    spec = cluster_spec(document, select_launch(document, stage), audit=audit)
    return launch.render_cluster_yaml(spec, cluster=config.cluster)


def cluster_spec(document: RunDocument, launch: Launch, *, audit: bool = False) -> LaunchSpec:
    """The gke launch spec of `launch` as its train task makes it: labelled with the run and carrying
    `document` (the run document as the run stands: `current_document`, whose hash labels the job)."""
    from batchpilot.cluster.launch_spec import cluster_launch_spec

    return cluster_launch_spec(
        run_name=document.config.name, launch=launch, devices_per_node=document.config.cluster.devices_per_node,
        plan_text=document.to_json(), audit=audit,
    )  # fmt: skip


def pipeline_launch(document: RunDocument, *, slot: int) -> Launch | None:
    """The launch pipeline group `slot` runs, or None when the plan has fewer launches (an unused slot
    of an explored micro batch's pipeline). An adaptive ramp-up's slot K trains stage K of the plan as the
    decisions so far make it (a stage alone: the next one's batch is decided when it ends)."""
    groups = launches(current_document(document).plan)  # adaptive: one launch per stage, as decided so far
    if slot < len(groups):
        return groups[slot]
    logger.info("launch-%d: not used (the plan has %d launch(es))", slot, len(groups))
    return None


def train_stage(document: RunDocument, *, launch_index: int, work_dir: Path | None) -> dict[str, float]:
    """A pipeline launch group: trains the stages of the launch in `launch_index` (one job, one process
    group) to the last one's end sample and returns the last step's metrics; nothing for an unused slot.

    Raises:
        RuntimeError: the trainers failed.
    """
    launch = pipeline_launch(document, slot=launch_index)
    if launch is None:
        return {}
    local = document.config.cluster.backend == "local"
    if local and work_dir is None:
        work_dir = Path(tempfile.mkdtemp(prefix="batchpilot-"))
    submitted_s = time.time()
    code = 1
    try:
        code = run_stage(document, stage=launch.stage_arg, work_dir=work_dir if local else None)
    finally:  # the goodput ledger's record of the launch, whatever became of it
        runstate.record_event(
            document.config.train.checkpoint_uri,
            {
                "kind": "launch", "launch": launch.name, "stages": [launch.first_stage, launch.last_stage],
                "nodes": launch.num_nodes, "submitted_s": submitted_s, "ended_s": time.time(), "exit_code": code,
            },
        )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"{launch.name} ended with exit code {code}; see its trainers' lines above")
    return stage_metrics(document, launch=launch) | launch_goodput(document, launch=launch)


def launch_goodput(document: RunDocument, *, launch: Launch) -> dict[str, float]:
    """The launch's share of the goodput ledger, for the KFP UI: `launch_goodput` (its training-step
    node-hours over its paid ones), `launch_node_hours` and `launch_wall_s` ({} before its events exist)."""
    from batchpilot.planning.goodput import build_ledger

    events = runstate.read_events(document.config.train.checkpoint_uri)
    ledger = build_ledger(events, now_s=time.time())
    mine = (
        [r for r in runstate.launch_records(ledger, events) if r["launch"] == launch.name] if ledger else []
    )
    if not mine:
        return {}
    share = mine[-1]
    figures = {"launch_node_hours": float(share["node_hours"]), "launch_wall_s": float(share["wall_s"])}
    return figures | ({"launch_goodput": float(share["goodput"])} if share["goodput"] is not None else {})


def stage_metrics(document: RunDocument, *, launch: Launch) -> dict[str, float]:
    """The launch's last recorded step (loss, samples, batch, throughput), from the metrics kept beside
    the checkpoints, plus the last validation loss (`val_loss`) when one was recorded."""

    records = [
        r
        for r in runstate.load_metrics(document.config.train.checkpoint_uri)
        if launch.first_stage <= r["stage"] <= launch.last_stage
    ]
    decided = [
        d
        for d in current_document(document, capacity=False).decisions
        if launch.first_stage <= d.stage <= launch.last_stage
    ]
    if not records:
        raise BatchpilotError(launch.name, "finished without recording a single step")
    last = records[-1]
    metrics = {
        key: float(last[key]) for key in ("loss", "consumed_samples", "global_batch_size", "tokens_per_s")
    }
    validated = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    if validated:
        metrics["val_loss"] = float(validated[-1])
    for taken in decided:  # an adaptive stage's decision, for the KFP UI
        metrics["decision_next_batch"] = float(taken.next_batch)
        metrics["decision_end_sample"] = float(taken.end_sample)
        for key in ("estimate", "stderr", "threshold"):
            value = getattr(taken.decision, key)
            if value is not None:
                metrics[f"decision_{key}"] = float(value)
    return metrics


def adaptive_stage(document: RunDocument, *, stage: str) -> tuple[RunDocument, AdaptiveRun]:
    """An adaptive ramp-up's stage as its trainers run it: the run document with the stages the decisions
    so far make (`adaptive.json`, `current_document`), and the rule with the batch sizes it may grow to.

    Sizes whose stage would not fit the device (fsdp's share grows on fewer nodes) are never grown to:
    each is logged once with the reason. Nothing is re-checked: the plan step checked the config.

    Raises:
        BatchpilotError: `stage` names several stages (each stage of an adaptive ramp-up is its own launch).
    """
    from batchpilot.plan.adaptive import accepted_batch_sizes, adaptive_run
    from batchpilot.train.shape import model_shape  # torch: the meta-device shape of the model

    planned, document = document, current_document(document)
    if len(document.plan.select(stage, allow_all=True)) != 1:
        raise BatchpilotError(
            "--stage",
            f"{stage!r} names several stages, but an adaptive ramp-up trains one stage per launch (the "
            "next stage's batch is decided when it ends)",
            f"give one stage: {document.plan.stages[-1].index} is the last one decided so far",
        )
    config, micro = document.config, document.plan.micro_batch_size
    accepted, too_big = accepted_batch_sizes(
        config,
        micro_batch_size=micro,
        target_nodes=planned.plan.stages[-1].num_nodes,
        memory=planned.memory,  # the plan step's estimate (the current document's stages carry none)
        shape=model_shape(factory=config.model.factory, args=config.model.args),
    )
    for size, why in too_big.items():
        logger.warning("adaptive ramp-up: batch %d is never decided: %s", size, why)
    return document, adaptive_run(
        config, micro_batch_size=micro, decisions=document.decisions, accepted=accepted
    )
