"""The pipeline: explore -> plan -> one named sub-DAG per launch (resize pool, train its stages) ->
report, inside an exit handler that scales the pool down whatever happens.

A launch is consecutive stages on one node count, trained by one job (`batchpilot.planning.launches`).
Launch groups are unrolled at compile time, so each is a visible task group in the KFP UI: named after
the launch (`stages-0-3`, `stage-4`, `final`) when the config fixes the micro batch, else one slot per
stage (`launch-0`, ...), the plan's launches taking the first ones. The plan step fails early, asking for
a recompile, when a run's config implies another stage count or launches the pipeline cannot run.
"""

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kfp import dsl, kubernetes

from batchpilot import __version__
from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV
from batchpilot.cluster.readiness import GKE_NODE_POOL_LABEL as NODE_POOL_LABEL
from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.images import check_image
from batchpilot.kfp.components import build_components
from batchpilot.kfp.shape import expected_stage_count, explore_in_pipeline, pipeline_launch_names
from batchpilot.plan.adaptive import is_adaptive
from batchpilot.planning.stages import stage_name
from batchpilot.workflow.ahead import ahead_unavailable
from batchpilot.workflow.timeouts import TaskTimeouts, task_timeouts

DEFAULT_IMAGE = f"batchpilot:{__version__}"
"""The image name of a local pipeline, which kfp.local never pulls; a gke pipeline runs cluster.image."""

# Retries: a pool resize is idempotent; a launch resumes from its last checkpoint (e.g. after preemption).
RESIZE_RETRIES = 3
STAGE_RETRIES = 2
STAGE_BACKOFF_S = 60
"""A launch's first retry backoff: time for capacity, a node or a preempted pod to come back."""


def stage_names(count: int) -> list[str]:
    """The task-group names of `count` stages (the plan's stage names)."""
    return [stage_name(k, num_stages=count) for k in range(count)]


GPU_RESOURCE_NAME = "nvidia.com/gpu"
"""What a task that needs a GPU asks for. Open-source KFP's driver puts the accelerator type into the
container's resource limits as the resource name, so it must be the device plugin's resource; the GPU
model is chosen by the `cloud.google.com/gke-accelerator` node selector."""


def _on_accelerator(task: Any, config: Config) -> None:
    """Places a task that measures one device on the trainers' GPU pool (GKE); local runs need nothing.

    Raises:
        BatchpilotError: a TPU pool: explore's probes run eager PyTorch, which does not reach TPUs, and a
            `nvidia.com/gpu` request would never schedule there (the planner refuses explore on TPU first).
    """
    if config.cluster.backend != "gke":
        return
    from batchpilot.cluster.placement import gpu_node_selector, gpu_tolerations
    from batchpilot.planning.tpu import is_tpu

    if is_tpu(config.cluster.accelerator_type):
        raise BatchpilotError(
            "batch.micro_batch_size",
            f"explore does not run on TPU yet ({config.cluster.accelerator_type}): the pipeline has no TPU "
            "explore task",
            "set an integer batch.micro_batch_size and explore.study: false",
        )
    if config.cluster.accelerator_type:
        task.set_accelerator_type(GPU_RESOURCE_NAME)
        task.set_accelerator_limit(1)
    for key, value in gpu_node_selector(config).items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for toleration in gpu_tolerations(config):
        kubernetes.add_toleration(task, **toleration)
    if config.cluster.kueue_queue:
        # Through the queue like the trainers' JobSets: Kueue's pod integration gates a pod with these labels
        # until its Workload is admitted (docs/cluster.md, "Shared clusters: Kueue queues"; doctor checks it).
        from batchpilot.cluster.kueue import PRIORITY_LABEL, QUEUE_LABEL

        kubernetes.add_pod_label(task, label_key=QUEUE_LABEL, label_value=config.cluster.kueue_queue)
        if config.cluster.priority_class:
            kubernetes.add_pod_label(
                task, label_key=PRIORITY_LABEL, label_value=config.cluster.priority_class
            )


SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""The cluster autoscaler does not scale down a node running a pod annotated with this set to "false"
(Kubernetes autoscaler FAQ, "What types of pods can prevent CA from removing a node?")."""

TASK_REQUESTS = {
    # (cpu, memory). The pool tasks call two APIs and poll; train only follows a JobSet and streams its
    # logs; plan and report are single-threaded Python (the report draws charts); explore measures one
    # GPU with real batches (data loading, the model on the host before it moves). A request is a floor,
    # not a limit: explore's is what the smallest GPU machine batchpilot knows (g2-standard-4: 4 vCPUs,
    # 16 GB) still schedules, since explore runs on a node of the trainers' pool.
    "pool": ("100m", "512Mi"),
    "plan": ("500m", "1Gi"),
    "train": ("250m", "1Gi"),
    "report": ("500m", "2Gi"),
    "explore": ("2", "8Gi"),
    "canary": ("250m", "1Gi"),  # like train: it follows a job on the trainers' nodes
    "next_nodes": ("100m", "512Mi"),  # a pool task that follows a launch's progress beside its train task
}
"""CPU and memory requests of each kind of task pod on a cluster: without requests a pod is BestEffort,
the first the kubelet evicts under node pressure (Kubernetes "Node-pressure eviction")."""


RECLAIMABLE_NODE_LABELS = ("cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible")
"""The node labels GKE gives Spot and preemptible VMs ("true"): nodes the long-lived and the pool tasks avoid."""


@dataclass(frozen=True)
class TaskPods:
    """On a cluster: what the task pods must know of it."""

    trainer_pool: str | None
    """The pool the trainers run on and the pool tasks resize: every CPU task keeps off it."""


def _task_pod(task: Any, *, kind: str, avoid_pool: str | None) -> None:
    """On a cluster: the task pod's requests, and the annotation that keeps the cluster autoscaler from
    removing its node while it runs.

    Every task carries the annotation: train and the pool tasks must not be cut off (an evicted train task
    used to delete its JobSet; an evicted scale-down is a failing exit hook), and explore, plan and report
    have no retries, so an eviction would fail the run. It costs at most one task's timeout of a node the
    autoscaler would have removed. It does not stop a node upgrade, a drain or node pressure: the train
    task tells those from a cancel itself.
    """
    cpu, memory = TASK_REQUESTS[kind]
    task.set_cpu_request(cpu)
    task.set_memory_request(memory)
    kubernetes.add_pod_annotation(task, annotation_key=SAFE_TO_EVICT, annotation_value="false")
    if kind in ("train", "canary"):
        # Its own pod, read on SIGTERM to tell an eviction from a cancel (batchpilot.cluster.eviction) and
        # protected by its own disruption budget while it follows its launch (batchpilot.cluster.disruption).
        kubernetes.use_field_path_as_env(task, env_name=POD_NAME_ENV, field_path="metadata.name")
        kubernetes.use_field_path_as_env(task, env_name=POD_NAMESPACE_ENV, field_path="metadata.namespace")
    expressions = []
    if kind in ("train", "canary", "pool", "next_nodes"):
        # Never on a node that GKE may take back at any time: a Spot or preemptible VM's reclaim ignores
        # disruption budgets and deletes the pod, and Argo may not retry a deleted pod (docs/cluster.md,
        # "Argo retries"). A node without the label matches NotIn.
        expressions += [
            {"key": label, "operator": "NotIn", "values": ["true"]} for label in RECLAIMABLE_NODE_LABELS
        ]
    if kind != "explore" and avoid_pool:
        # Never on the trainers' pool (explore measures there on purpose): a resize that shrinks it deletes
        # the nodes it removes with their pods, the resizing task's own among them if it ran there, and a
        # CPU pool has no taint that keeps task pods off.
        expressions.append({"key": NODE_POOL_LABEL, "operator": "NotIn", "values": [avoid_pool]})
    if expressions:  # one term: its expressions ANDed
        kubernetes.add_node_affinity(task, match_expressions=expressions)


BACKOFF_FACTOR = 2
LOCAL_BACKOFF_S = 2
"""A local pipeline's first retry backoff: a cluster's waits (30 s for a resize, 60 s for a launch) give
capacity, a node or a preempted pod time to come back; on this machine nothing comes back by waiting."""
"""Each retry waits backoff x BACKOFF_FACTOR^k (Argo's retryStrategy.backoff.factor; KFP's default)."""


def retry_window_s(*, timeout_s: int, retries: int, backoff_s: int) -> int:
    """The retry policy's backoffMaxDuration: room for every attempt to run its whole timeout, plus the
    backoffs between them.

    KFP compiles backoff_max_duration into Argo's `retryStrategy.backoff.maxDuration` (kubeflow/pipelines
    backend/src/v2/compiler/argocompiler/container.go), and Argo refuses any retry once now is past the
    FIRST attempt's start + maxDuration ("Max duration limit exceeded", workflow/controller/operator.go);
    it also makes that instant the retried pod's execution deadline. KFP's default of 3600 s would let a
    launch that fails after an hour never be retried.
    """
    backoffs_s = sum(backoff_s * BACKOFF_FACTOR**k for k in range(retries))
    return (retries + 1) * timeout_s + backoffs_s


def _settings(
    task: Any, *, name: str, kind: str, limits: TaskTimeouts, cluster: TaskPods | None, retries: int = 0,
    backoff_s: int = 30,
) -> Any:  # fmt: skip
    """Display name, no caching (every task has side effects or measures today's hardware), retries with
    a window that fits them (`retry_window_s` over the kind's timeout in `limits`), and on a cluster the
    timeout (the task pod's activeDeadlineSeconds), requests and eviction protection (`_task_pod`).

    `kind` is a key of TASK_REQUESTS; its timeout is `limits.<kind>_s`."""
    timeout_s = int(getattr(limits, f"{kind}_s"))
    task.set_display_name(name)
    task.set_caching_options(False)
    if retries:
        if (
            cluster is None
        ):  # nothing local is preempted or waits for capacity: a retry has nothing to wait for
            backoff_s = LOCAL_BACKOFF_S
        # A local pipeline has no timeouts; its window comes from the limits the cluster would apply
        # (kfp.local reads backoffMaxDuration only as a cap on each backoff).
        window_s = retry_window_s(timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        task.set_retry(
            num_retries=retries, backoff_duration=f"{backoff_s}s", backoff_factor=float(BACKOFF_FACTOR),
            backoff_max_duration=f"{window_s}s",
        )  # fmt: skip
    if cluster is not None:  # kfp.local runs every task in this environment: no pods to time, size or protect
        kubernetes.set_timeout(task, timeout_s)
        _task_pod(task, kind=kind, avoid_pool=cluster.trainer_pool)
    return task


TRAIN_ROLE, AHEAD_ROLE = "train", "next-nodes"
"""The two branches of a launch that asks for the next launch's nodes ahead (`_launch_pipeline`)."""


def _launch_pipeline(
    ops: SimpleNamespace,
    *,
    index: int,
    name: str,
    limits: TaskTimeouts,
    cluster: TaskPods | None,
    ahead: bool,
) -> Any:
    """A launch's group: resize, then train. With `ahead` (cluster.capacity_ahead, and a launch after this one)
    a pool task runs beside the train task and grows the pool for the next launch in time (`workflow.ahead`).

    The two run as the branches of a two-item parallel-for, each under a condition on its item: Argo runs
    sibling tasks at once anyway, but kfp.local runs a DAG's tasks one after another (its orchestrator pops a
    topological order) and only a parallel-for's iterations at once, so this is the one shape that trains and
    follows the training at the same time in both."""

    @dsl.pipeline(
        name=name,
        description=f"{name}: resize the node pool to the launch's node count, then train its stages in one "
        "job to the last one's end sample"
        + (", while the next launch's nodes are asked for in time" if ahead else ""),
    )
    def launch(plan_json: str, run_dir: str):
        resize = ops.resize_pool(plan_json=plan_json, launch_index=index)
        _settings(
            resize, name=f"{name}: resize pool", kind="pool", limits=limits, cluster=cluster,
            retries=RESIZE_RETRIES,
        )  # fmt: skip

        def train() -> None:
            task = ops.train_stage(plan_json=plan_json, launch_index=index, run_dir=run_dir).after(resize)
            _settings(
                task, name=f"{name}: train", kind="train", limits=limits, cluster=cluster,
                retries=STAGE_RETRIES, backoff_s=STAGE_BACKOFF_S,
            )  # fmt: skip

        if not ahead:
            train()
            return
        with dsl.ParallelFor(
            items=[TRAIN_ROLE, AHEAD_ROLE], name=f"{name}-and-next-nodes", parallelism=2
        ) as role:
            with dsl.If(role == TRAIN_ROLE, name=f"{name}-train"):
                train()
            with dsl.If(role == AHEAD_ROLE, name=f"{name}-next-nodes"):
                nodes = ops.bring_next_nodes(plan_json=plan_json, launch_index=index).after(resize)
                # No retries: a resize it could not make is the next launch's own resize's to make.
                _settings(nodes, name=f"{name}: next launch's nodes", kind="next_nodes", limits=limits,
                          cluster=cluster)  # fmt: skip

    return launch


TRIALS_GROUP = "trials"


def _trials_pipeline(
    ops: SimpleNamespace, *, config: Config, expected_launches: str, num_launch_slots: int, limits: TaskTimeouts,
    cluster: TaskPods | None,
) -> Any:  # fmt: skip
    """The batch trials as one task group: bring the pool to what they hold at once, train the warm-up, then
    one branch task per (batch, LR multiplier) under a parallel-for bounded by `trials.parallelism`, and
    decide; the group's output is the decided run document, which every later task takes.

    The branch indices come from the warm-up task (the plan's branch count, known only once an explored micro
    batch is), and the loop sits in its own sub-pipeline that takes the plan as an input: kfp.local 2.17 hands
    a parallel-for iteration its loop item in place of every other task output it reads
    (`create_parameter_loop_iteration_task_spec`), so the plan must reach the loop as a pipeline input."""

    @dsl.pipeline(
        name=TRIALS_GROUP,
        description="batch trials: warm-up, branches in parallel from its checkpoint, decide the batch and LR",
    )
    def trials(plan_json: str, run_dir: str) -> str:
        pool = ops.prepare_trials_pool(plan_json=plan_json)
        _settings(pool, name="trials: resize pool", kind="pool", limits=limits, cluster=cluster,
                  retries=RESIZE_RETRIES)  # fmt: skip
        warmup = ops.trials_warmup(plan_json=plan_json, run_dir=run_dir).after(pool)
        _settings(warmup, name="trials: warm-up", kind="train", limits=limits, cluster=cluster,
                  retries=STAGE_RETRIES, backoff_s=STAGE_BACKOFF_S)  # fmt: skip
        with dsl.ParallelFor(items=warmup.output, parallelism=config.trials.parallelism) as index:
            branch = ops.trial_branch(plan_json=plan_json, branch_index=index, run_dir=run_dir)
            _settings(branch, name="trials: branch", kind="train", limits=limits, cluster=cluster,
                      retries=STAGE_RETRIES, backoff_s=STAGE_BACKOFF_S)  # fmt: skip
        decide = ops.decide_trials(
            plan_json=plan_json, results=dsl.Collected(branch.outputs["Output"]), run_dir=run_dir,
            expected_launches=expected_launches, num_launch_slots=num_launch_slots,
        )  # fmt: skip
        _settings(decide, name="trials: decide batch and LR", kind="plan", limits=limits, cluster=cluster)
        return decide.outputs["Output"]

    return trials


CANARY_DISPLAY_NAME = "canary: devices, all-reduce, data, checkpoint"


def _canary(
    ops: SimpleNamespace, *, config_yaml: Any, plan_json: Any, run_dir: Any, after: Any, limits: TaskTimeouts,
    cluster: TaskPods | None,
) -> Any:  # fmt: skip
    """The canary task after `after`: it brings the pool to its nodes and follows a short job there
    (`workflow.canary`); no retries, a failure is what it is there to find."""
    task = ops.canary(config_yaml=config_yaml, plan_json=plan_json, run_dir=run_dir).after(after)
    return _settings(task, name=CANARY_DISPLAY_NAME, kind="canary", limits=limits, cluster=cluster)


def config_parameter(config: Config) -> str:
    """The config as one line of JSON (also valid YAML): KFP writes parameter defaults into a comment
    header of the compiled file, and a multi-line default would break that file."""
    return json.dumps(config.model_dump(mode="json"), separators=(",", ":"))


def pipeline_image(config: Config, image: str | None) -> str:
    """The image every task runs: `--image`, else `cluster.image`; a gke pipeline needs a pullable one."""
    chosen = image or config.cluster.image
    field = "--image" if image else "cluster.image"
    if config.cluster.backend == "gke":
        if not chosen:
            raise BatchpilotError(
                "cluster.image",
                "is required to compile a gke pipeline",
                "set it or pass --image REGISTRY/batchpilot:TAG",
            )
        return check_image(chosen, field=field, cluster=True)
    # kfp.local runs every task in this Python environment and never pulls the image.
    return check_image(chosen, field=field, cluster=False) if chosen else DEFAULT_IMAGE


def build_pipeline(config: Config, *, image: str | None = None) -> Any:
    """The pipeline for `config`, whose resolved form becomes the default of the `config_yaml` parameter."""
    config_yaml = config_parameter(config)
    ops = build_components(pipeline_image(config, image))
    num_stages = expected_stage_count(config)
    names = pipeline_launch_names(config)
    limits = task_timeouts(config)  # what a cluster applies; also sizes every retry window
    cluster = TaskPods(trainer_pool=config.cluster.node_pool) if config.cluster.backend == "gke" else None
    ahead = ahead_unavailable(config) is None
    groups = [
        _launch_pipeline(
            ops, index=k, name=name, limits=limits, cluster=cluster, ahead=ahead and k < len(names) - 1
        )
        for k, name in enumerate(names)
    ]
    # The groups are the plan's launches, by name, when the micro batch and the target are known now.
    adaptive = is_adaptive(config)
    named = (
        config.batch.micro_batch_size != "explore"
        and config.batch.global_batch_size != "auto"
        and not adaptive
    )
    expected_launches = ",".join(names) if named else ""
    trials = None
    if config.trials.enabled:
        trials = _trials_pipeline(
            ops, config=config, expected_launches=expected_launches, num_launch_slots=len(names), limits=limits,
            cluster=cluster,
        )  # fmt: skip
    explores = explore_in_pipeline(config)
    first = "explore the micro batch, plan" if explores else "plan"
    ramp = (
        f"an adaptive ramp-up of at most {num_stages} stages" if adaptive else f"a {num_stages}-stage ramp-up"
    )
    if trials is not None:
        ramp += ", race candidate batches and LRs in parallel trials"

    @dsl.pipeline(
        name=f"batchpilot-{config.name}",
        description=f"batchpilot {__version__}: {first} {ramp}, train each launch "
        "(consecutive stages on one node count) on its node count, report; the pool is scaled down at the end.",
    )
    def batchpilot(
        config_yaml: str = config_yaml,
        micro_batch_size: int = 0,
        total_samples: int = 0,
        run_dir: str = "",
    ):
        """Run-time parameters.

        Args:
            config_yaml: the batchpilot config (YAML or JSON text). Changing the ramp-up or the total may change the
                stage count, which needs a recompiled pipeline (the plan step says so).
            micro_batch_size: 0 = the config's value, or the explored one when it says `explore`. A value that
                changes the launches of a config with a fixed micro batch needs a recompiled pipeline.
            total_samples: 0 = the config's train.total_samples / total_tokens.
            run_dir: a local folder that receives copies of the plan, report and metrics ("" = none).
        """
        scale = ops.scale_down(config_yaml=config_yaml)
        _settings(scale, name="scale pool down", kind="pool", limits=limits, cluster=cluster,
                  retries=RESIZE_RETRIES)  # fmt: skip
        with dsl.ExitHandler(scale, name="explore-plan-train"):
            explored: dict[str, Any] = {}
            if explores:
                pool = ops.prepare_explore_pool(config_yaml=config_yaml)
                _settings(pool, name="explore: bring the pool up", kind="pool", limits=limits, cluster=cluster,
                          retries=RESIZE_RETRIES)  # fmt: skip
                canary = _canary(ops, config_yaml=config_yaml, plan_json="", run_dir=run_dir, after=pool,
                                 limits=limits, cluster=cluster)  # fmt: skip
                explore = ops.explore(
                    config_yaml=config_yaml, micro_batch_size=micro_batch_size, run_dir=run_dir
                ).after(canary)
                _settings(explore, name="explore micro batch", kind="explore", limits=limits, cluster=cluster)
                _on_accelerator(explore, config)
                explored = {"explore_dir": explore.outputs["explore_dir"]}
            plan = ops.plan(
                config_yaml=config_yaml,
                micro_batch_size=micro_batch_size,
                total_samples=total_samples,
                # auto: the study sets the target, so the stage count is known only then (0: any).
                # adaptive: the stages are decided as the run goes (at most one per launch slot).
                expected_num_stages=0 if config.batch.global_batch_size == "auto" or adaptive else num_stages,
                expected_launches=expected_launches,
                num_launch_slots=len(names),
                run_dir=run_dir,
                **explored,
            )
            _settings(plan, name="plan ramp-up", kind="plan", limits=limits, cluster=cluster)
            previous: Any = plan
            if not explores:  # the canary runs on the first launch's nodes, before it trains
                previous = _canary(ops, config_yaml=config_yaml, plan_json=plan.outputs["Output"],
                                   run_dir=run_dir, after=plan, limits=limits, cluster=cluster)  # fmt: skip
            planned = plan.outputs["Output"]  # the run document every later task takes
            if trials is not None:  # the trials decide; the launches and the report take the decided plan
                decided = trials(plan_json=planned, run_dir=run_dir).after(previous)
                decided.set_display_name(TRIALS_GROUP)
                decided.set_caching_options(False)  # resizes a pool and trains: side effects
                planned, previous = decided.output, decided
            for name, group in zip(names, groups, strict=True):
                task = group(plan_json=planned, run_dir=run_dir).after(previous)
                task.set_display_name(name)
                task.set_caching_options(False)  # resizes a pool and trains: side effects
                previous = task
            report = ops.report(plan_json=planned, run_dir=run_dir, **explored).after(previous)
            _settings(report, name="report", kind="report", limits=limits, cluster=cluster)

    return batchpilot
