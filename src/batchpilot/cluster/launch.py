"""Launch trainers through torchx: one AppDef per launch (consecutive stages on one node count).

The embedded default is torchx's `local_cwd` scheduler: a "node" is a torchrun agent with
`devices_per_node` processes on this machine, all joined over gloo on loopback. On GKE the same
launch becomes a JobSet (batchpilot's `jobset` torchx scheduler) or a Volcano Job (torchx `kubernetes`),
one pod per node, placed on the node pool by its label.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchpilot.cluster.disruption import own_pod_budget
from batchpilot.cluster.eviction import Cancelled, Evicted, sigterm_interrupts
from batchpilot.cluster.labels import RUN_LABEL
from batchpilot.cluster.launch_spec import (
    MEGABYTE,
    RDZV_PORT,
    TRAINER_OUTPUT_DIR,
    LaunchSpec,
    exit_75_when_preempted,
    write_inputs_command,
)
from batchpilot.cluster.lifecycle import adoptable_or_cleared, builds_jobset, delete_labelled, stage_selector
from batchpilot.cluster.machines import TrainerResources
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_FILE, PREEMPTED_LOG_MARKER, REFUSAL_LOG_MARKER
from batchpilot.planning.tpu import is_tpu
from batchpilot.ports import free_port
from batchpilot.threads import local_trainer_threads

logger = logging.getLogger(__name__)


def local_appdef(spec: LaunchSpec):
    """A torchx AppDef running `python -m batchpilot train ...` under torchrun on this machine."""
    from torchx.components.dist import torchrun

    env = {
        # torchrun and this interpreter's packages must be found by the replicas.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(local_trainer_threads()),
        **spec.env,
    }
    return torchrun(
        *spec.trainer_args,
        m="batchpilot",
        name=spec.name,
        j=f"{spec.num_nodes}x{spec.processes_per_node}",
        env=env,
        rdzv_port=free_port(),
        tee=3,
    )


def run_local(spec: LaunchSpec, *, log_dir: Path) -> int:
    """Runs the job with torchx `local_cwd`, streams its log lines, returns the exit code of the job."""
    from torchx.runner import get_runner

    appdef = local_appdef(spec)
    runner = get_runner()
    log_dir.mkdir(parents=True, exist_ok=True)
    handle = runner.run(appdef, scheduler="local_cwd", cfg={"log_dir": str(log_dir), "prepend_cwd": True})
    assert isinstance(handle, str)
    return follow(
        runner, handle, spec=spec, role=appdef.roles[0].name, wait_interval_s=0.5,
        via="torchx local_cwd", where=f"logs under {log_dir}",
    )  # fmt: skip


def follow(
    runner: Any,
    handle: str,
    *,
    spec: LaunchSpec,
    role: str,
    wait_interval_s: float,
    via: str,
    where: str,
    stuck: Callable[[], str | None] | None = None,
    restarts: bool = False,
) -> int:
    """Says the job was launched `via` a launcher, streams every node's log lines until it ends; returns 0,
    EXIT_PREEMPTED or 1.

    torchrun exits 1 whatever its workers' codes were, so preemption is told by rank 0's log line.
    `stuck` (polled every `wait_interval_s`) says why the job cannot start (a pod Pending past its bound);
    the job is then cancelled and the reason raised. `restarts`: the job may replace its pods (a JobSet
    restart), whose successors' logs are followed too.
    """
    from torchx.specs import AppState

    logger.info(
        "launched %s: %d node(s) x %d process(es) via %s (%s)",
        spec.name, spec.num_nodes, spec.processes_per_node, via, handle,
    )  # fmt: skip

    relay = _Relay()
    found: list[str] = []
    done = threading.Event()
    streams = [
        threading.Thread(
            target=_stream, args=(runner, handle, role, k, relay, done if restarts else None), daemon=True
        )
        for k in range(spec.num_nodes)
    ]
    if stuck is not None:
        threading.Thread(
            target=_watch_stuck, args=(runner, handle, stuck, wait_interval_s, found, done), daemon=True
        ).start()
    try:
        for thread in streams:
            thread.start()
        status = runner.wait(handle, wait_interval=wait_interval_s)
        done.set()  # the streams end with their pods' logs, and look for no successor
        if found:
            raise BatchpilotError(
                "cluster.pending_timeout_s",
                f"{spec.name}: {found[0]}; its job was deleted",
                "free or add capacity (or fix the image or sizes the message names), or raise "
                "cluster.pending_timeout_s",
            )
        # The logs' tails, within one bound for all nodes (not one per node: 64 nodes' streams that do not end
        # would otherwise hold a finished job's task for half an hour).
        deadline = time.monotonic() + STREAM_TAIL_WAIT_S
        for thread in streams:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        runner.cancel(handle)
        raise
    finally:
        done.set()
        runner.close()
    if status is None:
        raise BatchpilotError(spec.name, f"the job {handle} disappeared before it finished", where)
    if status.state == AppState.SUCCEEDED:
        return 0
    if relay.refusal is not None:
        raise TrainerRefusal(relay.refusal)
    if PREEMPTED_LOG_MARKER in relay.seen:
        logger.info("%s was preempted after checkpointing: exit %d", spec.name, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    detail = f": {status.msg}" if status.msg and status.msg != "<NONE>" else ""
    logger.error("%s failed (%s)%s; %s", spec.name, status.state, detail, where)
    return 1


def _watch_stuck(
    runner: Any,
    handle: str,
    stuck: Callable[[], str | None],
    interval_s: float,
    found: list[str],
    done: threading.Event,
) -> None:
    """Polls `stuck` every `interval_s` until `done` (the follow ended) or the job ends; on a finding
    records it and cancels the job (ending the follow's wait)."""
    from torchx.specs import AppState

    while not done.wait(interval_s):
        try:
            status = runner.status(handle)
            if status is None or status.state not in (AppState.SUBMITTED, AppState.PENDING, AppState.RUNNING):
                return
            problem = stuck()
        except Exception as error:  # a failed poll must not end the launch: the next poll tries again
            logger.warning("could not check the launch's pending pods: %s", str(error).splitlines()[0])
            continue
        if problem is not None and not done.is_set():
            logger.error("%s; deleting the job", problem)
            found.append(problem)
            runner.cancel(handle)
            return


def pending_watch(handle: str, *, cluster: ClusterConfig) -> Callable[[], str | None] | None:
    """`follow`'s `stuck` check of a JobSet launch: its pods Pending longer than `cluster.pending_timeout_s`
    (plus `ready_timeout_s` in autoscale mode, where the nodes come only once the pods are pending)."""
    if not builds_jobset(cluster):
        return None
    from torchx.specs.api import parse_app_handle

    from batchpilot.cluster.jobset import JOBSET_NAME_LABEL
    from batchpilot.cluster.pending import PendingWatch
    from batchpilot.cluster.readiness import kube_api_client

    namespace, name = parse_app_handle(handle).app_id.split(":")
    bound_s = cluster.pending_timeout_s + (cluster.ready_timeout_s if cluster.pool_mode == "autoscale" else 0)
    watch = PendingWatch(
        api_client=kube_api_client(),
        namespace=namespace,
        selector=f"{JOBSET_NAME_LABEL}={name}",
        bound_s=bound_s,
    )
    return watch.problem


class _Relay:
    """What every node's stream shares: the markers seen, and the trainers' first refusal line (the CLI's
    `batchpilot: error: ` line of a trainer that refused to start), after which nothing more is echoed (the
    trainers' and torchrun's tracebacks that follow stay in the job's logs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: set[str] = set()
        self.refusal: str | None = None

    def take(self, line: str) -> None:
        with self.lock:
            if PREEMPTED_LOG_MARKER in line:
                self.seen.add(PREEMPTED_LOG_MARKER)
            if self.refusal is not None:
                return
            if REFUSAL_LOG_MARKER in line:
                self.refusal = line[line.index(REFUSAL_LOG_MARKER) + len(REFUSAL_LOG_MARKER) :].strip()
                return
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
            sys.stdout.flush()


class TrainerRefusal(BatchpilotError):
    """The trainers refused to start or go on, with their one line (`field: problem (fix: ...)`), which
    the launch reports as its own: exit 2, no traceback."""

    def __init__(self, line: str) -> None:
        self.line = line
        super().__init__("trainers", line)

    def __str__(self) -> str:
        return self.line


def _stream(
    runner, handle: str, role: str, replica: int, relay: _Relay, done: threading.Event | None
) -> None:
    """Relays one node's log lines to stdout as they come (they are the trainers' own output, already
    formatted, not this process's log records), noting the preemption marker and a refusal (`_Relay`).

    A node's pod is not the job's whole life: a JobSet restart (after a disruption or a preemption) replaces
    every pod, so when one pod's log ends while the job goes on, the node's next pod is followed from that
    moment on (`since`), until the job is done. `done` None: the scheduler's job has one pod per node for
    its whole life (a local process), whose log is read once."""
    since: datetime.datetime | None = None
    while True:
        for line in runner.log_lines(handle, role_name=role, k=replica, should_tail=True, since=since):
            relay.take(line)
        if done is None or done.wait(RESTREAM_WAIT_S):
            return
        since = datetime.datetime.now() - datetime.timedelta(seconds=RESTREAM_WAIT_S)


STREAM_TAIL_WAIT_S = 30.0
"""How long a finished job's task waits, in all, for its nodes' log streams to end."""
RESTREAM_WAIT_S = 2.0
"""How long a node's stream waits, after its pod's log ended, before it looks for the pod that replaced it."""


# --- GKE: the same launch as a JobSet or a Volcano Job -------------------------------------------


def trainer_pod_resources(cluster: ClusterConfig, *, read_nodes: bool) -> TrainerResources:
    """CPU and memory of each trainer pod (see `machines.trainer_resources` for the order of sources).

    With `read_nodes` (a real launch: the resize step has just waited for the nodes) the pods are sized
    from the pool's ready nodes as the scheduler sees them: allocatable less their DaemonSet pods'
    requests. The machine-type table only sizes a dry run and planning (its nominal memory can exceed
    what a node's kernel reports). A dry run makes no API call.
    """
    from batchpilot.cluster.machines import check_accelerators, trainer_resources
    from batchpilot.cluster.readiness import PoolNodes, kube_api_client

    if is_tpu(cluster.accelerator_type):
        return _tpu_pod_resources(cluster)
    check_accelerators(
        machine_type_name=cluster.machine_type,
        accelerator_type=cluster.accelerator_type,
        devices_per_node=cluster.devices_per_node,
    )
    node_free = None
    if read_nodes and cluster.node_pool:
        nodes = PoolNodes(
            api_client=kube_api_client(),
            node_pool=cluster.node_pool,
            gpus_per_node=cluster.devices_per_node if cluster.accelerator_type else 0,
        )
        node_free = nodes.smallest_free_for_trainer()
        explicit = cluster.cpu_per_node is not None and cluster.memory_per_node_bytes is not None
        if node_free is None and explicit:
            logger.warning(
                "node pool %s has no usable node yet: cluster.cpu_per_node/memory_per_node_bytes are not "
                "checked against the nodes",
                cluster.node_pool,
            )
        elif node_free is None and cluster.pool_mode != "autoscale" and cluster.provisioning != "flex-start":
            raise BatchpilotError(
                "cluster.node_pool",
                f"node pool {cluster.node_pool!r} has no usable node to size the trainer pods from",
                f"check `kubectl get nodes -l cloud.google.com/gke-nodepool={cluster.node_pool}`; the resize "
                "step waits for them",
            )
        # autoscale mode: the nodes come once the pods are pending, so the machine type sizes them; flex-start:
        # they come with the launch's ProvisioningRequest, whose PodTemplate has the pods' sizes first.
    return trainer_resources(
        machine_type_name=cluster.machine_type,
        cpu_per_node=cluster.cpu_per_node,
        memory_per_node_bytes=cluster.memory_per_node_bytes,
        node_free=node_free,
    )


def _tpu_pod_resources(cluster: ClusterConfig) -> TrainerResources:
    """CPU and memory of a TPU trainer pod: explicit sizes, else the TPU machine type's allocatable less the
    reserve (the type defaults to the TPU type's multi-host machine, as in planning). The slice pools are
    not `cluster.node_pool`, so a launch never sizes from the nodes: an unlisted type needs both sizes."""
    from batchpilot.cluster.machines import MACHINE_TYPES, check_accelerators, trainer_resources
    from batchpilot.planning.tpu import tpu_type

    assert cluster.accelerator_type is not None
    machine = tpu_type(cluster.accelerator_type).machine(cluster.machine_type).name
    explicit = cluster.cpu_per_node is not None and cluster.memory_per_node_bytes is not None
    if machine not in MACHINE_TYPES and not explicit:
        raise BatchpilotError(
            "cluster.cpu_per_node",
            f"and cluster.memory_per_node_bytes are needed to size the trainer pods on {machine} TPU VMs, whose "
            "vCPUs and memory batchpilot has no documented figures for",
            "set both to the node's allocatable less GKE's DaemonSets (`kubectl describe node`, Allocatable)",
        )
    check_accelerators(
        machine_type_name=machine,
        accelerator_type=cluster.accelerator_type,
        devices_per_node=cluster.devices_per_node,
    )
    return trainer_resources(
        machine_type_name=machine,
        cpu_per_node=cluster.cpu_per_node,
        memory_per_node_bytes=cluster.memory_per_node_bytes,
        node_free=None,
    )


def cluster_appdef(spec: LaunchSpec, *, cluster: ClusterConfig, read_nodes: bool = False):
    """A torchx AppDef for `spec` on GKE: image, resources, node selector, tolerations, env.

    `read_nodes`: size the pods from the pool's ready nodes when the config does not say their size
    (a real launch); without it (a dry run) such a config is an error naming what to set.
    """
    from torchx.components.dist import torchrun
    from torchx.specs.api import BindMount
    from torchx.specs.overlays import set_overlay

    from batchpilot.cluster.gpudirect import gpudirect_pod
    from batchpilot.cluster.placement import trainer_pod_overlay

    if not cluster.image:
        raise BatchpilotError("cluster.image", "is required when cluster.backend is gke", "set cluster.image")
    resources = trainer_pod_resources(cluster, read_nodes=read_nodes)
    if is_tpu(cluster.accelerator_type):
        from batchpilot.cluster.tpu_jobset import tpu_appdef

        logger.info(
            "trainer pods: %d CPU(s), %d MB memory, %d TPU chip(s) each, one per host of slice %s (from %s)",
            resources.cpu, resources.memory_bytes // MEGABYTE, cluster.devices_per_node, spec.tpu_topology,
            resources.source,
        )  # fmt: skip
        return tpu_appdef(spec, cluster=cluster, resources=resources)
    gpus = spec.processes_per_node if cluster.accelerator_type else 0
    logger.info(
        "trainer pods: %d CPU(s), %d MB memory, %d GPU(s) each (from %s)",
        resources.cpu, resources.memory_bytes // MEGABYTE, gpus, resources.source,
    )  # fmt: skip
    # One trainer pod owns its node, so it asks for all of it that GKE and its DaemonSets leave. Memory
    # is meant as request == limit: a pod using more than it requested is the first the kubelet evicts
    # under memory pressure, and a trainer killed mid-step loses the work since its last checkpoint.
    # torchx writes the limit as memMB and the request 1024 MB (its RESERVED_MEMMB) below it; the CPU
    # request 100m below the limit. GPUs: request == limit == devices_per_node.
    direct = gpudirect_pod(cluster)  # the trainer container's GPUDirect mounts, environment and settings
    appdef = torchrun(
        *spec.trainer_args,
        m="batchpilot",
        name=spec.name,
        image=cluster.image,
        j=f"{spec.num_nodes}x{spec.processes_per_node}",
        cpu=resources.cpu,
        gpu=gpus,
        memMB=resources.memory_bytes // MEGABYTE,
        env={
            "PYTHONUNBUFFERED": "1", "HOME": "/tmp", **(direct.trainer_env if direct else {}), **cluster.env,
            **spec.env,
        },
        rdzv_port=RDZV_PORT,
        tee=3,
    )  # fmt: skip
    role = appdef.roles[0]
    assert role.args[0] == "-c", role.args  # torchrun's component runs one bash command line
    if cluster.launcher == "trainjob":
        from batchpilot.cluster.trainjob import NODE

        role.name = NODE  # Trainer's torch runtime runs the trainer in replicated job and container `node`
    setup = ""
    if direct is not None:
        logger.info(
            "%s on %s: GPU NICs on GKE Networks %s", direct.stack.title, cluster.machine_type,
            ", ".join(cluster.gpudirect_networks or direct.stack.default_networks),
        )  # fmt: skip
        role.mounts = [BindMount(host, path, read_only) for host, path, read_only in direct.trainer_mounts]
        setup = direct.setup_command()
    role.args = ["-c", write_inputs_command() + setup + role.args[1]]
    set_overlay(role, "kubernetes", "V1Pod", trainer_pod_overlay(cluster))
    return appdef


def cluster_runner():
    """A torchx Runner that knows the `jobset` scheduler whether or not its entry point is installed."""
    from torchx.runner import Runner
    from torchx.schedulers import get_scheduler_factories

    from batchpilot.cluster import jobset, trainjob

    factories = {
        "jobset": jobset.create_scheduler, "trainjob": trainjob.create_scheduler, **get_scheduler_factories()
    }  # fmt: skip
    return Runner("batchpilot", factories)


def cluster_scheduler(
    cluster: ClusterConfig, *, labels: dict[str, str] | None = None
) -> tuple[str, dict[str, object]]:
    """(torchx scheduler name, its run config) for `cluster.launcher`; `labels` go on a JobSet (TrainJob)."""
    if cluster.launcher in ("jobset", "trainjob"):
        cfg: dict[str, object] = {"namespace": cluster.namespace, "service_account": cluster.service_account}
        if cluster.launcher == "trainjob":
            from batchpilot.cluster.trainjob import DEFAULT_RUNTIME

            cfg["runtime"] = cluster.training_runtime or DEFAULT_RUNTIME
        if cluster.kueue_queue:
            cfg["queue"] = cluster.kueue_queue
        if cluster.priority_class:
            cfg["workload_priority_class"] = cluster.priority_class
        if labels:
            cfg["labels"] = dict(labels)
        return cluster.launcher, cfg
    if cluster.kueue_queue:
        raise BatchpilotError(
            "cluster.kueue_queue",
            "applies to the jobset and trainjob launchers only",
            "remove it, or use launcher jobset",
        )
    # validate_spec would ask the API server for a dry-run create; submission validates anyway.
    return "kubernetes", {
        "namespace": cluster.namespace,
        "queue": cluster.volcano_queue,
        "service_account": cluster.service_account,
        "validate_spec": False,
    }


def render_cluster_job(
    runner,
    appdef,
    *,
    cluster: ClusterConfig,
    labels: dict[str, str] | None = None,
    request: str | None = None,
):
    """The torchx dry-run of `appdef` with hardened containers; `.request` is what would be created. With
    flex-start its pods consume ProvisioningRequest `request` (default: the one named as the job)."""
    from batchpilot.cluster.placement import harden_containers

    role = appdef.roles[0]
    marker = f"{TRAINER_OUTPUT_DIR}/{PREEMPTED_FILE}"
    if marker not in role.args[1]:  # render once: the AppDef is changed in place
        role.args = ["-c", exit_75_when_preempted(role.args[1], marker=marker)]
    scheduler, cfg = cluster_scheduler(cluster, labels=labels)
    info = runner.dryrun(appdef, scheduler, cfg=cfg)
    resource = info.request.resource
    if scheduler == "jobset" and is_tpu(cluster.accelerator_type):
        from batchpilot.cluster.tpu_jobset import finish_tpu_jobset

        finish_tpu_jobset(resource)
    if scheduler == "jobset" and cluster.provisioning == "flex-start" and cluster.kueue_queue:
        from batchpilot.cluster.provisioning import kueue_request_annotations, tolerate_queued_nodes

        # Kueue's ProvisioningRequest admission check asks GKE for the nodes and writes the consume annotations
        # into the pod templates at admission (cluster/kueue.py); the JobSet carries the request's parameters.
        resource["metadata"].setdefault("annotations", {}).update(
            kueue_request_annotations(cluster.stage_timeout_s)
        )
        for replicated in resource["spec"]["replicatedJobs"]:
            tolerate_queued_nodes(replicated["template"]["spec"]["template"])
    elif scheduler == "jobset" and cluster.provisioning == "flex-start":
        from batchpilot.cluster.provisioning import consume_request

        # The pods consume the launch's ProvisioningRequest, named as its JobSet (cluster/provisioning.py).
        for replicated in resource["spec"]["replicatedJobs"]:
            consume_request(
                replicated["template"]["spec"]["template"], name=request or resource["metadata"]["name"]
            )
    if scheduler == "kubernetes":
        from torchx.schedulers.kubernetes_scheduler import sanitize_for_serialization

        # torchx leaves V1Pod objects in the Volcano Job; plain dicts serialise and validate alike.
        resource = info.request.resource = sanitize_for_serialization(resource)
        resource["metadata"]["namespace"] = cluster.namespace
        for task in resource["spec"]["tasks"]:
            harden_containers(task["template"]["spec"])
    return info


def cluster_job_yaml(info) -> str:
    """The rendered JobSet or Volcano Job as YAML; a TrainJob after the ClusterTrainingRuntime it needs."""
    import yaml

    from batchpilot.cluster.trainjob import TrainJobRequest

    if isinstance(info.request, TrainJobRequest):
        return str(info.request)
    return yaml.safe_dump(info.request.resource, sort_keys=False)


def render_cluster_yaml(spec: LaunchSpec, *, cluster: ClusterConfig) -> str:
    """The JobSet or Volcano Job that `run_cluster` would create, as YAML; makes no API call."""
    runner = cluster_runner()
    return cluster_job_yaml(
        render_cluster_job(runner, cluster_appdef(spec, cluster=cluster), cluster=cluster, labels=spec.labels)
    )


def trainjob_runtime(cluster: ClusterConfig) -> dict[str, Any]:
    """The ClusterTrainingRuntime every launch of `cluster` (launcher trainjob) needs, as `launch --dry-run`
    prints it; the pods' size does not enter it (each TrainJob brings its own), so none is read."""
    from batchpilot.cluster.trainjob import DEFAULT_RUNTIME

    sized = cluster.model_copy(update={"cpu_per_node": 1, "memory_per_node_bytes": 2**30})
    spec = LaunchSpec(name="runtime-check", num_nodes=1, processes_per_node=cluster.devices_per_node,
                      trainer_args=(), env={})  # fmt: skip
    resource = render_cluster_job(
        cluster_runner(), cluster_appdef(spec, cluster=sized), cluster=sized
    ).request
    runtime: dict[str, Any] = resource.runtime
    runtime["metadata"]["name"] = cluster.training_runtime or DEFAULT_RUNTIME
    return runtime


def run_cluster(spec: LaunchSpec, *, cluster: ClusterConfig, capacity_of: LaunchSpec | None = None) -> int:
    """Submits the launch to GKE (or adopts its running JobSet), streams every node's log, returns 0, 75
    (preempted, or this task's pod evicted: the JobSet is left for the retry to adopt) or 1. Ctrl-C, or a
    SIGTERM that is no eviction (a cancel), deletes the launch's job, then raises KeyboardInterrupt.

    `capacity_of` (flex-start): the job runs on the nodes of that launch's ProvisioningRequest, which is kept
    for it when the job succeeds (the canary runs on the first launch's nodes, then hands them over)."""
    from batchpilot.cluster.eviction import sigterm_cause

    runner = cluster_runner()
    # The pool was resized and its nodes found ready just before: they can size the pods when the config
    # does not (a dry run never asks the API).
    appdef = cluster_appdef(spec, cluster=cluster, read_nodes=True)
    with (
        sigterm_interrupts(classify=sigterm_cause if builds_jobset(cluster) else None),
        _run_lease(spec, cluster=cluster),
        own_pod_budget(),  # a drain or an upgrade must not evict the task that follows the launch
    ):
        try:
            with _capacity(runner, appdef, spec=spec, cluster=cluster, capacity_of=capacity_of) as capacity:
                request = capacity_of.name if capacity_of is not None else None
                handle, via = _adopt_or_submit(runner, appdef, spec=spec, cluster=cluster, request=request)
                queued: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if builds_jobset(cluster) and cluster.kueue_queue:
                    queued = _admitted(handle, spec=spec, cluster=cluster)
                with queued:
                    code = follow(
                        runner, handle, spec=spec, role=appdef.roles[0].name, wait_interval_s=10,
                        via=via, where=f"see the job {handle} in namespace {cluster.namespace}",
                        stuck=pending_watch(handle, cluster=cluster), restarts=builds_jobset(cluster),
                    )  # fmt: skip
                if code == 0 and capacity is not None and capacity_of is not None:
                    capacity.hand_over(capacity_of.name)
                return code
        except Evicted as evicted:
            logger.warning(
                "%s: SIGTERM is an eviction (%s): leaving its JobSet running for the retry to adopt; exit %d",
                spec.name, evicted.why, EXIT_PREEMPTED,
            )  # fmt: skip
            return EXIT_PREEMPTED
        except KeyboardInterrupt as interrupt:
            if isinstance(interrupt, Cancelled):
                logger.warning("%s: SIGTERM is a cancel (%s): deleting its JobSet", spec.name, interrupt.why)
            # follow() cancels the job it follows; this also covers an interrupt during the create.
            if builds_jobset(cluster) and spec.labels:
                delete_labelled(cluster, labels=stage_selector(spec.labels), wait_s=0.0, why="interrupted")
            raise


def _admitted(
    handle: str, *, spec: LaunchSpec, cluster: ClusterConfig
) -> contextlib.AbstractContextManager[None]:
    """Waits until Kueue admits the launch's JobSet (`cluster/kueue.py`), within `cluster.capacity_timeout_s`
    (else `ready_timeout_s`); a JobSet Kueue refuses or has not admitted by then is deleted, so that nothing of
    the launch stays queued, before the error is raised. Returns the context in which the launch is followed:
    its Workload's later changes (a preemption, the requeue, the admission again) are logged meanwhile."""
    from kubernetes import client
    from torchx.specs.api import parse_app_handle

    from batchpilot.cluster import kueue
    from batchpilot.cluster.jobset import JOBSET_KIND
    from batchpilot.cluster.readiness import kube_api_client
    from batchpilot.cluster.trainjob import TRAINJOB_KIND

    assert cluster.kueue_queue is not None
    api = kube_api_client()
    namespace, name = parse_app_handle(handle).app_id.split(":")
    # Kueue queues the object batchpilot creates: the JobSet, or the TrainJob (whose JobSet it leaves alone).
    group, version, plural = TRAINJOB_KIND if cluster.launcher == "trainjob" else JOBSET_KIND
    queued = client.CustomObjectsApi(api).get_namespaced_custom_object(
        group, version, namespace, plural, name, _request_timeout=30
    )
    workloads, uid, queue = (
        kueue.Workloads(api, namespace=namespace),
        queued["metadata"]["uid"],
        cluster.kueue_queue,
    )
    try:
        said = kueue.wait_admitted(
            workloads, jobset=name, uid=uid, queue=queue, kind=queued["kind"],
            timeout_s=cluster.capacity_timeout_s or cluster.ready_timeout_s,
        )  # fmt: skip
    except BatchpilotError:
        if spec.labels:
            delete_labelled(
                cluster, labels=stage_selector(spec.labels), wait_s=0.0, why="not admitted by Kueue"
            )
        raise

    @contextlib.contextmanager
    def watching() -> Iterator[None]:
        stop = threading.Event()
        watcher = threading.Thread(
            target=kueue.watch_admission, daemon=True,
            kwargs={"workloads": workloads, "jobset": name, "uid": uid, "queue": queue, "stop": stop, "said": said,
                    "kind": queued["kind"]},
        )  # fmt: skip
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join(timeout=30)

    return watching()


def _capacity(
    runner, appdef, *, spec: LaunchSpec, cluster: ClusterConfig, capacity_of: LaunchSpec | None = None
) -> contextlib.AbstractContextManager[Any]:
    """With `cluster.provisioning: flex-start`, the launch's nodes come through a ProvisioningRequest for its
    node count, provisioned before the JobSet is created and deleted when the launch ends
    (`batchpilot.cluster.provisioning`); otherwise the pool was sized by the resize step. `capacity_of`:
    the request is that launch's (its name, labels, pods and node count), which the caller may hand over to
    it (`provisioning.Handover`); the context yields the handover, or None without flex-start. With
    `cluster.kueue_queue` too, Kueue's ProvisioningRequest admission check asks GKE for the nodes once it has
    reserved the launch's quota, and the admission wait (`_admitted`) follows it: nothing here."""
    if cluster.provisioning != "flex-start":
        return contextlib.nullcontext()
    if cluster.kueue_queue:
        if capacity_of is not None:
            logger.info(
                "%s: Kueue's ProvisioningRequest admission check asks GKE for this job's nodes (cluster.kueue_queue); "
                "they go when it ends, not to %s, whose JobSet Kueue asks for again",
                spec.name, capacity_of.name,
            )  # fmt: skip
        return contextlib.nullcontext()
    from batchpilot.cluster.lifecycle import running_jobset
    from batchpilot.cluster.provisioning import flex_start_capacity
    from batchpilot.cluster.readiness import kube_api_client

    owner = capacity_of or spec
    if capacity_of is not None:  # its pods are the ones the request's PodTemplate must match
        appdef = cluster_appdef(capacity_of, cluster=cluster, read_nodes=True)
    # A retried task whose JobSet still runs adopts it, and the request its pods consumed with it.
    consumed = bool(spec.labels) and running_jobset(labels=spec.labels, cluster=cluster) is not None
    resource = render_cluster_job(runner, appdef, cluster=cluster, labels=owner.labels).request.resource
    (replicated,) = resource["spec"]["replicatedJobs"]
    return flex_start_capacity(
        api_client=kube_api_client(), namespace=cluster.namespace, name=resource["metadata"]["name"],
        labels=owner.labels, pod=replicated["template"]["spec"]["template"], count=owner.num_nodes,
        timeout_s=cluster.capacity_timeout_s or cluster.ready_timeout_s, stage_timeout_s=cluster.stage_timeout_s,
        consumed=consumed,
    )  # fmt: skip


def ask_capacity_ahead(spec: LaunchSpec, *, cluster: ClusterConfig) -> str:
    """Flex-start: creates the ProvisioningRequest of the launch `spec` before it starts, as its train task
    would (its name, labels, pods and node count: `_capacity`); that task adopts it. Returns what it did."""
    from batchpilot.cluster.provisioning import ask_ahead
    from batchpilot.cluster.readiness import kube_api_client

    if (
        cluster.kueue_queue
    ):  # workflow/ahead.py never asks: Kueue's admission check asks when it reserves quota
        raise BatchpilotError(
            "cluster.capacity_ahead",
            "cannot queue a request ahead through cluster.kueue_queue",
            "set it to off",
        )
    runner = cluster_runner()
    appdef = cluster_appdef(spec, cluster=cluster, read_nodes=True)
    resource = render_cluster_job(runner, appdef, cluster=cluster, labels=spec.labels).request.resource
    (replicated,) = resource["spec"]["replicatedJobs"]
    return ask_ahead(
        api_client=kube_api_client(), namespace=cluster.namespace, name=resource["metadata"]["name"],
        labels=spec.labels, pod=replicated["template"]["spec"]["template"], count=spec.num_nodes,
        stage_timeout_s=cluster.stage_timeout_s,
    )  # fmt: skip


def _run_lease(spec: LaunchSpec, *, cluster: ClusterConfig) -> contextlib.AbstractContextManager[None]:
    """While the launch is followed, the run's Lease is renewed (`batchpilot.cluster.ownership`), so its
    pool is not taken for orphaned however long the launch trains."""
    from batchpilot.cluster.ownership import lease_renewed
    from batchpilot.cluster.readiness import kube_api_client

    if not spec.labels.get(RUN_LABEL):
        return contextlib.nullcontext()
    return lease_renewed(
        kube_api_client, namespace=cluster.namespace, run=spec.labels[RUN_LABEL], ttl_s=cluster.orphan_ttl_s
    )


def _adopt_or_submit(
    runner, appdef, *, spec: LaunchSpec, cluster: ClusterConfig, request: str | None = None
) -> tuple[str, str]:
    """(handle, how) of the launch's job: its running JobSet of this plan (adopted), else a new one, after
    the launch's others are deleted (`lifecycle.adoptable_or_cleared`) and the JobSet CRD is checked."""
    from torchx.specs.builders import make_app_handle

    if builds_jobset(cluster) and spec.labels:
        adopted = adoptable_or_cleared(labels=spec.labels, cluster=cluster, name=spec.name)
        if adopted is not None:
            return make_app_handle(
                cluster.launcher, "batchpilot", f"{cluster.namespace}:{adopted}"
            ), f"{cluster.launcher} (adopted)"
    if builds_jobset(cluster):
        from batchpilot.cluster.crds import check_jobset_crd
        from batchpilot.cluster.readiness import kube_api_client

        # Before the first pod: a JobSet controller older than v0.6.0 would drop failurePolicy.rules.
        check_jobset_crd(kube_api_client())
    info = render_cluster_job(runner, appdef, cluster=cluster, labels=spec.labels, request=request)
    return runner.schedule(info), cluster.launcher
