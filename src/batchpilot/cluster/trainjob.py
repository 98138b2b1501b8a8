"""Kubeflow Trainer v2: a launch as a TrainJob (`trainer.kubeflow.org/v1alpha1`) on a ClusterTrainingRuntime
(`cluster.launcher: trainjob`, `cluster.training_runtime`).

Trainer's controller builds one JobSet per TrainJob, named as the TrainJob, from the runtime's JobSet template
and the TrainJob's fields (kubeflow/trainer v2.3.0: pkg/runtime/core/trainingruntime.go, pkg/runtime/framework/
plugins/jobset/{jobset.go,builder.go}; docs/research/kueue_trainer.md sections 8-11). batchpilot renders the
JobSet its `jobset` launcher would create (one role named `node`: Trainer's torch runtimes need the replicated
job and the container of that name) and splits it in two:

- the runtime: what is the same for every launch of a config and no TrainJob field can set: the JobSet's
  failure, success and network policies and TTL, the Job's indexed completion and pod failure policy, the pod's
  restart policy, grace period, security context, volumes and sidecars (GPUDirect's daemon), the `node`
  container's ports, mounts and security context (`runtime_object`; `batchpilot launch --dry-run` prints it,
  the chart installs the one for pods without GPUDirect);
- the TrainJob: the launch's node count, image, command, environment and resources per node (`spec.trainer`),
  and one runtime patch (`spec.runtimePatches`, manager `PATCH_MANAGER`) with the JobSet's labels and the pod's
  labels, annotations (safe-to-evict, GPUDirect's networks, a flex-start request), node selector, tolerations
  and service account (`trainjob_object`).

A runtime that differs from the one a launch needs in a part the TrainJob cannot set is refused before the
TrainJob is created, naming the first difference (`runtime_problems`): a runtime without batchpilot's failure
policy would turn a preempted node's exit 75 into a failed stage, or restart a real error.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from torchx.schedulers.api import DescribeAppResponse
from torchx.specs.api import AppDef, AppDryRunInfo, AppState, runopts

from batchpilot.cluster.jobset import JobSetOpts, JobSetScheduler, app_to_jobset
from batchpilot.cluster.objects import cluster_object
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOBS, CLUSTER_RUNTIMES = "trainjobs", "clustertrainingruntimes"
TRAINJOB_KIND = (GROUP, VERSION, TRAINJOBS)
NODE = "node"
"""The replicated job and container Trainer's torch runtime runs the trainer in (trainer v2.3.0
pkg/constants/constants.go `Node`; the runtime webhook requires the container in the job labelled trainer)."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_ANCESTOR = "trainer"
PATCH_MANAGER = "batchpilot/launch"
"""The manager of batchpilot's runtime patch: a domain-prefixed path, as Trainer's webhook requires
(jobset.go `Validate`: `IsDomainPrefixedPath`)."""
DEFAULT_RUNTIME = "batchpilot"
KUEUE_PREFIX = "kueue.x-k8s.io/"
RESERVED_ENV_PREFIX = "PET_"
"""Trainer injects torchrun's PET_* variables and refuses a TrainJob that sets one (torch.go `Validate`)."""

_PATCHED_POD_FIELDS = ("nodeSelector", "tolerations", "serviceAccountName")
"""Pod fields the runtime patch carries (PodSpecPatch in trainjob_types.go allows them; Kueue patches the
first two at admission)."""
_TRAINER_CONTAINER_FIELDS = ("image", "command", "args", "env", "resources")
"""The `node` container's fields the TrainJob's `spec.trainer` sets (builder.go `Trainer`; resources through
`resourcesPerNode`, trainingruntime.go)."""


def runtime_object(jobset: Mapping[str, Any], *, name: str) -> dict[str, Any]:
    """The ClusterTrainingRuntime `name` that, with `trainjob_object`'s TrainJob, builds `jobset` (pure)."""
    spec = copy.deepcopy(dict(jobset["spec"]))
    for key in ("suspend",):
        spec.pop(key, None)
    spec["network"] = {k: v for k, v in spec.get("network", {}).items() if k != "subdomain"}
    (replicated,) = spec["replicatedJobs"]
    _require_node(replicated)
    job = replicated["template"]["spec"]
    for key in ("parallelism", "completions"):  # Trainer sets both to numNodes (SyncParallelCount)
        job.pop(key, None)
    pod = job["template"]
    pod.pop("metadata", None)  # labels and annotations come through the patch
    for key in _PATCHED_POD_FIELDS:
        pod["spec"].pop(key, None)
    container = _node_container(pod["spec"])
    for key in _TRAINER_CONTAINER_FIELDS:
        if key != "image":  # the runtime names an image; the TrainJob's replaces it
            container.pop(key, None)
    replicated["template"]["metadata"] = {"labels": {ANCESTOR_LABEL: TRAINER_ANCESTOR}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": spec}},
    }


def trainjob_object(jobset: Mapping[str, Any], *, runtime: str) -> dict[str, Any]:
    """The TrainJob of `jobset`'s launch on ClusterTrainingRuntime `runtime` (pure): its name, namespace and
    labels (Kueue's queue and priority labels included) are the JobSet's."""
    (replicated,) = jobset["spec"]["replicatedJobs"]
    _require_node(replicated)
    job = replicated["template"]["spec"]
    pod = job["template"]
    container = _node_container(pod["spec"])
    reserved = sorted(
        e["name"] for e in container.get("env", []) if e["name"].startswith(RESERVED_ENV_PREFIX)
    )
    if reserved:
        raise BatchpilotError(
            "cluster.env", f"sets {reserved[0]}, which Kubeflow Trainer reserves for torchrun", "remove it"
        )
    trainer: dict[str, Any] = {
        "image": container["image"],
        "command": list(container.get("command", [])),
        "numNodes": job["parallelism"],
        "env": [dict(e) for e in container.get("env", [])],
        "resourcesPerNode": copy.deepcopy(container.get("resources", {})),
    }
    if container.get("args"):
        trainer["args"] = list(container["args"])
    pod_patch = {key: copy.deepcopy(pod["spec"][key]) for key in _PATCHED_POD_FIELDS if key in pod["spec"]}
    metadata = jobset["metadata"]
    # The JobSet's labels but Kueue's: Kueue queues the TrainJob and leaves the JobSet Trainer builds for it
    # alone (its ancestor is queued).
    jobset_labels = {
        k: v for k, v in (metadata.get("labels") or {}).items() if not k.startswith(KUEUE_PREFIX)
    }
    spec: dict[str, Any] = {
        "runtimeRef": {"name": runtime, "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
        "trainer": trainer,
        "runtimePatches": [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {
                    "template": {
                        "metadata": {"labels": jobset_labels},
                        "spec": {
                            "replicatedJobs": [
                                {
                                    "name": NODE,
                                    "template": {
                                        "spec": {
                                            "template": {
                                                "metadata": copy.deepcopy(pod.get("metadata") or {}),
                                                "spec": pod_patch,
                                            }
                                        }
                                    },
                                }
                            ]
                        },
                    }
                },
            }
        ],
    }
    if jobset["spec"].get("suspend"):
        spec["suspend"] = True
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "labels": dict(metadata.get("labels") or {}),
        },
        "spec": spec,
    }


def runtime_problems(found: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """How ClusterTrainingRuntime `found` differs from `expected` (`runtime_object`) where a TrainJob cannot
    make up for it: each difference as `spec.<path>: <found> instead of <expected>` (the image aside: the
    TrainJob sets it). [] when the runtime builds the launch's JobSet."""
    problems: list[str] = []
    _diff(_comparable(found), _comparable(expected), "spec", problems)
    return problems


def _comparable(runtime: Mapping[str, Any]) -> Any:
    spec = copy.deepcopy(dict(runtime.get("spec") or {}))
    for replicated in ((spec.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []:
        pod = ((replicated.get("template") or {}).get("spec") or {}).get("template") or {}
        for container in (pod.get("spec") or {}).get("containers") or []:
            if container.get("name") == NODE:
                container.pop("image", None)
    return spec


def _diff(found: Any, expected: Any, path: str, problems: list[str]) -> None:
    if isinstance(expected, dict) and isinstance(found, dict):
        for key in sorted(set(expected) | set(found)):
            _diff(found.get(key), expected.get(key), f"{path}.{key}", problems)
    elif isinstance(expected, list) and isinstance(found, list) and len(expected) == len(found):
        for index, (a, b) in enumerate(zip(found, expected, strict=True)):
            name = b.get("name") if isinstance(b, dict) else None
            _diff(a, b, f"{path}[{name or index}]", problems)
    elif found != expected:
        problems.append(f"{path}: {_short(found)} instead of {_short(expected)}")


def _short(value: Any) -> str:
    text = "missing" if value is None else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _require_node(replicated: Mapping[str, Any]) -> None:
    if replicated["name"] != NODE:
        raise ValueError(f"a TrainJob's trainer runs in replicated job {NODE!r}, not {replicated['name']!r}")


def _node_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in pod_spec["containers"] if c["name"] == NODE]
    if len(found) != 1:
        raise ValueError(f"a TrainJob's trainer runs in container {NODE!r}")
    return found[0]


def trainjob_state(trainjob: Mapping[str, Any] | None) -> AppState | None:
    """Its Complete or Failed condition as a torchx state (trainjob_types.go), else None (not finished)."""
    for condition in ((trainjob or {}).get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") == "Complete":
            return AppState.SUCCEEDED
        if condition.get("status") == "True" and condition.get("type") == "Failed":
            return AppState.FAILED
    return None


def failed_reason(trainjob: Mapping[str, Any] | None) -> str | None:
    """`<reason>: <message>` of its Failed=True condition, else None."""
    for condition in ((trainjob or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
    return None


def read_runtime(api_client: Any, name: str) -> dict[str, Any] | None:
    """ClusterTrainingRuntime `name`, or None when there is none (404)."""
    from kubernetes import client

    return cluster_object(client.CustomObjectsApi(api_client), GROUP, VERSION, CLUSTER_RUNTIMES, name)


def check_runtime(api_client: Any, *, name: str, expected: Mapping[str, Any], namespace: str) -> None:
    """Raises BatchpilotError (field `cluster.training_runtime`) when ClusterTrainingRuntime `name` is missing
    or differs from `expected` where a TrainJob cannot set it (`runtime_problems`)."""
    from kubernetes.client.rest import ApiException

    render = (
        "render it with `batchpilot launch --plan PLAN --stage S --dry-run` (its first document) and apply it"
    )
    try:
        found = read_runtime(api_client, name)
    except ApiException as error:
        if error.status == 404:  # no such resource: Trainer's CRDs are not installed
            raise BatchpilotError(
                "cluster.launcher",
                "trainjob needs Kubeflow Trainer v2, but the cluster serves no "
                f"{CLUSTER_RUNTIMES}.{GROUP}/{VERSION}",
                "install Kubeflow Trainer (v2.2 or later), or set cluster.launcher: jobset",
            ) from None
        raise
    if found is None:
        raise BatchpilotError(
            "cluster.training_runtime",
            f"ClusterTrainingRuntime {name!r} does not exist",
            f"install the chart with trainingRuntime.create=true, or {render}",
        )
    problems = runtime_problems(found, expected)
    if problems:
        raise BatchpilotError(
            "cluster.training_runtime",
            f"ClusterTrainingRuntime {name!r} cannot run this launch ({len(problems)} difference(s); first: "
            f"{problems[0]})",
            f"{render}, or name a runtime made that way",
        )
    logger.debug("ClusterTrainingRuntime %s matches the launch (namespace %s)", name, namespace)


def wait_built(api_client: Any, *, namespace: str, name: str, timeout_s: float, poll_s: float = 2.0) -> None:
    """Waits until Trainer's controller has built TrainJob `name`'s JobSet; raises BatchpilotError when the
    TrainJob fails first (its Failed condition) or `timeout_s` passes (Trainer's controller not running)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from batchpilot.cluster.jobset import GROUP as JOBSET_GROUP
    from batchpilot.cluster.jobset import PLURAL as JOBSETS
    from batchpilot.cluster.jobset import VERSION as JOBSET_VERSION

    objects = client.CustomObjectsApi(api_client)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            objects.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name, _request_timeout=30
            )
            return
        except ApiException as error:
            if error.status != 404:
                raise
        trainjob = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, TRAINJOBS, name)
        if (reason := failed_reason(trainjob)) is not None:
            raise BatchpilotError(f"TrainJob {name}", f"failed before its JobSet was built ({reason})",
                                  f"see `kubectl -n {namespace} describe trainjob {name}`")  # fmt: skip
        if time.monotonic() >= deadline:
            raise BatchpilotError(
                f"TrainJob {name}",
                f"has no JobSet after {timeout_s:.0f}s: Kubeflow Trainer's controller did not build it",
                f"check that the trainer controller runs (`kubectl -n {namespace} describe trainjob {name}`, "
                "events TrainJobResourcesCreationFailed)",
            )
        time.sleep(poll_s)


# -- the torchx scheduler ---------------------------------------------------------------------------------
BUILD_TIMEOUT_S = 120.0
"""How long Trainer's controller may take to build a new TrainJob's JobSet (it does so on its first
reconcile, within seconds) before the launch says the controller is not running."""


@dataclass
class TrainJobOpts(JobSetOpts):
    """Run options of the `trainjob` scheduler: the `jobset` scheduler's, and the runtime."""

    runtime: str = DEFAULT_RUNTIME
    """ClusterTrainingRuntime the TrainJob runs on (`cluster.training_runtime`)."""


@dataclass
class TrainJobRequest:
    """The TrainJob to create and the ClusterTrainingRuntime it needs."""

    resource: dict[str, Any]
    runtime: dict[str, Any]

    def __str__(self) -> str:
        return yaml.safe_dump_all([self.runtime, self.resource], sort_keys=False)


class TrainJobScheduler(JobSetScheduler):
    """torchx scheduler `trainjob`: creates and deletes TrainJobs; describes, lists and streams the logs of
    the JobSets Trainer builds for them (named as the TrainJob, so the handle's name is both)."""

    owned_kind = TRAINJOB_KIND  # a cancel deletes the TrainJob; its JobSet, Jobs and pods go with it

    def __init__(self, session_name: str, client: Any = None, pod_wait_s: float = 600.0) -> None:
        super().__init__(session_name, client=client, pod_wait_s=pod_wait_s)
        self.backend = "trainjob"

    def _run_opts(self) -> runopts:
        return TrainJobOpts.as_runopts()

    @classmethod
    def _opts_type(cls) -> type[TrainJobOpts]:
        return TrainJobOpts  # torchx reads it from `Scheduler[...]`, which names the jobset scheduler's

    def _submit_dryrun(self, app: AppDef, cfg: TrainJobOpts) -> AppDryRunInfo[TrainJobRequest, TrainJobOpts]:
        jobset = app_to_jobset(app, cfg)
        request = TrainJobRequest(
            resource=trainjob_object(jobset, runtime=cfg.runtime),
            runtime=runtime_object(jobset, name=cfg.runtime),
        )
        return AppDryRunInfo(request, str)

    def schedule(self, dryrun_info: AppDryRunInfo[TrainJobRequest, TrainJobOpts]) -> str:
        request = dryrun_info.request
        namespace, name = request.resource["metadata"]["namespace"], request.resource["metadata"]["name"]
        check_runtime(self._api_client(), name=request.runtime["metadata"]["name"], expected=request.runtime,
                      namespace=namespace)  # fmt: skip
        self._objects().create_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace=namespace, plural=TRAINJOBS, body=request.resource
        )
        wait_built(self._api_client(), namespace=namespace, name=name, timeout_s=BUILD_TIMEOUT_S)
        return f"{namespace}:{name}"

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        from kubernetes.client.rest import ApiException

        namespace, name = app_id.split(":")
        try:
            trainjob = self._objects().get_namespaced_custom_object(
                GROUP, VERSION, namespace, TRAINJOBS, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        # The TrainJob's own end (e.g. DeadlineExceeded, which deletes its JobSet) before its JobSet's state.
        if trainjob_state(trainjob) is AppState.FAILED:
            return DescribeAppResponse(
                app_id=app_id, state=AppState.FAILED, msg=failed_reason(trainjob) or ""
            )
        found = super().describe(app_id)
        if found is None:  # not built yet, or being rebuilt
            return DescribeAppResponse(
                app_id=app_id, state=AppState.PENDING, msg="its JobSet is not built yet"
            )
        return found


def create_scheduler(session_name: str, client: Any = None, **kwargs: Any) -> TrainJobScheduler:
    """The torchx scheduler factory of `trainjob`."""
    return TrainJobScheduler(session_name=session_name, client=client)
