"""Launch a stage's trainers through torchx: one AppDef built from the plan's stage.

The embedded default is torchx's `local_cwd` scheduler: a "node" is a torchrun agent with
`devices_per_node` processes on this machine, all joined over gloo on loopback. On GKE the same
stage becomes a JobSet (batchpilot's `jobset` torchx scheduler) or a Volcano Job (torchx `kubernetes`),
one pod per node, placed on the node pool by its label.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_LOG_MARKER
from batchpilot.planning import Stage
from batchpilot.threads import local_trainer_threads

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LaunchSpec:
    """What one stage's job needs, independent of the scheduler."""

    name: str
    num_nodes: int
    processes_per_node: int
    trainer_args: tuple[str, ...]
    env: dict[str, str]


def stage_launch_spec(
    *,
    run_name: str,
    stage: Stage,
    devices_per_node: int,
    plan_path: str,
    output_dir: str,
    audit: bool = False,
) -> LaunchSpec:
    """The trainer command line and topology of `stage`: `batchpilot train --plan ... --stage N`."""
    return LaunchSpec(
        name=f"{run_name}-{stage.name}",
        num_nodes=stage.num_nodes,
        processes_per_node=devices_per_node,
        trainer_args=(
            "train",
            "--plan",
            plan_path,
            "--stage",
            str(stage.index),
            "--output-dir",
            output_dir,
            *(("--audit",) if audit else ()),
        ),
        env={},
    )


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
    runner: Any, handle: str, *, spec: LaunchSpec, role: str, wait_interval_s: float, via: str, where: str
) -> int:
    """Says the job was launched `via` a launcher, streams every node's log lines until it ends; returns 0,
    EXIT_PREEMPTED or 1.

    torchrun exits 1 whatever its workers' codes were, so preemption is told by rank 0's log line.
    """
    from torchx.specs import AppState

    logger.info(
        "launched %s: %d node(s) x %d process(es) via %s (%s)",
        spec.name, spec.num_nodes, spec.processes_per_node, via, handle,
    )  # fmt: skip

    seen: set[str] = set()
    streams = [
        threading.Thread(target=_stream, args=(runner, handle, role, k, seen), daemon=True)
        for k in range(spec.num_nodes)
    ]
    try:
        for thread in streams:
            thread.start()
        status = runner.wait(handle, wait_interval=wait_interval_s)
        for thread in streams:
            thread.join(timeout=30)
    except KeyboardInterrupt:
        runner.cancel(handle)
        raise
    finally:
        runner.close()
    if status is None:
        raise BatchpilotError(spec.name, f"the job {handle} disappeared before it finished", where)
    if status.state == AppState.SUCCEEDED:
        return 0
    if PREEMPTED_LOG_MARKER in seen:
        logger.info("%s was preempted after checkpointing: exit %d", spec.name, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    detail = f": {status.msg}" if status.msg and status.msg != "<NONE>" else ""
    logger.error("%s failed (%s)%s; %s", spec.name, status.state, detail, where)
    return 1


def _stream(runner, handle: str, role: str, replica: int, seen: set[str]) -> None:
    """Relays one node's log lines to stdout as they come (they are the trainers' own output, already
    formatted, not this process's log records), noting the preemption marker."""
    for line in runner.log_lines(handle, role_name=role, k=replica, should_tail=True):
        if PREEMPTED_LOG_MARKER in line:
            seen.add(PREEMPTED_LOG_MARKER)
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()


# --- GKE: the same stage as a JobSet or a Volcano Job -------------------------------------------

TRAINER_DIR = "/tmp/batchpilot"
"""Inside a trainer pod: where the config and plan are written (the root filesystem is read-only)."""
RDZV_PORT = 29500
# torchx writes memMB as Kubernetes "M" (10^6 bytes), so bytes convert with the decimal megabyte.
MEGABYTE = 10**6


def cluster_launch_spec(
    *,
    run_name: str,
    stage: Stage,
    devices_per_node: int,
    plan_text: str,
    audit: bool = False,
) -> LaunchSpec:
    """The stage's spec for pods: the run document travels as an environment variable, written to a file first.

    The launching process (a pipeline task or a laptop) holds the files; pods do not share its disk.
    Metrics and logs under `output_dir` stay in the pod; checkpoints go to `train.checkpoint_uri`.
    """
    spec = stage_launch_spec(
        run_name=run_name,
        stage=stage,
        devices_per_node=devices_per_node,
        plan_path=f"{TRAINER_DIR}/plan.json",
        output_dir=f"{TRAINER_DIR}/out",
        audit=audit,
    )
    # Compact JSON: the plan rides in the pod spec, which the API server stores whole.
    compact_plan = json.dumps(json.loads(plan_text), separators=(",", ":"))
    env = {"BATCHPILOT_PLAN_JSON": compact_plan}
    return LaunchSpec(spec.name, spec.num_nodes, spec.processes_per_node, spec.trainer_args, env)


def cluster_appdef(spec: LaunchSpec, *, cluster: ClusterConfig):
    """A torchx AppDef for `spec` on GKE: image, resources, node selector, tolerations, env."""
    from torchx.components.dist import torchrun
    from torchx.specs.overlays import set_overlay

    from batchpilot.cluster.placement import trainer_pod_overlay

    if not cluster.image:
        raise BatchpilotError("cluster.image", "is required when cluster.backend is gke", "set cluster.image")
    gpus = spec.processes_per_node if cluster.accelerator_type else 0
    appdef = torchrun(
        *spec.trainer_args,
        m="batchpilot",
        name=spec.name,
        image=cluster.image,
        j=f"{spec.num_nodes}x{spec.processes_per_node}",
        cpu=cluster.cpu_per_node or 0,
        gpu=gpus,
        memMB=(cluster.memory_per_node_bytes or 0) // MEGABYTE,
        env={"PYTHONUNBUFFERED": "1", "HOME": "/tmp", **cluster.env, **spec.env},
        rdzv_port=RDZV_PORT,
        tee=3,
    )
    role = appdef.roles[0]
    assert role.args[0] == "-c", role.args  # torchrun's component runs one bash command line
    write_inputs = (
        f'mkdir -p {TRAINER_DIR} && printf "%s" "$BATCHPILOT_PLAN_JSON" > {TRAINER_DIR}/plan.json && '
    )
    role.args = ["-c", write_inputs + role.args[1]]
    set_overlay(role, "kubernetes", "V1Pod", trainer_pod_overlay(cluster))
    return appdef


def cluster_runner():
    """A torchx Runner that knows the `jobset` scheduler whether or not its entry point is installed."""
    from torchx.runner import Runner
    from torchx.schedulers import get_scheduler_factories

    from batchpilot.cluster import jobset

    factories = {"jobset": jobset.create_scheduler, **get_scheduler_factories()}
    return Runner("batchpilot", factories)


def cluster_scheduler(cluster: ClusterConfig) -> tuple[str, dict[str, object]]:
    """(torchx scheduler name, its run config) for `cluster.launcher`."""
    if cluster.launcher == "jobset":
        cfg: dict[str, object] = {"namespace": cluster.namespace, "service_account": cluster.service_account}
        if cluster.kueue_queue:
            cfg["queue"] = cluster.kueue_queue
        return "jobset", cfg
    if cluster.kueue_queue:
        raise BatchpilotError(
            "cluster.kueue_queue", "applies to the jobset launcher only", "remove it, or use launcher jobset"
        )
    # validate_spec would ask the API server for a dry-run create; submission validates anyway.
    return "kubernetes", {
        "namespace": cluster.namespace,
        "queue": cluster.volcano_queue,
        "service_account": cluster.service_account,
        "validate_spec": False,
    }


def render_cluster_job(runner, appdef, *, cluster: ClusterConfig):
    """The torchx dry-run of `appdef` with hardened containers; `.request` is what would be created."""
    from batchpilot.cluster.placement import harden_containers

    scheduler, cfg = cluster_scheduler(cluster)
    info = runner.dryrun(appdef, scheduler, cfg=cfg)
    resource = info.request.resource
    if scheduler == "kubernetes":
        from torchx.schedulers.kubernetes_scheduler import sanitize_for_serialization

        # torchx leaves V1Pod objects in the Volcano Job; plain dicts serialise and validate alike.
        resource = info.request.resource = sanitize_for_serialization(resource)
        resource["metadata"]["namespace"] = cluster.namespace
        for task in resource["spec"]["tasks"]:
            harden_containers(task["template"]["spec"])
    return info


def cluster_job_yaml(info) -> str:
    """The rendered JobSet or Volcano Job as YAML."""
    import yaml

    return yaml.safe_dump(info.request.resource, sort_keys=False)


def render_cluster_yaml(spec: LaunchSpec, *, cluster: ClusterConfig) -> str:
    """The JobSet or Volcano Job that `run_cluster` would create, as YAML; makes no API call."""
    runner = cluster_runner()
    return cluster_job_yaml(
        render_cluster_job(runner, cluster_appdef(spec, cluster=cluster), cluster=cluster)
    )


def run_cluster(spec: LaunchSpec, *, cluster: ClusterConfig) -> int:
    """Submits the stage to GKE, streams every node's log, returns 0, 75 (preempted) or 1."""
    runner = cluster_runner()
    appdef = cluster_appdef(spec, cluster=cluster)
    info = render_cluster_job(runner, appdef, cluster=cluster)
    handle = runner.schedule(info)
    return follow(
        runner, handle, spec=spec, role=appdef.roles[0].name, wait_interval_s=10,
        via=cluster.launcher, where=f"see the job {handle} in namespace {cluster.namespace}",
    )  # fmt: skip
