"""A torchx scheduler that runs an AppDef as a JobSet (jobset.x-k8s.io/v1alpha2), the GKE standard.

Each role becomes one replicated Job of `num_replicas` indexed pods (one pod per node); the JobSet's
headless service gives pod 0 a stable DNS name that torchrun's c10d rendezvous uses. With a Kueue
queue the JobSet carries the `kueue.x-k8s.io/queue-name` label and Kueue admits it as one unit.

Registered as the torchx scheduler `jobset` through the `torchx.schedulers` entry point
(`create_scheduler`); batchpilot's launcher also passes the factory to its Runner directly.

Lifecycle (see `failure_policy`, `pod_failure_policy`): a pod stopped by a disruption or preempted
after checkpointing (exit 75) restarts the whole JobSet, up to `max_restarts` times; any other
non-zero exit fails it at once. A finished JobSet is deleted `JOBSET_TTL_S` after it ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml
from torchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    StructuredOpts,
    filter_regex,
    split_lines,
)
from torchx.specs.api import AppDef, AppDryRunInfo, AppState, CfgVal, Role, macros, runopts
from torchx.specs.overlays import apply_overlay, get_overlay
from torchx.util.strings import normalize_str

from batchpilot.cluster.kueue import PRIORITY_LABEL, QUEUE_LABEL
from batchpilot.cluster.placement import harden_containers
from batchpilot.exitcodes import EXIT_PREEMPTED
from batchpilot.planning.names import jobset_problems

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL = QUEUE_LABEL, PRIORITY_LABEL
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RANK0_ENV = "TORCHX_RANK0_HOST"
DELETE_PROPAGATION = "Foreground"
"""Deletion waits for the Jobs and pods: the JobSet stays visible (with a deletionTimestamp) until every
trainer has had its grace period to checkpoint, so whoever waits for it to vanish (a replacing launch,
the scale-down) knows the GPUs are free and no trainer still writes (Kubernetes "Garbage collection":
foreground cascading deletion removes the dependents first, then the owner)."""

JOBSET_TTL_S = 24 * 3600
"""JobSet spec.ttlSecondsAfterFinished: a finished (Completed or Failed) JobSet and its pods' logs stay a
day for `kubectl logs`/`describe` of a failed stage, then the controller deletes it (jobset_types.go:
"TTLSecondsAfterFinished after the JobSet finishes, it is eligible to be automatically deleted"). A
finished JobSet holds no GPU; a retried stage replaces it sooner anyway."""

DEFAULT_MAX_RESTARTS = 10
"""JobSet failurePolicy.maxRestarts: restarts after disruptions and preemptions, each resuming from the
latest checkpoint. GPU VMs are not live-migrated (GKE "Manage GKE node disruption for GPUs and TPUs")
and Spot VMs can be reclaimed at any time, so a multi-day final stage sees several; 10 rides out days of
ordinary maintenance and preemption, while a pool that cannot keep its nodes stops after 10 restarts
instead of looping. Real errors never use this budget: they fail the JobSet at once."""


@dataclass
class JobSetOpts(StructuredOpts):
    """Run options of the `jobset` scheduler."""

    namespace: str = "default"
    """Kubernetes namespace of the JobSet."""

    queue: str | None = None
    """Kueue LocalQueue to submit to (adds the kueue.x-k8s.io/queue-name label); none: no Kueue."""

    workload_priority_class: str | None = None
    """Kueue WorkloadPriorityClass of the JobSet (the kueue.x-k8s.io/priority-class label), with `queue`."""

    service_account: str | None = None
    """Service account of the pods (a role's pod overlay may also set it)."""

    priority_class: str | None = None
    """PriorityClass of the pods."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    """Times the whole JobSet is recreated after a disruption or preemption (failurePolicy.maxRestarts)."""

    labels: dict[str, str] | None = None
    """Labels of the JobSet and its pods (batchpilot's launcher: the run, the stage and the plan)."""


@dataclass
class JobSetRequest:
    """The JobSet object to create."""

    resource: dict[str, Any]

    def __str__(self) -> str:
        return yaml.safe_dump(self.resource, sort_keys=False)


def pod_failure_policy() -> dict[str, Any]:
    """The Job's podFailurePolicy: tells a disruption or a preemption (restart) from a real error (fail).

    Kubernetes Job "Pod failure policy" (kubernetes.io/docs/concepts/workloads/controllers/job): rules are
    checked in order and the first match applies; `Count` counts the failure against backoffLimit (0
    here, so the Job fails with reason BackoffLimitExceeded), `FailJob` fails the Job at once with reason
    PodFailurePolicy; exit code 0 is never checked; it requires restartPolicy Never (torchx sets it).
    """
    return {
        "rules": [
            # A pod evicted, preempted or stopped by a node shutdown carries the DisruptionTarget
            # condition ("Pod disruption conditions", kubernetes.io/docs/concepts/workloads/pods/disruptions),
            # whatever its exit code (SIGKILL after the grace period included), so this rule comes first.
            # Count, not Ignore: a lone replacement pod cannot rejoin a running torchrun rendezvous, so the
            # Job fails now and the JobSet restarts every node together, before the other nodes' collective
            # errors (exit 1) could be read as a real error by the last rule.
            {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Preempted after checkpointing (the trainers agreed on SIGTERM; see exitcodes.EXIT_PREEMPTED).
            {"action": "Count", "onExitCodes": {"operator": "In", "values": [EXIT_PREEMPTED]}},
            # Anything else is a real error: fail fast, no restart burns GPU hours on a bug.
            {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [EXIT_PREEMPTED]}},
        ]
    }


def failure_policy(*, max_restarts: int) -> dict[str, Any]:
    """The JobSet's failurePolicy: fail on the Job's real errors, restart after disruptions (bounded).

    JobSet api/jobset/v1alpha2/jobset_types.go (FailurePolicyRule): rules are evaluated in order, the first
    match on the failed Job's reason (`onJobFailureReasons`) applies, and with no match the action is
    RestartJobSet; RestartJobSet recreates all Jobs while restarts < maxRestarts, otherwise fails the JobSet.
    """
    return {
        "maxRestarts": max_restarts,
        "rules": [
            {
                "name": "FailOnTrainerError",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
            },
            {
                "name": "RestartAfterDisruption",
                "action": "RestartJobSet",
                "onJobFailureReasons": ["BackoffLimitExceeded"],
            },
        ],
    }


def _replicated_job(
    *, app_name: str, role: Role, role_index: int, rank0_host: str, opts: JobSetOpts
) -> dict[str, Any]:
    """One role as a replicated Job: `num_replicas` indexed pods, each a torchrun node."""
    from torchx.schedulers.kubernetes_scheduler import pod_labels, role_to_pod, sanitize_for_serialization

    values = macros.Values(
        img_root="",
        app_id=app_name,
        # Pods of one Job share a template; the shell entrypoint expands the Job's completion index.
        replica_id="${JOB_COMPLETION_INDEX}",
        rank0_env=RANK0_ENV,
    )
    replica_role = values.apply(role)
    replica_role.env[RANK0_ENV] = rank0_host
    pod = role_to_pod(normalize_str(role.name), replica_role, opts.service_account)
    rendered: dict[str, Any] = sanitize_for_serialization(pod)
    if overlay := get_overlay(role, "kubernetes", "V1Pod"):
        apply_overlay(rendered, overlay)
    labels = pod_labels(
        app=AppDef(name=app_name), role_idx=role_index, role=role, replica_id=0, app_id=app_name
    )
    labels.pop("torchx.pytorch.org/replica-id")  # one template for every replica
    labels.update(opts.labels or {})
    rendered.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    spec = rendered["spec"]
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    harden_containers(spec)
    return {
        "name": normalize_str(role.name),
        "replicas": 1,
        "template": {
            "spec": {
                "parallelism": role.num_replicas,
                "completions": role.num_replicas,
                "completionMode": "Indexed",
                # A failed node fails the Job at once; restarts are the JobSet's (all nodes together).
                "backoffLimit": 0,
                "podFailurePolicy": pod_failure_policy(),
                "template": {"metadata": rendered["metadata"], "spec": spec},
            }
        },
    }


def app_to_jobset(app: AppDef, opts: JobSetOpts, *, name: str | None = None) -> dict[str, Any]:
    """The JobSet object running `app` (pure: no API call), named `name` or else the app's name, as is.

    No random suffix (torchx's `make_unique`): batchpilot names each launch's JobSet deterministically
    (`names.jobset_name`) so that a retried launch finds it, and deletes a stale one before creating it;
    a second JobSet of one name is refused by the API server (409), never silently doubled.

    Raises:
        ValueError: a name the API server or the JobSet webhook would refuse (every one, one line each).
    """
    jobset_name = name or app.name
    first = normalize_str(app.roles[0].name)
    refused = jobset_problems(
        name=jobset_name,
        subdomain=jobset_name,
        replicated_jobs=[(normalize_str(r.name), 1, r.num_replicas) for r in app.roles],
    )
    if refused:
        raise ValueError(
            f"JobSet {jobset_name!r} would be refused: {'; '.join(refused)}; name it with "
            "batchpilot.planning.names.jobset_name"
        )
    rank0_host = f"{jobset_name}-{first}-0-0.{jobset_name}"
    metadata: dict[str, Any] = {
        "name": jobset_name,
        "namespace": opts.namespace,
        "labels": dict(opts.labels or {}),
    }
    if opts.queue:
        metadata["labels"][KUEUE_QUEUE_LABEL] = opts.queue
        if opts.workload_priority_class:
            metadata["labels"][KUEUE_PRIORITY_LABEL] = opts.workload_priority_class
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": jobset_name},
            "failurePolicy": failure_policy(max_restarts=opts.max_restarts),
            "successPolicy": {"operator": "All"},
            "ttlSecondsAfterFinished": JOBSET_TTL_S,
            # Kueue starts a queued JobSet by unsuspending it; without Kueue it starts at once.
            "suspend": bool(opts.queue),
            "replicatedJobs": [
                _replicated_job(
                    app_name=jobset_name, role=role, role_index=i, rank0_host=rank0_host, opts=opts
                )
                for i, role in enumerate(app.roles)
            ],
        },
    }


def jobset_state(status: Mapping[str, Any] | None) -> AppState:
    """The torchx state of a JobSet status (terminal conditions first, then active jobs)."""
    if not status:
        return AppState.PENDING
    terminal = status.get("terminalState")
    conditions = {c.get("type"): c.get("status") == "True" for c in status.get("conditions", [])}
    if terminal == "Completed" or conditions.get("Completed"):
        return AppState.SUCCEEDED
    if terminal == "Failed" or conditions.get("Failed"):
        return AppState.FAILED
    if conditions.get("Suspended"):
        return AppState.PENDING
    jobs = status.get("replicatedJobsStatus", [])
    if any(job.get("active", 0) or job.get("ready", 0) for job in jobs):
        return AppState.RUNNING
    return AppState.PENDING


class JobSetScheduler(Scheduler[JobSetOpts]):
    """torchx scheduler `jobset`: submit, describe, list, cancel and stream the logs of JobSets."""

    def __init__(self, session_name: str, client: Any = None, pod_wait_s: float = 600.0) -> None:
        super().__init__("jobset", session_name)
        self._client = client
        self.pod_wait_s = pod_wait_s

    def _api_client(self) -> Any:
        if self._client is None:
            from batchpilot.cluster.readiness import kube_api_client

            self._client = kube_api_client()
        return self._client

    def _objects(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api_client())

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._api_client())

    def _run_opts(self) -> runopts:
        return JobSetOpts.as_runopts()

    def _submit_dryrun(self, app: AppDef, cfg: JobSetOpts) -> AppDryRunInfo[JobSetRequest, JobSetOpts]:
        return AppDryRunInfo(JobSetRequest(app_to_jobset(app, cfg)), str)

    def _validate(self, app: AppDef, scheduler: str, cfg: JobSetOpts) -> None:
        pass  # the API server validates the JobSet against its CRD schema on create

    def schedule(self, dryrun_info: AppDryRunInfo[JobSetRequest, JobSetOpts]) -> str:
        resource = dryrun_info.request.resource
        namespace = resource["metadata"]["namespace"]
        created = self._objects().create_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, body=resource
        )
        return f"{namespace}:{created['metadata']['name']}"

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        from kubernetes.client.rest import ApiException

        namespace, name = app_id.split(":")
        try:
            jobset = self._objects().get_namespaced_custom_object(
                group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, name=name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        status = jobset.get("status")
        message = "; ".join(
            str(c.get("message", "")) for c in (status or {}).get("conditions", []) if c.get("message")
        )
        return DescribeAppResponse(app_id=app_id, state=jobset_state(status), msg=message)

    def list(self, cfg: Mapping[str, CfgVal] | None = None) -> list[ListAppResponse]:
        namespace = str((cfg or {}).get("namespace") or "default")
        found = self._objects().list_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL
        )
        return [
            ListAppResponse(
                app_id=f"{namespace}:{item['metadata']['name']}", state=jobset_state(item.get("status"))
            )
            for item in found.get("items", [])
        ]

    owned_kind: tuple[str, str, str] = (GROUP, VERSION, PLURAL)
    """(group, version, plural) of what the scheduler creates and a cancel deletes (a TrainJob's scheduler:
    the TrainJob, whose JobSet Trainer would build again)."""

    def _cancel_existing(self, app_id: str) -> None:
        namespace, name = app_id.split(":")
        group, version, plural = self.owned_kind
        # The Jobs and pods go too; pods get their grace period (SIGTERM: the trainers checkpoint).
        self._objects().delete_namespaced_custom_object(
            group=group, version=version, namespace=namespace, plural=plural, name=name,
            propagation_policy=DELETE_PROPAGATION,
        )  # fmt: skip

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> Iterable[str]:
        """Lines of node `k` of `role_name`; with `should_tail`, waits for the pod and follows it."""
        if until is not None:
            raise ValueError("the Kubernetes log API cannot stop at a time (until)")
        if streams not in (None, Stream.COMBINED):
            raise ValueError("the jobset scheduler only has the COMBINED log stream")
        namespace, name = app_id.split(":")
        pod = self._find_pod(namespace, name, normalize_str(role_name), k, wait=should_tail)
        if pod is None:
            return iter(())
        args: dict[str, Any] = {"name": pod, "namespace": namespace}
        if since is not None:
            args["since_seconds"] = max(int((datetime.now() - since).total_seconds()), 1)
        lines = (
            self._follow(args) if should_tail else split_lines(self._core().read_namespaced_pod_log(**args))
        )
        return filter_regex(regex, lines) if regex else lines

    def _follow(self, args: dict[str, Any]) -> Iterator[str]:
        from kubernetes import watch

        for line in watch.Watch().stream(self._core().read_namespaced_pod_log, **args):
            yield f"{line}\n"

    def _find_pod(self, namespace: str, name: str, role: str, k: int, *, wait: bool) -> str | None:
        """The name of node k's pod once it has started (a Pending pod has no log to read yet)."""
        selector = f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={role},{COMPLETION_INDEX_LABEL}={k}"
        deadline = time.monotonic() + (self.pod_wait_s if wait else 0.0)
        while True:
            pods = self._core().list_namespaced_pod(namespace=namespace, label_selector=selector).items
            started = [p for p in pods if p.status and p.status.phase not in (None, "Pending")]
            if started:  # the newest: after a JobSet restart, the node's replacement pod
                newest = max(started, key=lambda p: (p.metadata.creation_timestamp is not None,
                                                     p.metadata.creation_timestamp or 0))  # fmt: skip
                return str(newest.metadata.name)
            if time.monotonic() >= deadline:
                return None
            time.sleep(2.0)


def label_selector(labels: Mapping[str, str]) -> str:
    """A Kubernetes equality label selector: `k1=v1,k2=v2`."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


JOBSET_KIND = (GROUP, VERSION, PLURAL)
"""(group, version, plural) of the objects the `jobset` launcher creates; `list_jobsets` and `delete_jobsets`
take another's (a TrainJob's, `trainjob.TRAINJOB_KIND`) for the launcher that creates those."""


def list_jobsets(
    client: Any, *, namespace: str, labels: Mapping[str, str], kind: tuple[str, str, str] = JOBSET_KIND
) -> list[dict[str, Any]]:
    """The JobSets (or objects of `kind`) in `namespace` carrying every one of `labels`."""
    from kubernetes import client as kube

    group, version, plural = kind
    found = kube.CustomObjectsApi(client).list_namespaced_custom_object(
        group=group,
        version=version,
        namespace=namespace,
        plural=plural,
        label_selector=label_selector(labels),
    )
    return list(found.get("items", []))


def delete_jobsets(
    client: Any,
    *,
    namespace: str,
    names: Iterable[str],
    wait_s: float,
    poll_s: float = 2.0,
    kind: tuple[str, str, str] = JOBSET_KIND,
) -> list[str]:
    """Deletes the named JobSets (or objects of `kind`; DELETE_PROPAGATION) and waits up to `wait_s` until
    they are gone; returns the names still there (an already deleted one counts as gone)."""
    from kubernetes import client as kube
    from kubernetes.client.rest import ApiException

    objects = kube.CustomObjectsApi(client)
    group, version, plural = kind
    args = {"group": group, "version": version, "namespace": namespace, "plural": plural}
    pending = list(names)
    for name in pending:
        try:
            objects.delete_namespaced_custom_object(name=name, propagation_policy=DELETE_PROPAGATION, **args)
        except ApiException as error:
            if error.status != 404:
                raise
    deadline = time.monotonic() + wait_s
    while True:
        remaining = []
        for name in pending:
            try:
                objects.get_namespaced_custom_object(name=name, **args)
                remaining.append(name)
            except ApiException as error:
                if error.status != 404:
                    raise
        if not remaining or time.monotonic() >= deadline:
            return remaining
        pending = remaining
        time.sleep(poll_s)


def create_scheduler(session_name: str, client: Any = None, **kwargs: Any) -> JobSetScheduler:
    """The torchx scheduler factory (entry point `torchx.schedulers: jobset`)."""
    return JobSetScheduler(session_name=session_name, client=client)
