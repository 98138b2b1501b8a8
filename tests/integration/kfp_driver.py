"""The pod the KFP v2 backend would create for one task of a compiled pipeline, for the cluster simulator.

Rules (kubeflow/pipelines backend/src/v2/driver/driver.go, initPodSpecPatch and extendPodSpecPatch):
- one container named `main`; its command is the KFP launcher (`/kfp-launcher/launch ... --`) and its
  args are the component's command followed by its args;
- `resources.resourceMemoryLimit` / `resourceMemoryRequest` / `resourceCpuLimit` / `resourceCpuRequest`
  are quantities used as written; the older float fields `memoryLimit` / `memoryRequest` become
  `%vG` and `cpuLimit` / `cpuRequest` `%v`;
- `resources.accelerator`: the type is `resourceType`, else `type`; the count is `resourceCount`,
  else `count`; when both are set the container gets `limits[<type>] = <count>`: the accelerator
  type is used verbatim as the resource name (so it must be one, e.g. `nvidia.com/gpu`);
- the kubernetes platform config of the task's executor (platforms.kubernetes.deploymentSpec.executors):
  `nodeSelector.labels` -> `spec.nodeSelector`; `tolerations` -> `spec.tolerations` (key, operator,
  value, effect, tolerationSeconds); `activeDeadlineSeconds` > 0 -> `spec.activeDeadlineSeconds`;
  `fieldPathAsEnv` -> one env var per entry on the `main` container, `valueFrom.fieldRef.fieldPath`
  (driver/k8s.go: "Get Kubernetes FieldPath Env information", appended to `podSpec.Containers[0].Env`);
- `nodeAffinity` (driver/k8s.go, extendPodSpecPatch, from KFP 2.14.0, #12028): each term's matchExpressions
  and matchFields become one NodeSelectorTerm, copied as written; a term with a `weight` goes to
  `preferredDuringSchedulingIgnoredDuringExecution` as {weight, preference}, one without to
  `requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms` (terms ORed by the scheduler);
  `spec.affinity.nodeAffinity` is set to the result (assigned, not merged);
- `podMetadata.annotations` / `.labels` are not the driver's: the Argo compiler puts them on the executor
  template's metadata, which Argo copies onto the pod, without overwriting what the template already has
  ("the existing podMetadata should have higher privilege than the user definition"; compiler/
  argocompiler/container.go, extendPodMetadata / extendMetadataMap).

Runtime placeholders (`{{$}}`, pipeline parameters) are left as they are: the simulator checks the
pod's shape and placement, it does not run a KFP executor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

LAUNCHER = "/kfp-launcher/launch"


def load_compiled(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pipeline spec, kubernetes platform spec) of a compiled pipeline YAML (platform may be empty)."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pipeline = documents[0]
    platform: dict[str, Any] = next(
        (d["platforms"]["kubernetes"] for d in documents[1:] if "platforms" in d), {}
    )
    return pipeline, platform


def executor_label(pipeline: dict[str, Any], task_path: str) -> str:
    """The executor of a task given as a path through the DAGs, e.g. `explore` or `stage-0/train-stage`."""
    components = pipeline["components"]
    dag = pipeline["root"]["dag"]
    *groups, task = task_path.split("/")
    found = _find_task(components, dag, groups, task)
    if found is None:
        raise KeyError(f"no task {task_path!r} in the pipeline")
    return str(components[found["componentRef"]["name"]]["executorLabel"])


def _find_task(
    components: dict[str, Any], dag: dict[str, Any], groups: list[str], task: str
) -> dict[str, Any] | None:
    tasks = dag.get("tasks", {})
    if not groups and task in tasks:
        return dict(tasks[task])
    for name, candidate in tasks.items():
        inner = components[candidate["componentRef"]["name"]].get("dag")
        if inner is None:
            continue
        rest = groups[1:] if groups and groups[0] == name else groups
        if found := _find_task(components, inner, rest, task):
            return found
    return None


def _resources(resources: dict[str, Any]) -> dict[str, dict[str, str]]:
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for target, key, typed, unit in (
        (limits, "memory", "MemoryLimit", "G"),
        (requests, "memory", "MemoryRequest", "G"),
        (limits, "cpu", "CpuLimit", ""),
        (requests, "cpu", "CpuRequest", ""),
    ):
        # getPodResource: the string field is a quantity as written; the older float is `%v<unit>`.
        if text := resources.get(f"resource{typed}"):
            target[key] = str(text)
        elif number := resources.get(typed[0].lower() + typed[1:]):
            target[key] = f"{_number(number)}{unit}"
    accelerator = resources.get("accelerator") or {}
    kind = accelerator.get("resourceType") or accelerator.get("type") or ""
    count = accelerator.get("resourceCount") or (
        str(accelerator["count"]) if accelerator.get("count") else ""
    )
    if kind and count:
        limits[kind] = str(count)
    return {k: v for k, v in (("limits", limits), ("requests", requests)) if v}


def _number(value: Any) -> str:
    number = float(value)
    return str(int(number)) if number.is_integer() else str(number)


def task_pod(
    pipeline: dict[str, Any], platform: dict[str, Any], task_path: str, *, run_id: str = "run-1"
) -> dict[str, Any]:
    """The pod the driver would create for `task_path` (see the module docstring for the rules)."""
    return executor_pod(
        pipeline, platform, executor_label(pipeline, task_path), task_path=task_path, run_id=run_id
    )


def executor_pod(
    pipeline: dict[str, Any], platform: dict[str, Any], label: str, *, task_path: str, run_id: str = "run-1"
) -> dict[str, Any]:
    """The pod the driver would create for a task run by executor `label`."""
    container = pipeline["deploymentSpec"]["executors"][label]["container"]
    name = pipeline["pipelineInfo"]["name"]
    main: dict[str, Any] = {
        "name": "main",
        "image": container["image"],
        "command": [LAUNCHER, "--pipeline_name", name, "--run_id", run_id, "--"],
        "args": list(container.get("command", [])) + list(container.get("args", [])),
        "env": [{"name": e["name"], "value": e["value"]} for e in container.get("env", [])],
    }
    if resources := _resources(container.get("resources") or {}):
        main["resources"] = resources
    spec: dict[str, Any] = {"containers": [main], "restartPolicy": "Never"}
    config = (platform.get("deploymentSpec") or {}).get("executors", {}).get(label, {})
    if (selector := config.get("nodeSelector")) and selector.get("labels"):
        spec["nodeSelector"] = dict(selector["labels"])
    if tolerations := config.get("tolerations"):
        keys = ("key", "operator", "value", "effect", "tolerationSeconds")
        spec["tolerations"] = [{k: t[k] for k in keys if t.get(k) not in (None, "")} for t in tolerations]
    if int(config.get("activeDeadlineSeconds") or 0) > 0:
        spec["activeDeadlineSeconds"] = int(config["activeDeadlineSeconds"])
    if terms := config.get("nodeAffinity"):
        spec["affinity"] = {"nodeAffinity": _node_affinity(terms)}
    for entry in config.get("fieldPathAsEnv") or []:
        main["env"].append(
            {"name": entry["name"], "valueFrom": {"fieldRef": {"fieldPath": entry["fieldPath"]}}}
        )
    pod_name = f"{name}-{task_path.replace('/', '-')}"[:58]
    metadata: dict[str, Any] = {
        "generateName": f"{pod_name}-",
        "labels": {"pipelines.kubeflow.org/v2_component": "true"},
    }
    _extend_metadata(metadata, config.get("podMetadata") or {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _node_affinity(terms: list[dict[str, Any]]) -> dict[str, Any]:
    required: list[dict[str, Any]] = []
    preferred: list[dict[str, Any]] = []
    for term in terms:
        selector = {k: term[k] for k in ("matchExpressions", "matchFields") if term.get(k)}
        if not selector:
            continue  # an empty term is skipped (with a warning)
        if term.get("weight") is not None:
            preferred.append({"weight": int(term["weight"]), "preference": selector})
        else:
            required.append(selector)
    affinity: dict[str, Any] = {}
    if required:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": required}
    if preferred:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return affinity


def _extend_metadata(metadata: dict[str, Any], pod_metadata: dict[str, Any]) -> None:
    """The task's podMetadata added to the pod's; a key the pod already has keeps its value
    (extendMetadataMap in compiler/argocompiler/container.go)."""
    for field in ("annotations", "labels"):
        extra = pod_metadata.get(field) or {}
        if extra:
            metadata[field] = {**extra, **(metadata.get(field) or {})}


# --- retries: KFP's retry policy as Argo applies it -----------------------------------------------


def retry_policy(pipeline: dict[str, Any], task_path: str) -> dict[str, Any]:
    """The compiled `retryPolicy` of a task given as a path through the DAGs (empty: no retries)."""
    components = pipeline["components"]
    *groups, task = task_path.split("/")
    found = _find_task(components, pipeline["root"]["dag"], groups, task)
    if found is None:
        raise KeyError(f"no task {task_path!r} in the pipeline")
    return dict(found.get("retryPolicy") or {})


def _seconds(duration: str) -> float:
    """A protobuf Duration as KFP's compiled YAML writes it (`3600s`)."""
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def argo_retry(
    policy: dict[str, Any],
    *,
    attempts: list[tuple[float, float]],
    now: float,
    phase: str = "Failed",
    template_defaults: dict[str, Any] | None = None,
) -> tuple[float | None, str]:
    """Whether Argo retries a failed task: (when the next attempt starts, its execution deadline) or
    (None, why not), given each attempt's (started, finished) times, the controller's clock `now`, the
    last attempt's node phase (`phase`: "Failed" or "Error", see `attempt_phase`) and the cluster's
    `workflowDefaults.spec.templateDefaults` (`template_defaults`).

    KFP compiles the retry policy into the executor template's `retryStrategy` (kubeflow/pipelines
    backend/src/v2/compiler/argocompiler/container.go, getTaskRetryStrategyFromInput: limit =
    maxRetryCount, backoff.duration, backoff.factor, backoff.maxDuration = backoffMaxDuration, and no
    retryPolicy). Argo merges the templateDefaults into the template by strategic merge patch, the
    template's fields winning (workflow/controller/operator.go, mergedTemplateDefaultsInto), so the
    policy is the defaults' `retryStrategy.retryPolicy`, else OnFailure (or Always with an expression;
    workflow_types.go RetryPolicyActual). `processNodeRetries` (operator.go), in its order:
    - maxDuration is counted from the FIRST attempt's StartedAt: `now` after it -> "Max duration limit
      exceeded";
    - the wait is duration x factor^(attempts - 1) after the last attempt's FinishedAt; a wait that ends
      after the maxDuration deadline -> "Backoff would exceed max duration limit";
    - the policy: Always retries a Failed and an Error attempt, OnFailure only Failed, OnError only Error,
      OnTransientError only a transient error (none here); otherwise the node takes the attempt's phase;
    - more child attempts than `limit` -> "No more retries left";
    - otherwise the retry starts after the wait, with the maxDuration deadline as its executionDeadline.
    """
    strategy = (template_defaults or {}).get("retryStrategy") or {}
    retry_policy = strategy.get("retryPolicy") or ("Always" if strategy.get("expression") else "OnFailure")
    deadline = attempts[0][0] + _seconds(policy["backoffMaxDuration"])
    if now > deadline:
        return None, "Max duration limit exceeded"
    wait_s = _seconds(policy["backoffDuration"]) * float(policy.get("backoffFactor") or 2) ** (
        len(attempts) - 1
    )
    starts = attempts[-1][1] + wait_s
    if starts > deadline:
        return None, "Backoff would exceed max duration limit"
    retried = {"Always": ("Failed", "Error"), "OnFailure": ("Failed",), "OnError": ("Error",)}.get(
        retry_policy, ()
    )
    if phase not in retried:
        return None, f"retryPolicy {retry_policy} does not retry an attempt that ended {phase}"
    limit = int(policy.get("maxRetryCount") or 0)
    if len(attempts) > limit:
        return None, "No more retries left"
    return starts, f"retry at {starts:.0f}, execution deadline {deadline:.0f}"


def attempt_phase(*, exit_code: int, controller_saw_it_end: bool) -> str:
    """The phase Argo gives a task attempt whose pod ended with `exit_code`: a pod the controller saw fail
    with the main container's non-zero exit is Failed (operator.go assessNodeStatus, inferFailedReason);
    a pod deleted before the controller saw it end is Error, "pod deleted" (operator.go podReconciliation).
    An evicted task pod is deleted as soon as its containers stop, so which one Argo sees is a race."""
    if not controller_saw_it_end:
        return "Error"
    return "Succeeded" if exit_code == 0 else "Failed"


def nested_retry_policy(
    pipeline: dict[str, Any], task_path: str, *, kfp_version: tuple[int, int, int]
) -> dict[str, Any]:
    """The retry policy KFP's Argo compiler gives a task: before 2.14.0 only a task of the root DAG had
    one (getTaskRetryPolicySpec looked in `root.dag.tasks` only); from 2.14.0 (#11908, "implement
    retryStrategy for nested pipelines") a task in a sub-pipeline has its own."""
    if "/" in task_path and kfp_version < (2, 14, 0):
        return {}
    return retry_policy(pipeline, task_path)
