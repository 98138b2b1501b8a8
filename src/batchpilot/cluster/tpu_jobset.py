"""A launch on a TPU slice as a JobSet: one pod per TPU VM (host), one trainer process in each.

Under the xla runtime a trainer is one process per host that drives every chip of its host; SPMD spans
all chips of the slice, so there is no torchrun agent spreading processes over devices. The rules, and
where each comes from:

- One pod per host, all reachable by name: the JobSet's replicated Job is Indexed with parallelism =
  completions = hosts, and `network.enableDNSHostnames` makes JobSet create a headless service; pod `i`
  is `<jobset>-<replicated job>-0-<i>.<subdomain>` (JobSet docs, "Concepts": "DNS hostnames for Pods").
- The chips: `google.com/tpu` limited (and requested) at the chips per host, and the node selectors
  `cloud.google.com/gke-tpu-accelerator` (TPU type) and `cloud.google.com/gke-tpu-topology` (slice shape)
  (GKE "Deploy TPU workloads in GKE Standard"), plus the slice shape's node pool
  (`planning.tpu.slice_pool_name`) and a toleration of the `google.com/tpu` taint.
- `TPU_WORKER_ID` and `TPU_WORKER_HOSTNAMES` (the host's index and every host's name, which libtpu needs
  to form a multi-host slice) are injected by GKE: "GKE automatically injects these environment variables
  by using a mutating webhook when a Job is created with the completionMode: Indexed, subdomain,
  parallelism > 1, and requesting google.com/tpu properties" (GKE "Deploy TPU workloads in GKE Standard",
  the TPU environment variables of multi-host slices). The JobSet's child Job is exactly such a Job
  (JobSet sets the pod template's subdomain), so they are not set here; a pod that finds them missing (a
  cluster without that webhook) derives the same values from its Job completion index and the JobSet's
  DNS names, and says so on stderr.
- One slice per Job: the JobSet annotation `alpha.jobset.sigs.k8s.io/exclusive-topology:
  cloud.google.com/gke-nodepool` places each child Job alone on one node pool (JobSet docs, "Concepts":
  "Exclusive Job to topology placement"; "TPU Multislice": a 1:1 map between child Jobs and GKE node
  pools), so no pod of another JobSet (a leftover launch) lands on the slice's hosts.
- PJRT: `PJRT_DEVICE=TPU`. The trainer joins a CPU (gloo) process group through torch_xla's `xla://`
  rendezvous, whose TCP store is on `MASTER_ADDR:MASTER_PORT` (torch_xla `_internal/rendezvous.py`: with no
  `MASTER_ADDR` it asks the TPU VM metadata server, which a GKE pod does not reach): host 0's DNS name.
- Preemption: the trainer checkpoints on SIGTERM and exits 75; the pod's command keeps bash as PID 1,
  forwards SIGTERM, and exits 75 when the trainer's marker is there (`launch_spec.exit_75_when_preempted`),
  exactly as the GPU pods do around torchrun.
"""

from __future__ import annotations

import shlex
from typing import Any

from batchpilot.cluster.launch_spec import (
    MEGABYTE,
    TRAINER_OUTPUT_DIR,
    LaunchSpec,
    exit_75_when_preempted,
    write_inputs_command,
)
from batchpilot.cluster.machines import TrainerResources
from batchpilot.cluster.readiness import GKE_NODE_POOL_LABEL
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import PREEMPTED_FILE
from batchpilot.planning.names import REPLICATED_JOB_NAME
from batchpilot.planning.tpu import TPU_RESOURCE_NAME

ROLE_NAME = REPLICATED_JOB_NAME
"""The replicated Job's name, as on GPUs: pods are `<jobset>-batchpilot-0-<host>`; the JobSet's name is the
launch spec's (`names.jobset_name`), whose length leaves room for it."""
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
WORKER_HOSTNAMES_ENV = "BATCHPILOT_TPU_WORKER_HOSTNAMES"
"""Every host's DNS name, comma-separated in host order: what the pod uses when GKE injected nothing."""
XLA_MASTER_PORT = 29500
"""The `xla://` rendezvous's TCP store port on host 0 (torch_xla's default is 12355; any free port does)."""
# The trainer process; bash functions shadow it to forward SIGTERM (see launch_spec.exit_75_when_preempted).
TRAINER_PROGRAM = "python"


def worker_env_fallback() -> str:
    """Bash that sets `TPU_WORKER_ID`/`TPU_WORKER_HOSTNAMES` from the Job's completion index and the JobSet's
    DNS names only where GKE's webhook did not inject them, saying so (never silently)."""
    return (
        'if [ -z "${TPU_WORKER_HOSTNAMES:-}" ]; then '
        'echo "batchpilot: TPU_WORKER_ID/TPU_WORKER_HOSTNAMES were not injected by GKE; using the Job '
        'completion index and the JobSet pod names" >&2; '
        f'export TPU_WORKER_ID="$JOB_COMPLETION_INDEX" TPU_WORKER_HOSTNAMES="${WORKER_HOSTNAMES_ENV}"; fi; '
    )


def tpu_trainer_command(spec: LaunchSpec) -> str:
    """The pod's bash line: write the run document, then run `python -m batchpilot train ...` once (exit
    75 after a preemption checkpoint). Several hosts also get the worker variables if GKE did not set them."""
    trainer = shlex.join([TRAINER_PROGRAM, "-m", "batchpilot", *spec.trainer_args])
    prefix = worker_env_fallback() if spec.num_nodes > 1 else ""
    return exit_75_when_preempted(
        prefix + write_inputs_command() + trainer,
        marker=f"{TRAINER_OUTPUT_DIR}/{PREEMPTED_FILE}",
        program=TRAINER_PROGRAM,
    )


def tpu_appdef(spec: LaunchSpec, *, cluster: ClusterConfig, resources: TrainerResources) -> Any:
    """A torchx AppDef of one role: `spec.num_nodes` replicas (one per host), each one trainer process with
    every chip of its host, placed on the node pool of the launch's slice shape."""
    from torchx import specs
    from torchx.specs.overlays import set_overlay

    from batchpilot.cluster.placement import trainer_pod_overlay

    if spec.tpu_topology is None:
        raise BatchpilotError(
            "plan",
            f"launch {spec.name} has no TPU slice topology but cluster.accelerator_type is "
            f"{cluster.accelerator_type}",
            "plan again with this config (`batchpilot plan --out`)",
        )
    if cluster.launcher != "jobset":
        raise BatchpilotError(
            "cluster.launcher",
            f"{cluster.launcher} cannot run a multi-host TPU slice (one indexed pod per host with DNS names)",
            "set cluster.launcher: jobset",
        )
    assert cluster.image is not None  # cluster_appdef checked it
    env = {
        "PYTHONUNBUFFERED": "1",
        "HOME": "/tmp",
        **cluster.env,
        "PJRT_DEVICE": "TPU",
        "MASTER_PORT": str(XLA_MASTER_PORT),
        **spec.env,
    }
    role = specs.Role(
        name=ROLE_NAME,
        image=cluster.image,
        entrypoint="bash",
        args=["-c", tpu_trainer_command(spec)],
        env=env,
        num_replicas=spec.num_nodes,
        max_retries=0,
        resource=specs.Resource(
            cpu=resources.cpu,
            gpu=0,
            memMB=resources.memory_bytes // MEGABYTE,
            devices={TPU_RESOURCE_NAME: cluster.devices_per_node},
        ),
    )
    set_overlay(role, "kubernetes", "V1Pod", trainer_pod_overlay(cluster, tpu_topology=spec.tpu_topology))
    return specs.AppDef(name=spec.name, roles=[role])


def finish_tpu_jobset(resource: dict[str, Any]) -> None:
    """Adds what the torchx rendering cannot know before the JobSet's name is chosen: the exclusive
    node-pool placement, host 0's name as `MASTER_ADDR` and every host's name (`WORKER_HOSTNAMES_ENV`)."""
    name = resource["metadata"]["name"]
    subdomain = resource["spec"]["network"]["subdomain"]
    resource["metadata"].setdefault("annotations", {})[EXCLUSIVE_TOPOLOGY_ANNOTATION] = GKE_NODE_POOL_LABEL
    for replicated in resource["spec"]["replicatedJobs"]:
        job = replicated["template"]["spec"]
        hosts = [f"{name}-{replicated['name']}-0-{k}.{subdomain}" for k in range(job["parallelism"])]
        for container in job["template"]["spec"]["containers"]:
            env = container.setdefault("env", [])
            env.append({"name": "MASTER_ADDR", "value": hosts[0]})
            env.append({"name": WORKER_HOSTNAMES_ENV, "value": ",".join(hosts)})
