"""The names a gke run creates, derived in one place, and the rules GKE, Kubernetes and JobSet hold them to.

Pure: no API call, no kubernetes or torchx import. A launch's JobSet is named `jobset_name(run, launch)`:
a readable prefix of `<run>-<launch>` and a hash of both, at most `JOBSET_NAME_MAX_CHARS` characters and
a letter first, so the JobSet webhook accepts it whatever the run's name. The name is deterministic (a
retried launch finds its JobSet by labels, deletes a stale one and waits until it is gone before it
creates the new one: `lifecycle.adoptable_or_cleared`), so no random suffix is needed.

`cluster_problems(...)` is what `checks.plan_problems` asks of a gke config, one error per problem:
every name the run creates (JobSet, Job and pod names at `cluster.max_nodes`, the subdomain, label values,
the namespace, the node pool and the TPU slice pools' names) and storage the trainer pods can reach.

The rules, and where each comes from:
- DNS-1035 label (`[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63) and DNS-1123 subdomain (dot-separated
  DNS-1123 labels, at most 253), label values (at most 63, `(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?`),
  and their messages: k8s.io/apimachinery pkg/util/validation/validation.go (IsDNS1035Label,
  IsDNS1123Subdomain, IsValidLabelValue); a namespace is a DNS-1123 label (IsDNS1123Label);
- a JobSet (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go, ValidateCreate): `spec.network.subdomain`
  is a DNS-1123 subdomain and a DNS-1035 label (it names the headless service); the longest Job name
  `<jobset>-<replicated job>-<max job index>` is a DNS-1035 label; for Indexed Jobs so is the longest pod
  name `<jobset>-<replicated job>-<max job index>-<max pod index>` plus "-abcde" (the Job controller's
  5-character random suffix); names from pkg/util/placement/placement.go (GenJobName, GenPodName). The
  API server also requires every custom resource's metadata.name to be a DNS-1123 subdomain;
- a GKE node pool name: `[a-z]([-a-z0-9]{0,38}[a-z0-9])?` (1-40 characters), GKE's own refusal
  `Invalid value for field "node_pool.name": ... Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,38}
  [a-z0-9])?)'` (quoted in pulumi/pulumi-gcp issue 1510; tests/integration/container_api_server.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from batchpilot.errors import BatchpilotError
from batchpilot.planning.stages import MAX_STAGES
from batchpilot.planning.tpu import is_tpu, slice_pool_name, tpu_slices

MAX_NAME_CHARS = 63
"""IsDNS1035Label / IsDNS1123Label / IsValidLabelValue: at most 63 characters."""
REPLICATED_JOB_NAME = "batchpilot"
"""The replicated Job of every launch's JobSet: torchx's `dist.torchrun` names its role after the module's
last part (`-m batchpilot`), and TPU launches use the same name (`tpu_jobset.ROLE_NAME`)."""
POD_NAME_SUFFIX = "-abcde"
"""What the JobSet webhook adds to the longest pod name it checks: the Job controller's random suffix."""
MAX_POD_INDEX_DIGITS = 5
"""Room for pod indexes 0..99999 (one pod per node); a GKE cluster has at most 65,000 nodes (GKE "Quotas
and limits"), so a launch's name never depends on its node count. `cluster_problems` checks it anyway."""
JOBSET_NAME_MAX_CHARS = (
    MAX_NAME_CHARS - len(POD_NAME_SUFFIX) - len(f"-{REPLICATED_JOB_NAME}-0-") - MAX_POD_INDEX_DIGITS
)
"""38: the longest JobSet name whose pods (`<jobset>-batchpilot-0-<99999>-abcde`) stay DNS-1035 labels."""
HASH_CHARS = 8
"""Hex digits of the SHA-256 of run and launch name that end every JobSet name (32 bits: no two of a
namespace's JobSets meet by chance)."""
LETTER_PREFIX = "bp-"
"""Put before a run name that starts with a digit: a DNS-1035 label starts with a letter."""
LONGEST_LAUNCH_NAME = f"stages-{MAX_STAGES - 2}-final"
"""The longest launch name a plan can have (`planning.launches.launch_name` of its last two stages)."""
GKE_NODE_POOL_MAX_CHARS = 40

_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_GKE_NODE_POOL = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")

# validation.go's messages (RegexError with its examples), so a refusal reads as the API server's would.
DNS1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
DNS1123_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)


def max_len_message(limit: int) -> str:
    return f"must be no more than {limit} characters"


def dns1035_label_problems(value: str) -> list[str]:
    """IsDNS1035Label's messages for `value` (none: valid)."""
    found = [max_len_message(MAX_NAME_CHARS)] if len(value) > MAX_NAME_CHARS else []
    return found + ([] if _DNS1035_LABEL.fullmatch(value) else [DNS1035_MESSAGE])


def dns1123_subdomain_problems(value: str) -> list[str]:
    """IsDNS1123Subdomain's messages for `value` (none: valid)."""
    found = [max_len_message(253)] if len(value) > 253 else []
    return found + ([] if _DNS1123_SUBDOMAIN.fullmatch(value) else [DNS1123_SUBDOMAIN_MESSAGE])


def is_dns1123_label(value: str) -> bool:
    return len(value) <= MAX_NAME_CHARS and bool(_DNS1123_LABEL.fullmatch(value))


def is_label_value(value: str) -> bool:
    """IsValidLabelValue: at most 63 characters, alphanumeric at both ends, `-_.` inside."""
    return len(value) <= MAX_NAME_CHARS and bool(_LABEL_VALUE.fullmatch(value))


def is_gke_node_pool_name(value: str) -> bool:
    return bool(_GKE_NODE_POOL.fullmatch(value))


def jobset_name(*, run_name: str, launch_name: str) -> str:
    """The JobSet of launch `launch_name` of run `run_name`: `<readable prefix>-<8 hex digits>`.

    The prefix is `<run>-<launch>` (lower case, `[a-z0-9-]` only, `bp-` first when the run starts with a
    digit) with the run cut so that the launch's name stays whole and the name fits `JOBSET_NAME_MAX_CHARS`;
    the hash is of the full run and launch names, so two runs never share a name when their cut prefixes
    do.
    """
    digest = hashlib.sha256(f"{run_name}/{launch_name}".encode()).hexdigest()[:HASH_CHARS]
    run, launch = (re.sub(r"[^a-z0-9-]", "", text.lower()).strip("-") for text in (run_name, launch_name))
    if not run[:1].isalpha():
        run = LETTER_PREFIX + run
    room = JOBSET_NAME_MAX_CHARS - HASH_CHARS - 1  # for the prefix, before `-<hash>`
    run = run[: max(room - len(launch) - 1, 1)].rstrip("-")
    prefix = f"{run}-{launch}"[:room].strip("-")
    return f"{prefix}-{digest}"


def job_name(jobset: str, replicated_job: str, job_index: int) -> str:
    """placement.GenJobName: `<jobset>-<replicated job>-<job index>`."""
    return f"{jobset}-{replicated_job}-{job_index}"


def pod_name(jobset: str, replicated_job: str, job_index: int, pod_index: int) -> str:
    """placement.GenPodName, without the Job controller's random suffix."""
    return f"{job_name(jobset, replicated_job, job_index)}-{pod_index}"


def jobset_problems(
    *, name: str, subdomain: str | None, replicated_jobs: Sequence[tuple[str, int, int]]
) -> list[str]:
    """What the API server and the JobSet webhook would refuse in a JobSet's names, one line each.

    Args:
        name: metadata.name.
        subdomain: spec.network.subdomain (None: unset).
        replicated_jobs: (name, replicas, pods per Job) of each replicated Job (all Indexed here).
    """
    found = [f"metadata.name {name!r}: {m}" for m in dns1123_subdomain_problems(name)]
    if subdomain:
        found += [f"spec.network.subdomain {subdomain!r}: {m}" for m in dns1123_subdomain_problems(subdomain)]
        found += [f"spec.network.subdomain {subdomain!r}: {m}" for m in dns1035_label_problems(subdomain)]
    for replicated, replicas, pods in replicated_jobs:
        job = job_name(name, replicated, replicas - 1)
        found += [f"Job name {job!r} ({len(job)} characters): {m}" for m in dns1035_label_problems(job)]
        pod = pod_name(name, replicated, replicas - 1, pods - 1) + POD_NAME_SUFFIX
        found += [f"pod name {pod!r} ({len(pod)} characters): {m}" for m in dns1035_label_problems(pod)]
    return found


def cluster_problems(
    *,
    backend: str,
    run_name: str,
    namespace: str,
    kueue_queue: str | None,
    node_pool: str | None,
    accelerator_type: str | None,
    machine_type: str | None,
    devices_per_node: int,
    min_nodes: int,
    max_nodes: int,
    data_uri: str,
    checkpoint_uri: str,
    priority_class: str | None = None,
) -> list[BatchpilotError]:
    """Every name a gke run would create that GKE, Kubernetes or the JobSet webhook would refuse, and
    storage its trainer pods cannot reach, one error each naming the field and the fix ([] off gke).

    `checks.plan_problems` calls it, so `config check`, `plan` and `compile` refuse such a config before
    any node is paid for; it needs no cluster (a gke config still plans on a laptop). The arguments are the
    config's fields of the same names (`name` is `run_name`, `data.uri` is `data_uri`).
    """
    if backend != "gke":
        return []
    problems = name_problems(
        run_name=run_name, namespace=namespace, kueue_queue=kueue_queue, max_nodes=max_nodes,
        priority_class=priority_class,
    )  # fmt: skip
    problems += node_pool_problems(
        node_pool=node_pool, accelerator_type=accelerator_type, machine_type=machine_type,
        devices_per_node=devices_per_node, min_nodes=min_nodes, max_nodes=max_nodes,
    )  # fmt: skip
    return problems + storage_problems(run_name=run_name, data_uri=data_uri, checkpoint_uri=checkpoint_uri)


def name_problems(
    *,
    run_name: str,
    namespace: str,
    kueue_queue: str | None,
    max_nodes: int,
    priority_class: str | None = None,
) -> list[BatchpilotError]:
    """The run label, the JobSets and their Jobs and pods at `max_nodes`, the namespace, the queue and priority
    labels (Kueue reads a priority class only beside a queue)."""
    problems: list[BatchpilotError] = []
    if not is_label_value(run_name):
        problems.append(
            BatchpilotError(
                "name",
                f"{run_name!r} cannot be the value of the batchpilot.dev/run label",
                "use at most 40 lower case letters, digits and '-', a letter or digit at both ends",
            )
        )
    # Every launch's JobSet name is at most as long as the longest launch name's (only the run is cut).
    longest = jobset_name(run_name=run_name, launch_name=LONGEST_LAUNCH_NAME)
    refused = jobset_problems(
        name=longest, subdomain=longest, replicated_jobs=[(REPLICATED_JOB_NAME, 1, max_nodes)]
    )
    if refused:
        problems.append(
            BatchpilotError(
                "cluster.max_nodes",
                f"{max_nodes} nodes make JobSet names the JobSet webhook refuses: {refused[0]}",
                f"set cluster.max_nodes to at most {10**MAX_POD_INDEX_DIGITS}",
            )
        )
    if not is_dns1123_label(namespace):
        problems.append(
            BatchpilotError(
                "cluster.namespace",
                f"{namespace!r} is not a Kubernetes namespace name (a DNS-1123 label: at most 63 lower case "
                "letters, digits and '-', a letter or digit at both ends)",
                "use an existing namespace's name, e.g. batchpilot",
            )
        )
    if kueue_queue is not None and not is_label_value(kueue_queue):
        problems.append(
            BatchpilotError(
                "cluster.kueue_queue",
                f"{kueue_queue!r} cannot be the value of the kueue.x-k8s.io/queue-name label (at most 63 "
                "letters, digits, '-', '_' or '.', a letter or digit at both ends)",
                "use the name of a LocalQueue in cluster.namespace",
            )
        )
    if priority_class is not None and kueue_queue is None:
        problems.append(
            BatchpilotError(
                "cluster.priority_class",
                "is a Kueue WorkloadPriorityClass and applies only to JobSets in a Kueue queue",
                "set cluster.kueue_queue to the team's LocalQueue, or remove cluster.priority_class",
            )
        )
    elif priority_class is not None and (
        dns1123_subdomain_problems(priority_class) or not is_label_value(priority_class)
    ):
        problems.append(
            BatchpilotError(
                "cluster.priority_class",
                f"{priority_class!r} cannot name a WorkloadPriorityClass (a DNS-1123 subdomain: at most 63 "
                "lower case letters, digits, '-' or '.' here, as the value of the kueue.x-k8s.io/priority-class "
                "label, a letter or digit at both ends)",
                "use the name of a WorkloadPriorityClass of the cluster (`kubectl get workloadpriorityclasses`)",
            )
        )
    return problems


def launcher_problems(
    *, backend: str, launcher: str, training_runtime: str | None, accelerator_type: str | None
) -> list[BatchpilotError]:
    """`cluster.launcher: trainjob` and `cluster.training_runtime` (Kubeflow Trainer v2, `cluster/trainjob.py`):
    the runtime's name (a ClusterTrainingRuntime is named by a DNS-1123 subdomain), a runtime without the
    launcher, and TPU slices, whose multi-host JobSets batchpilot builds itself ([] off gke)."""
    if backend != "gke":
        return []
    problems: list[BatchpilotError] = []
    if training_runtime is not None and launcher != "trainjob":
        problems.append(
            BatchpilotError(
                "cluster.training_runtime",
                f"names a Kubeflow Trainer runtime, but cluster.launcher is {launcher}",
                "set cluster.launcher: trainjob, or remove cluster.training_runtime",
            )
        )
    elif training_runtime is not None and (refused := dns1123_subdomain_problems(training_runtime)):
        problems.append(
            BatchpilotError(
                "cluster.training_runtime",
                f"{training_runtime!r} cannot name a ClusterTrainingRuntime: {refused[0]}",
                "use the name of one (`kubectl get clustertrainingruntimes`), e.g. batchpilot",
            )
        )
    if launcher == "trainjob" and is_tpu(accelerator_type):
        problems.append(
            BatchpilotError(
                "cluster.launcher",
                f"trainjob is not implemented for TPU slices ({accelerator_type}): batchpilot builds their "
                "multi-host JobSets itself",
                "set cluster.launcher: jobset",
            )
        )
    return problems


def node_pool_problems(
    *,
    node_pool: str | None,
    accelerator_type: str | None,
    machine_type: str | None,
    devices_per_node: int,
    min_nodes: int,
    max_nodes: int,
) -> list[BatchpilotError]:
    """`cluster.node_pool` and, on TPUs, the slice pools `<node_pool>-<topology>` batchpilot creates (or
    expects) for the slice shapes of `min_nodes..max_nodes` hosts (`cluster.tpu_pool.TpuSlicePool`)."""
    if node_pool is None:
        return []  # gke.require_gke_settings names it when a pool task needs it
    rule = (
        f"GKE node pool names are 1-{GKE_NODE_POOL_MAX_CHARS} lower case letters, digits and '-', starting "
        "with a letter and not ending with '-'"
    )
    if not is_gke_node_pool_name(node_pool):
        return [BatchpilotError("cluster.node_pool", f"{node_pool!r} is not a node pool name: {rule}")]
    if accelerator_type is None or not is_tpu(accelerator_type):
        return []
    try:
        slices = tpu_slices(
            accelerator_type=accelerator_type, machine_type=machine_type, devices_per_node=devices_per_node
        )
    except BatchpilotError:
        return []  # checks.check_tpu reports an unknown type or machine
    topologies = [shape.topology for shape in slices.slices if min_nodes <= shape.hosts <= max_nodes]
    refused = [
        slice_pool_name(node_pool, topology)
        for topology in topologies
        if not is_gke_node_pool_name(slice_pool_name(node_pool, topology))
    ]
    if not refused:
        return []
    room = GKE_NODE_POOL_MAX_CHARS - 1 - max(len(topology) for topology in topologies)
    return [
        BatchpilotError(
            "cluster.node_pool",
            f"{node_pool!r} makes TPU slice node pool names GKE refuses ({', '.join(refused)}): {rule}",
            f"shorten cluster.node_pool to at most {room} characters",
        )
    ]


def storage_problems(*, run_name: str, data_uri: str, checkpoint_uri: str) -> list[BatchpilotError]:
    """Local (`file://`) data or checkpoints, which gke trainer pods cannot share: a pod sees its image and
    its own emptyDir `/tmp` (`cluster.placement.trainer_pod_overlay`), gone when the pod goes."""
    problems = []
    if checkpoint_uri.startswith("file://"):
        problems.append(
            BatchpilotError(
                "train.checkpoint_uri",
                f"{checkpoint_uri} is a local path, but each gke trainer pod would write it into its own "
                "emptyDir: a restarted JobSet would start again from step 0 and the train task could not "
                "read the metrics",
                f"use a gs:// URI the pods' service account can write, e.g. gs://BUCKET/{run_name}/ckpt",
            )
        )
    if data_uri.startswith("file://"):
        problems.append(
            BatchpilotError(
                "data.uri",
                f"{data_uri} is a local path, which gke trainer pods cannot read (they see their image and "
                "an empty /tmp)",
                "copy the shard set to GCS (`batchpilot data prepare ... --out gs://BUCKET/PREFIX`) and use "
                "its gs:// URI",
            )
        )
    return problems
