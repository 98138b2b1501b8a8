"""One typed function per pipeline step: explore, plan, prepare the pool, run a stage, scale down, report.

The `batchpilot` commands, the KFP components and the local run all call these functions; none of
them decides anything these functions decide. The run document (`plan.json`, `batchpilot.rundoc`) is
what the steps pass along: `plan` makes it, every later step reads it. Progress goes to the
`batchpilot.workflow` logger; entry points choose what reaches a console.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from batchpilot import runstate
from batchpilot.config import Config, parse_config, resolved_runtime
from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.plan.checks import check_plan_config
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.rundoc import RunDocument
from batchpilot.plan.stages import num_stages
from batchpilot.planning.capacity import LaunchCapacity
from batchpilot.planning.launches import Launch, launch_containing, launch_of, launches
from batchpilot.planning.trials import BranchResult, TrialsOutcome, TrialsPlan, trial_run_names

if TYPE_CHECKING:
    from batchpilot.cluster.capacity import CapacityShortfall
    from batchpilot.explore import ExploreResult

logger = logging.getLogger(__name__)

EXPLORE_FILES = ("explore.json", "explore.html", "explore_metrics.json")
EXPLORE_NODES = 1
"""Nodes explore measures on (its probes run in the explore task's pod). The pool the explore task finds
holds the canary's nodes (`canary_nodes`), which the pipeline's canary ran on just before."""


def config_from_text(text: str, *, micro_batch_size: int = 0, total_samples: int = 0) -> Config:
    """The run's config from YAML (or JSON) text, with the pipeline's run-time overrides (0 = keep)."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise BatchpilotError("config_yaml", "is not a YAML mapping")
    if micro_batch_size:
        data.setdefault("batch", {})["micro_batch_size"] = micro_batch_size
    if total_samples:
        data.setdefault("train", {}).update(total_samples=total_samples, total_tokens=None)
    return parse_config(data)


# --- explore ---------------------------------------------------------------------------------------


def explore(
    config: Config,
    *,
    output_dir: Path,
    max_probes: int | None = None,
    max_minutes: float | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    study: bool | None = None,
    keep_configured_micro_batch: bool = False,
) -> ExploreResult:
    """Measures the fastest micro batch that fits one device (and the noise scale); writes EXPLORE_FILES.

    Args:
        study: run the noise-scale study (default: `explore.study`).
        keep_configured_micro_batch: with an integer `batch.micro_batch_size`, measure that size only
            (the pipeline explores then only for the study); without it, search as usual.
    """
    from batchpilot.explore import run_exploration

    configured = config.batch.micro_batch_size
    if keep_configured_micro_batch and micro_batch_sizes is None and configured != "explore":
        micro_batch_sizes = [configured]
    return run_exploration(
        config=config,
        output_dir=output_dir,
        max_probes=max_probes,
        max_minutes=max_minutes,
        micro_batch_sizes=micro_batch_sizes,
        study=config.explore.study if study is None else study,
    )


def explore_in_pipeline(config: Config) -> bool:
    """Whether a pipeline compiled from `config` has an explore task: a micro batch to find, or a study."""
    return config.batch.micro_batch_size == "explore" or config.explore.study


@dataclass(frozen=True)
class TaskTimeouts:
    """Seconds each kind of pipeline task may run on a cluster before KFP stops its pod."""

    pool_s: int
    explore_s: int
    plan_s: int
    train_s: int
    report_s: int
    canary_s: int


def task_timeouts(config: Config) -> TaskTimeouts:
    """Timeouts from the config's own limits, with a margin for start-up and image pulls."""
    margin_s = 600
    cluster, explore = config.cluster, config.explore
    return TaskTimeouts(
        pool_s=int(cluster.operation_timeout_s + cluster.ready_timeout_s) + margin_s,
        # The search stops starting probes after max_minutes; the last probe and the study may still run.
        explore_s=int(explore.max_minutes * 60 + explore.probe_timeout_s + explore.study_timeout_s)
        + margin_s,
        plan_s=margin_s,
        train_s=int(cluster.stage_timeout_s),
        report_s=margin_s,
        canary_s=_canary_timeout_s(config) + margin_s,
    )


def read_explore(path: str | Path) -> dict[str, Any]:
    """A parsed explore.json, or a one-line error naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise BatchpilotError("--explore", f"cannot read {path}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("recommendation"), dict):
        raise BatchpilotError(
            "--explore", f"{path} holds no recommendation", "give explore.json of `batchpilot explore`"
        )
    return data


# --- plan ------------------------------------------------------------------------------------------


def plan(
    config: Config,
    *,
    micro_batch_size: int | None = None,
    explore: dict[str, Any] | None = None,
    samples_per_s_per_device: float | None = None,
    expected_num_stages: int | None = None,
    announce: bool = True,
    trials: TrialsPlan | None = None,
    trials_outcome: TrialsOutcome | None = None,
) -> RunDocument:
    """The validated run document; with `expected_num_stages` (a compiled pipeline's), refuses another
    stage count before anything is resized (0 or None: any count; the launch slots are checked). `announce` logs its notes and the memory estimate."""
    from batchpilot.train.shape import model_shape  # torch: only where a plan is made

    document = make_run_document(
        config,
        micro_batch_size=micro_batch_size,
        explore=explore,
        samples_per_s_per_device=samples_per_s_per_device,
        shape=model_shape(factory=config.model.factory, args=config.model.args),
        trials=trials,
        trials_outcome=trials_outcome,
    )
    count = len(document.plan.stages)
    if expected_num_stages and count != expected_num_stages:
        raise BatchpilotError(
            "config_yaml",
            f"implies {count} stage(s) but this pipeline was compiled for {expected_num_stages}",
            "recompile it with `batchpilot compile --config <your config>` and upload the result",
        )
    if not announce:
        return document
    for note in document.notes:
        logger.info(note)
    if document.memory is not None:
        peak = document.memory.peak
        logger.info(
            "parallelism %s (train.parallelism: %s): at most %s per device (%s)",
            document.plan.parallelism, config.train.parallelism, peak.estimate.describe(), peak.stage,
        )  # fmt: skip
    return document


def preflight(config: Config) -> RunDocument | None:
    """What `config check` and `compile` verify before any accelerator is asked for.

    First everything that does not depend on the micro batch (`checks.check_plan_config`: ramp shape,
    schedule entries, stages no micro batch can place, the stage limit, the loading factor), every problem
    on its own line; then with an integer micro batch the whole plan (stages, node schedule, memory); with
    `explore`, the plan at micro batch 1, so a strategy that cannot even hold the model is refused now.
    With a known micro batch, also the node pool the trials' parallel branches need (`trials_pool_nodes`).
    An `auto` target is checked at its bound (`batch.max_global_batch_size`). Returns the document when
    the micro batch and the target are known."""
    check_plan_config(config)  # each micro-batch-independent problem on its own line, before the model
    auto = config.batch.global_batch_size == "auto"
    if auto:  # planned at its bound: the study sets the target later (planner.resolve_auto_target)
        bound = config.batch.target_bound
        batch = config.batch.model_copy(update={"global_batch_size": bound, "max_global_batch_size": None})
        config = config.model_copy(update={"batch": batch})
    if config.batch.micro_batch_size != "explore":
        document = plan(config, announce=False)
        if document.trials is not None:
            # Parallel branches the pool cannot hold fail now, not at their resize.
            trials_pool_nodes(document)
        return None if auto else document
    plan(config, micro_batch_size=1, announce=False)
    return None


def check_data(config: Config) -> None:
    """What `config check` and `plan` verify of a local shard set (`checks.data_problems`): it exists, has a
    manifest, and its vocabulary fits the model. Not `compile`: a pipeline may be compiled before the data
    is prepared."""
    from batchpilot.plan.inputs import data_problems
    from batchpilot.planning.batch import raise_problems
    from batchpilot.train.shape import model_shape  # torch: only when a local manifest was read

    def model_vocab_size() -> int:
        return model_shape(factory=config.model.factory, args=config.model.args).vocab_size

    raise_problems(data_problems(data_uri=config.data.uri, model_vocab_size=model_vocab_size))


def expected_stage_count(config: Config) -> int:
    """The stage count a pipeline compiled from `config` has (independent of the micro batch)."""
    return num_stages(config)


# --- node pool -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolChange:
    """What a resize did: sizes before and after, the wait, and the pool's description afterwards."""

    before: int
    after: int
    elapsed_s: float
    description: str


def prepare_pool(
    config: Config, *, num_nodes: int, timeout_s: float | None = None, state_path: str | None = None
) -> PoolChange:
    """Resizes the pool to `num_nodes` and waits until that many nodes are ready; bad input touches nothing."""
    from batchpilot.cluster.nodepool import node_pool_for

    if not 0 <= num_nodes <= config.cluster.max_nodes:
        raise BatchpilotError(
            "--nodes",
            f"{num_nodes} is outside 0..{config.cluster.max_nodes} (cluster.max_nodes)",
            "give a node count the config allows",
        )
    if timeout_s is not None and timeout_s <= 0:
        raise BatchpilotError("--timeout-s", f"{timeout_s} is not positive", "give seconds > 0")
    pool = node_pool_for(config, state_path=state_path)
    _claim(config, pool)
    started = time.monotonic()
    before = pool.current_size()
    pool.resize(num_nodes)
    # Flex-start (a ProvisioningRequest per launch) and autoscale mode (pending pods) bring the nodes
    # when the launch's job asks for them: the pool task neither resized nor waited for them.
    cluster = config.cluster
    deferred = cluster.backend == "gke" and (
        cluster.provisioning == "flex-start" or cluster.pool_mode == "autoscale"
    )
    if not deferred:
        logger.info("resized: %d -> %d node(s)", before, num_nodes)
    pool.wait_ready(num_nodes, timeout_s=timeout_s if timeout_s is not None else cluster.ready_timeout_s)
    change = PoolChange(before, num_nodes, time.monotonic() - started, pool.describe())
    if deferred:
        how = "its ProvisioningRequest" if cluster.provisioning == "flex-start" else "the cluster autoscaler"
        logger.info("%d node(s) come with the launch's job (%s); %s", num_nodes, how, change.description)
    else:
        logger.info("ready: %d node(s) after %.1fs; %s", num_nodes, change.elapsed_s, change.description)
    return change


def _claim(config: Config, pool: Any) -> None:
    """A GKE pool is labelled with the run and its Lease renewed before it is resized
    (`batchpilot.cluster.ownership`); TPU slice pools carry the run from their creation, so only the
    Lease is renewed for them. The Lease lasts at least until the next task that renews it can have run:
    explore and plan follow the explore pool's resize. A static pool is never changed, its labels
    included (and nothing would scale it down)."""
    from batchpilot.cluster.gke import GkeNodePool
    from batchpilot.cluster.tpu_pool import TpuSlicePool

    if not isinstance(pool, GkeNodePool | TpuSlicePool) or pool.pool_mode == "static":
        return
    from batchpilot.cluster.ownership import claim_pool, renew_lease
    from batchpilot.cluster.readiness import kube_api_client

    limits = task_timeouts(config)
    ttl_s = max(config.cluster.orphan_ttl_s, limits.explore_s + limits.plan_s + limits.pool_s)
    if isinstance(pool, TpuSlicePool):
        # Slice pools carry the run from their creation (`run_labels`); the Lease keeps them from looking
        # orphaned between this resize and the train task.
        renew_lease(kube_api_client(), namespace=config.cluster.namespace, run=config.name, ttl_s=ttl_s)
        return
    claim_pool(
        pool, api_client=kube_api_client(), namespace=config.cluster.namespace, run=config.name,
        idle_nodes=config.cluster.idle_nodes, ttl_s=ttl_s,
    )  # fmt: skip


def scale_down(config: Config, *, state_path: str | None = None) -> PoolChange:
    """Resizes the pool to `cluster.idle_nodes` (the exit handler: it runs whether the stages succeeded)."""
    from batchpilot.cluster.nodepool import node_pool_for

    if config.cluster.backend == "gke":
        from batchpilot.cluster.lifecycle import delete_run_jobs

        # A cancelled or failed run may leave its JobSets (and its trials') on the GPUs; they go (and their
        # trainers stop, checkpointing) before the pool shrinks under them.
        trials = config.trials
        trial_runs = (
            trial_run_names(config.name, batch_sizes=trials.batch_sizes, lr_multipliers=trials.lr_multipliers)
            if trials.enabled
            else []
        )
        for run in (config.name, *trial_runs):
            delete_run_jobs(cluster=config.cluster, run=run)
    pool = node_pool_for(config, state_path=state_path)
    started = time.monotonic()
    before = pool.current_size()
    pool.resize(config.cluster.idle_nodes)
    _release(config, pool)
    change = PoolChange(before, config.cluster.idle_nodes, time.monotonic() - started, pool.describe())
    logger.info(
        "scaled down: %d -> %d node(s) (cluster.idle_nodes); %s", before, change.after, change.description
    )
    return change


def _release(config: Config, pool: Any) -> None:
    """The run is over: its labels leave the (scaled down) GKE pool and its Lease is deleted."""
    from batchpilot.cluster.gke import GkeNodePool
    from batchpilot.cluster.tpu_pool import TpuSlicePool

    if not isinstance(pool, GkeNodePool | TpuSlicePool) or pool.pool_mode == "static":
        return
    from batchpilot.cluster.ownership import delete_lease, release_pool
    from batchpilot.cluster.readiness import kube_api_client

    if isinstance(pool, TpuSlicePool):  # resize(0) deleted the run's slice pools, labels and all
        delete_lease(kube_api_client(), namespace=config.cluster.namespace, run=config.name)
        return
    release_pool(pool, api_client=kube_api_client(), namespace=config.cluster.namespace, run=config.name)


def pool_status(config: Config, *, state_path: str | None = None) -> str:
    from batchpilot.cluster.nodepool import node_pool_for

    return node_pool_for(config, state_path=state_path).describe()


# --- stages ----------------------------------------------------------------------------------------


def current_document(document: RunDocument, *, capacity: bool = True) -> RunDocument:
    """The run document as the run stands: for an adaptive ramp-up, the plan rebuilt with the decisions
    the trainers recorded so far (`adaptive.json` beside the checkpoints); and each launch whose resize got
    fewer nodes than planned on the nodes it got (`capacity.json` beside the checkpoints; `capacity=False`:
    as planned, without reading it, e.g. for a dry run, which makes no storage call)."""
    from batchpilot.plan.adaptive import is_adaptive
    from batchpilot.plan.stages import build_plan

    config = document.config
    if is_adaptive(config):
        decisions = runstate.read_decisions(config.train.checkpoint_uri)
        plan = build_plan(config, micro_batch_size=document.plan.micro_batch_size, decisions=decisions)
        plan = replace(plan, parallelism=document.plan.parallelism)
        # The plan step's memory estimate and cost were for the stages planned then, not these.
        document = replace(document, plan=plan, decisions=tuple(decisions), memory=None, cost=None)
    if not capacity or config.cluster.fewer_nodes != "allow":  # only `allow` writes capacity records
        return document
    return _with_capacity(document, runstate.read_capacity(config.train.checkpoint_uri))


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
    from batchpilot.cluster.launch_spec import cluster_launch_spec, stage_launch_spec

    document = current_document(document)
    config = document.config
    chosen = select_launch(document, stage)
    logger.info("launch %s", chosen.describe())
    if config.cluster.backend == "gke":
        if work_dir is not None or log_dir is not None:
            raise BatchpilotError(
                "--out" if work_dir is not None else "--log-dir",
                "applies to local launches; gke trainers write checkpoints to train.checkpoint_uri",
                "remove the option",
            )
        spec = cluster_launch_spec(
            run_name=config.name, launch=chosen, devices_per_node=config.cluster.devices_per_node,
            plan_text=document.to_json(), audit=audit,
        )  # fmt: skip
        return launcher.run_cluster(spec, cluster=config.cluster)
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
    from batchpilot.cluster.launch_spec import cluster_launch_spec

    config = document.config
    if config.cluster.backend != "gke":
        raise BatchpilotError(
            "--dry-run", "renders the JobSet or Volcano Job of a gke config", "this config's backend is local"
        )
    require_gke_settings(config.cluster)
    document = current_document(document, capacity=False)
    spec = cluster_launch_spec(
        run_name=config.name, launch=select_launch(document, stage),
        devices_per_node=config.cluster.devices_per_node, plan_text=document.to_json(), audit=audit,
    )  # fmt: skip
    return launch.render_cluster_yaml(spec, cluster=config.cluster)


# --- launches in the pipeline ----------------------------------------------------------------------


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


def pipeline_launch(document: RunDocument, *, slot: int) -> Launch | None:
    """The launch pipeline group `slot` runs, or None when the plan has fewer launches (an unused slot
    of an explored micro batch's pipeline). An adaptive ramp-up's slot K trains stage K of the plan as the
    decisions so far make it (a stage alone: the next one's batch is decided when it ends)."""
    groups = launches(current_document(document).plan)  # adaptive: one launch per stage, as decided so far
    if slot < len(groups):
        return groups[slot]
    logger.info("launch-%d: not used (the plan has %d launch(es))", slot, len(groups))
    return None


def prepare_launch_pool(document: RunDocument, *, slot: int) -> int | None:
    """Resizes the pool to the planned node count of the launch in `slot` and returns the nodes the launch
    trains on (None: an unused slot).

    When only some nodes are ready by `cluster.capacity_timeout_s` (a stockout, a quota): with
    `cluster.fewer_nodes: allow` the launch trains on the largest node count at most the ready ones that
    its stages' batches split over (memory checked again for that shard degree), the pool goes to that
    count and the choice is recorded beside the checkpoints (`capacity.json`) for the train task, a retry
    and the report; otherwise the resize fails naming the shortfall. A launch that gets its planned nodes
    clears an earlier record of itself (a retry that found capacity).
    """
    from batchpilot.cluster.capacity import CapacityShortfall

    launch = pipeline_launch(document, slot=slot)
    if launch is None:
        return None
    config = document.config
    planned = launch.requested_nodes
    # What it asks for: the plan's count, whatever a previous attempt's record moved it to.
    logger.info("launch-%d is %s", slot, replace(launch, num_nodes=planned, planned_nodes=None).describe())
    timeout_s = config.cluster.capacity_timeout_s or config.cluster.ready_timeout_s
    started = time.monotonic()
    try:
        prepare_pool(config, num_nodes=planned, timeout_s=timeout_s)
    except CapacityShortfall as short:
        if config.cluster.fewer_nodes != "allow":
            raise BatchpilotError(
                short.field,
                f"{launch.name} needs {planned} node(s): {short.problem}",
                f"{short.fix}; or set cluster.fewer_nodes: allow to train {launch.name} on the nodes that come",
            ) from None
        record = _fewer_nodes(document, launch, short=short, waited_s=time.monotonic() - started)
        return record.nodes
    if config.cluster.fewer_nodes == "allow":
        record_capacity(config, launch, None)  # a retry that got every node trains on them
    return planned


def _fewer_nodes(
    document: RunDocument, launch: Launch, *, short: CapacityShortfall, waited_s: float
) -> LaunchCapacity:
    """Moves `launch` to the nodes that came (see `prepare_launch_pool`); returns the record it keeps."""
    from batchpilot.cluster.nodepool import node_pool_for
    from batchpilot.plan.memory import memory_on_fewer_nodes
    from batchpilot.plan.schedule import placement
    from batchpilot.planning.capacity import fewer_nodes
    from batchpilot.train.shape import model_shape

    config = document.config
    planned = launch.requested_nodes
    stages = document.plan.stages[launch.first_stage : launch.last_stage + 1]
    nodes = fewer_nodes(stages, available=short.ready, placement=placement(config))
    if nodes is None:
        batches = ", ".join(str(stage.global_batch_size) for stage in stages)
        raise BatchpilotError(
            "cluster.fewer_nodes",
            f"{launch.name} got {short.ready} of its {planned} node(s), and no node count from "
            f"{config.cluster.min_nodes} (cluster.min_nodes) to {short.ready} splits its global batch(es) {batches} "
            f"into whole micro batches of {stages[0].micro_batch_size}: {short.problem}",
            "wait longer for the planned nodes (cluster.capacity_timeout_s) or retry when capacity returns",
        )
    record = LaunchCapacity(
        launch=launch.name, first_stage=launch.first_stage, last_stage=launch.last_stage,
        planned_nodes=planned, ready_nodes=short.ready, nodes=nodes, waited_s=round(waited_s, 1),
        reason=short.problem,
    )  # fmt: skip
    moved = _with_capacity(document, [record])
    if document.memory is not None:  # the shard degree changes with the world: fsdp's share grows
        memory_on_fewer_nodes(
            config, document.memory, stages=moved.plan.stages[launch.first_stage : launch.last_stage + 1],
            shape=model_shape(factory=config.model.factory, args=config.model.args),
        )  # fmt: skip
    logger.warning(
        "%s: %d of %d planned node(s) ready after %.0fs (cluster.fewer_nodes: allow): training on %d node(s) "
        "at the planned global batch%s; only data parallelism and accumulation change",
        launch.name, short.ready, planned, waited_s, nodes, "es" if len(stages) > 1 else "",
    )  # fmt: skip
    # The pool's target goes to what the launch uses: ready nodes it cannot use are not paid for, and
    # nodes the cloud would still bring mid-launch (the stockout ends) would only idle.
    node_pool_for(config).resize(nodes)
    logger.info("pool set to the %d node(s) %s trains on", nodes, launch.name)
    record_capacity(config, launch, record)
    return record


def _with_capacity(document: RunDocument, records: Sequence[LaunchCapacity]) -> RunDocument:
    """The document with each recorded launch on the nodes it got (records of other plans change nothing)."""
    if not records:
        return document
    from batchpilot.planning.capacity import apply_capacity

    config = document.config
    plan = apply_capacity(
        document.plan, records, expansion_factor=Fraction(str(config.data.expansion_factor_real_data)),
        pipeline_parallel_size=config.batch.pipeline_parallel_size,
        tensor_parallel_size=config.batch.tensor_parallel_size,
    )  # fmt: skip
    applied = tuple(
        r for r in records if any(s.planned_nodes for s in plan.stages[r.first_stage : r.last_stage + 1])
    )
    return replace(document, plan=plan, capacity=applied)


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
    code = run_stage(document, stage=launch.stage_arg, work_dir=work_dir if local else None)
    if code != 0:
        raise RuntimeError(f"{launch.name} ended with exit code {code}; see its trainers' lines above")
    return stage_metrics(document, launch=launch)


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


# --- batch trials ----------------------------------------------------------------------------------


def planned_trials(document: RunDocument) -> TrialsPlan:
    """The trials the run document plans (`trials.enabled`); a document without them is refused."""
    if document.trials is None:
        raise BatchpilotError(
            "trials.enabled",
            f"is false in the config of the run document of {document.config.name}: it plans no batch trials",
            "set trials.enabled: true (and trials.tokens) in the config and make the plan again",
        )
    return document.trials


def trial_indices(document: RunDocument) -> list[int]:
    """The branch indices a pipeline's parallel-for runs, one task each."""
    return [branch.index for branch in planned_trials(document).branches]


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


def recorded_outcome(document: RunDocument) -> TrialsOutcome:
    """The trials' outcome the run document records, or a one-line error when they have not run."""
    if document.trials_outcome is None:
        raise BatchpilotError("trials", "the run document records no trials outcome", "run the trials first")
    return document.trials_outcome


def trials_metrics(document: RunDocument) -> dict[str, float]:
    """The trials' decision for the KFP UI, as the report gives it (`report.trials_summary`)."""
    from batchpilot.report import trials_summary  # the report's figures, one source

    recorded_outcome(document)
    return trials_summary(document)


TRIALS_FILE = "trials.json"
"""In a local run folder: the trials' plan and outcome, as the decide step saw them."""


def keep_trials_record(run_dir: str | Path, document: RunDocument) -> None:
    """Writes the run folder's trials.json (the trials and their outcome) and its plan.json as decided."""
    record = {"trials": planned_trials(document).to_dict(), "outcome": recorded_outcome(document).to_dict()}
    write_atomically(Path(run_dir) / TRIALS_FILE, json.dumps(record, indent=2) + "\n")
    write_atomically(Path(run_dir) / "plan.json", document.to_json())


# --- canary ----------------------------------------------------------------------------------------


def canary_nodes(config: Config, document: RunDocument | None = None) -> int:
    """The canary's node count: the first launch's (at least 2 when a stage spans several nodes), or
    without a plan (the pipeline explores first) 2 when cluster.max_nodes allows (`cluster.canary`)."""
    from batchpilot.cluster.canary import canary_nodes as nodes

    if document is None:
        return nodes(max_nodes=config.cluster.max_nodes, first_launch_nodes=None, max_stage_nodes=None)
    return nodes(
        max_nodes=config.cluster.max_nodes, first_launch_nodes=launches(document.plan)[0].num_nodes,
        max_stage_nodes=max(stage.num_nodes for stage in document.plan.stages),
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


def _canary_timeout_s(config: Config) -> int:
    """The canary task's bound: the pool's resize, its pods' pending bound, the job's own bounds."""
    from batchpilot.train.canary import CANARY_TIMEOUT_S

    cluster = config.cluster
    autoscale = cluster.pool_mode == "autoscale"  # the nodes come once the pods are pending
    pending_s = cluster.pending_timeout_s + (cluster.ready_timeout_s if autoscale else 0)
    ready_s = max(cluster.ready_timeout_s, cluster.capacity_timeout_s or 0)  # the canary's resize waits this
    return int(cluster.operation_timeout_s + ready_s + pending_s + 2 * CANARY_TIMEOUT_S)


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
    code, failure = run_canary_job(config, spec=canary_spec(config, num_nodes=num_nodes), work_dir=work_dir)
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
    if summary.get("bandwidth_warning"):
        logger.warning("canary: %s", summary["bandwidth_warning"])
    return canary_metrics(summary)


def read_canary(config: Config) -> dict[str, Any] | None:
    """The last canary's canary.json under the checkpoint URI, or None when no canary ran there."""
    return runstate.read_canary(config.train.checkpoint_uri)


# --- report ----------------------------------------------------------------------------------------


def report(
    document: RunDocument, *, explore_dir: Path | None, html_path: Path, markdown_path: Path
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Writes the run report (HTML + Markdown plan table); returns its headline numbers and the records."""
    from batchpilot.report import write_report

    document = current_document(document)  # an adaptive ramp-up's stages as the run decided them
    records = runstate.load_metrics(document.config.train.checkpoint_uri)
    explore_json = explore_dir / "explore.json" if explore_dir is not None else None
    explore_data = json.loads(explore_json.read_text()) if explore_json and explore_json.is_file() else None
    summary = write_report(
        document=document, records=records, explore=explore_data, html_path=html_path,
        markdown_path=markdown_path, explore_html=explore_dir / "explore.html" if explore_dir else None,
        canary=read_canary(document.config),
    )  # fmt: skip
    logger.info("report: %s", html_path)
    return summary, records


def keep_run_record(run_dir: str | Path, document: RunDocument) -> None:
    """Rewrites the run folder's plan.json as the run stands at its end: an adaptive ramp-up's stages and
    decisions (`adaptive_decisions`) as they were taken; any other run's plan is the one planned."""
    write_atomically(Path(run_dir) / "plan.json", current_document(document).to_json())


def keep_copies(run_dir: str | Path, files: dict[str, Path]) -> None:
    """Copies step outputs into the local run folder (`batchpilot run --output DIR`)."""
    for name, source in files.items():
        write_atomically(Path(run_dir) / name, source.read_bytes())


def record_capacity(config: Config, launch: Launch, record: LaunchCapacity | None) -> None:
    """Replaces the launch's capacity record beside the checkpoints (None: removes it)."""
    runstate.record_capacity(
        config.train.checkpoint_uri,
        first_stage=launch.first_stage,
        last_stage=launch.last_stage,
        record=record,
    )
