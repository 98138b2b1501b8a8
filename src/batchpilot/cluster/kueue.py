"""Kueue admission (`cluster.kueue_queue`): a launch's JobSet is created suspended in the team's LocalQueue,
and the launch waits until Kueue admits its Workload, saying what Kueue reports while it waits.

Facts read from Kueue v0.19.2 (kubernetes-sigs/kueue; docs/research/kueue_trainer.md has them with their files):
- the JobSet carries the label `kueue.x-k8s.io/queue-name` (a LocalQueue in its namespace) and optionally
  `kueue.x-k8s.io/priority-class` (a WorkloadPriorityClass), and is created suspended; Kueue unsuspends it
  when its Workload is admitted (pkg/controller/constants/constants.go, jobframework/defaults.go);
- Kueue creates one Workload per JobSet, labelled `kueue.x-k8s.io/job-uid: <the JobSet's uid>`
  (jobframework/utils.go `NewWorkload`); its API is `kueue.x-k8s.io/v1beta2` (the storage version since 0.16;
  v1beta1 is still served and deprecated);
- the Workload's conditions (apis/kueue/v1beta2/workload_types.go): QuotaReserved (False while it waits, its
  message the flavor assigner's reason, e.g. insufficient unused quota), Admitted (True once quota is reserved
  and every admission check is Ready), Evicted and Preempted (a higher-priority workload took the quota),
  Requeued, Finished; `status.admissionChecks[]` with `name`, `state` (Pending, Ready, Retry, Rejected) and
  `message`; a Workload whose `spec.active` is false is deactivated and will not be admitted again.

Flex-start through Kueue (`cluster.provisioning: flex-start` with `cluster.kueue_queue`; Kueue v0.19.2
pkg/controller/admissionchecks/provisioning/controller.go, apis/kueue/v1beta2 admissioncheck_types.go,
provisioningrequestconfig_types.go, clusterqueue_types.go): the ClusterQueue lists admission checks in
`spec.admissionChecksStrategy.admissionChecks[].name`; an AdmissionCheck whose `spec.controllerName` is
`kueue.x-k8s.io/provisioning-request` names a ProvisioningRequestConfig in `spec.parameters` (apiGroup
kueue.x-k8s.io, kind ProvisioningRequestConfig), whose `spec.provisioningClassName` is GKE's
`queued-provisioning.gke.io`. Once it has reserved quota Kueue creates the ProvisioningRequest, keeps the check
Pending until GKE provisions it (Ready: the Workload is admitted and the pods get the consume annotations),
retries a Failed one up to the config's `retryStrategy.backoffLimitCount` (the check Retry) and then rejects it
(Rejected, the Workload deactivated). batchpilot writes no request of its own then: the admission wait below
follows the check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchpilot.cluster.objects import cluster_object, conditions
from batchpilot.cluster.placement import GKE_ACCELERATOR_LABEL
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
PROVISIONING_CONFIG_KIND = "ProvisioningRequestConfig"
FLEX_START_CLASS = "queued-provisioning.gke.io"
"""GKE's flex-start class, as cluster/provisioning.py writes it (not imported: provisioning -> jobset -> kueue)."""
SHOWN = ("QuotaReserved", "Admitted", "Evicted", "Preempted", "Requeued")
"""The conditions a waiting launch logs, in this order."""


@dataclass(frozen=True)
class Admission:
    """Where a Workload stands: `admitted`, `refused` (it will not be admitted: a Rejected admission check,
    deactivated, finished), or neither (waiting); `state` says it in one line."""

    admitted: bool
    refused: bool
    state: str
    checks_waiting: bool = False
    """Quota is reserved, but an admission check (a ProvisioningRequest's, say) is not Ready yet."""


def admission(workload: dict[str, Any]) -> Admission:
    """The Workload's conditions and admission checks in one line, and whether it is admitted or refused."""
    found = conditions(workload)
    parts = []
    for kind in SHOWN:
        if kind in found:
            condition = found[kind]
            why = ": ".join(filter(None, (condition.get("reason"), condition.get("message"))))
            parts.append(f"{kind}={condition.get('status', '?')}" + (f" ({why})" if why else ""))
    checks = (workload.get("status") or {}).get("admissionChecks") or []
    for check in checks:
        message = check.get("message")
        parts.append(
            f"check {check.get('name')}: {check.get('state', '?')}" + (f" ({message})" if message else "")
        )
    rejected = [c.get("name") for c in checks if c.get("state") == "Rejected"]
    deactivated = (workload.get("spec") or {}).get("active") is False
    finished = found.get("Finished", {}).get("status") == "True"
    if deactivated:
        parts.append("deactivated (spec.active: false)")
    if finished:
        parts.append("Finished")
    reserved = found.get("QuotaReserved", {}).get("status") == "True"
    return Admission(
        admitted=found.get("Admitted", {}).get("status") == "True",
        refused=bool(rejected) or deactivated or finished,
        state="; ".join(parts) or "no condition yet (Kueue has not looked at it)",
        checks_waiting=reserved and any(c.get("state") != "Ready" for c in checks),
    )


class Workloads:
    """The Workloads of one namespace through the Kubernetes API."""

    def __init__(self, api_client: Any, *, namespace: str) -> None:
        from kubernetes import client

        self.objects = client.CustomObjectsApi(api_client)
        self.namespace = namespace

    def of_job(self, uid: str) -> dict[str, Any] | None:
        """The Workload Kueue made for the job whose uid is `uid` (None: none yet)."""
        from kubernetes.client.rest import ApiException

        try:
            found = self.objects.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "workloads", label_selector=f"{JOB_UID_LABEL}={uid}",
                _request_timeout=30,
            )  # fmt: skip
        except ApiException as error:
            if error.status == 404:
                raise BatchpilotError(
                    "cluster.kueue_queue",
                    f"the cluster serves no {GROUP}/{VERSION} Workloads (HTTP 404): Kueue is not installed, or "
                    "is older than v0.15",
                    "install Kueue v0.15 or later, or remove cluster.kueue_queue",
                ) from None
            if error.status == 403:
                raise BatchpilotError(
                    "cluster.kueue_queue",
                    f"the task's service account may not list workloads.{GROUP} in namespace {self.namespace} "
                    "(HTTP 403)",
                    "grant get and list on them to the KFP run's account (the chart's RBAC does)",
                ) from None
            raise
        items: list[dict[str, Any]] = found.get("items") or []
        return items[0] if items else None


def wait_admitted(
    workloads: Workloads,
    *,
    jobset: str,
    uid: str,
    queue: str,
    timeout_s: float,
    kind: str = "JobSet",
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Waits until Kueue admits the Workload of JobSet `jobset` (uid `uid`; a TrainJob with `kind`), logging its
    state each time it
    changes, and returns the last state logged; raises in one line when Kueue refuses it (at once) or has not
    admitted it within `timeout_s`."""
    deadline = clock() + timeout_s
    said = ""
    while True:
        workload = workloads.of_job(uid)
        if workload is None:
            state = (
                f"no Workload for it yet (Kueue makes one for a {kind} labelled {QUEUE_LABEL}: is its {kind} "
                "integration enabled?)"
            )
            found = Admission(admitted=False, refused=False, state=state)
        else:
            found = admission(workload)
        if found.state != said:
            logger.info("Kueue, %s %s in LocalQueue %s: %s", kind, jobset, queue, found.state)
            said = found.state
        if found.admitted:
            return said
        if found.refused:
            raise BatchpilotError(
                "cluster.kueue_queue",
                f"Kueue will not admit {kind} {jobset} in LocalQueue {queue}: {found.state}",
                "see the Workload's events (`kubectl describe workloads -n NAMESPACE`) and the ClusterQueue's "
                "admission checks",
            )
        if clock() >= deadline:
            fix = (
                "raise cluster.capacity_timeout_s (its quota is reserved; an admission check waits: for flex-start, "
                "GKE queues the check's ProvisioningRequest until every node is free), or plan fewer nodes "
                "(cluster.max_nodes)"
                if found.checks_waiting
                else "raise cluster.capacity_timeout_s (the queue's quota is held by other workloads), or ask for "
                "quota in the ClusterQueue behind the LocalQueue"
            )
            raise BatchpilotError(
                "cluster.capacity_timeout_s",
                f"Kueue did not admit {kind} {jobset} in LocalQueue {queue} within {timeout_s:g} s: {found.state}",
                fix,
            )
        time.sleep(poll_s)


def watch_admission(
    workloads: Workloads,
    *,
    jobset: str,
    uid: str,
    queue: str,
    stop: threading.Event,
    said: str,
    poll_s: float = 5.0,
    kind: str = "JobSet",
) -> None:
    """While the launch trains (until `stop`), logs each change of its Workload's state after `said` (the last
    one `wait_admitted` logged): a higher-priority workload's preemption (Evicted, Preempted: Kueue suspends the
    JobSet, whose trainers checkpoint on SIGTERM), the requeue, the admission again (the JobSet resumes and the
    trainers continue from their checkpoint). A failed read is logged once per kind of error, not raised: the
    launch is followed through its JobSet either way."""
    errors: set[str] = set()
    while not stop.wait(poll_s):
        try:
            workload = workloads.of_job(uid)
        except Exception as error:  # an API hiccup must not end a launch that trains
            failed = type(error).__name__
            if failed not in errors:
                errors.add(failed)
                logger.warning(
                    "Kueue, %s %s: reading its Workload failed (%s: %s)", kind, jobset, failed, error
                )
            continue
        if workload is None:
            continue
        state = admission(workload).state
        if state != said:
            logger.info("Kueue, %s %s in LocalQueue %s: %s", kind, jobset, queue, state)
            said = state


# --- can the queue ever hold a launch ----------------------------------------------------------------


def launch_needs(cluster: ClusterConfig, *, nodes: int) -> dict[str, float]:
    """What a launch of `nodes` nodes asks of a queue's quota: the accelerators, and the CPUs and memory where
    the config sizes the pods (`cpu_per_node`, `memory_per_node_bytes`; otherwise they come from the nodes)."""
    from batchpilot.cluster.readiness import GPU_RESOURCE
    from batchpilot.planning.tpu import TPU_RESOURCE_NAME, is_tpu

    needs: dict[str, float] = {}
    if cluster.accelerator_type is not None:
        resource = TPU_RESOURCE_NAME if is_tpu(cluster.accelerator_type) else GPU_RESOURCE
        needs[resource] = float(cluster.devices_per_node * nodes)
    if cluster.cpu_per_node is not None:
        needs["cpu"] = float(cluster.cpu_per_node * nodes)
    if cluster.memory_per_node_bytes is not None:
        needs["memory"] = float(cluster.memory_per_node_bytes * nodes)
    return needs


def quota_shortfall(
    cluster_queue: dict[str, Any],
    flavors: dict[str, dict[str, str]],
    *,
    needs: dict[str, float],
    accelerator_type: str | None,
) -> str | None:
    """Why no flavor of `cluster_queue` can ever hold `needs` (None: one can). A flavor can when it covers every
    needed resource with its nominal quota plus what it may borrow (`borrowingLimit`; a ClusterQueue in a
    cohort with no limit may borrow without bound), and its node labels, where they name a GPU, name
    `accelerator_type`. `flavors`: each ResourceFlavor's `spec.nodeLabels` (apis/kueue/v1beta2
    clusterqueue_types.go and resourceflavor_types.go)."""
    from kubernetes.utils import parse_quantity

    spec = cluster_queue.get("spec") or {}
    cohort = spec.get("cohortName")
    name = cluster_queue["metadata"]["name"]
    reasons = []
    for group in spec.get("resourceGroups") or []:
        covered = set(group.get("coveredResources") or [])
        if not set(needs) <= covered:
            continue
        for flavor in group.get("flavors") or []:
            labels = flavors.get(flavor["name"], {})
            gpu = labels.get(GKE_ACCELERATOR_LABEL)
            if gpu is not None and accelerator_type is not None and gpu != accelerator_type:
                reasons.append(f"flavor {flavor['name']} is for {gpu} nodes")
                continue
            short = []
            for quota in flavor.get("resources") or []:
                if quota["name"] not in needs:
                    continue
                limit = quota.get("borrowingLimit")
                if cohort and limit is None:
                    continue  # may borrow from its cohort without a bound
                most = float(parse_quantity(quota.get("nominalQuota", "0")))
                most += float(parse_quantity(limit)) if cohort and limit is not None else 0.0
                if needs[quota["name"]] > most:
                    short.append(f"{quota['name']} {_amount(needs[quota['name']])} > {_amount(most)}")
            if not short:
                return None
            reasons.append(f"flavor {flavor['name']}: {', '.join(short)}")
    missing = sorted(
        set(needs) - {r for g in spec.get("resourceGroups") or [] for r in g.get("coveredResources") or []}
    )
    if missing:
        reasons.insert(0, f"no resource group covers {', '.join(missing)}")
    return f"ClusterQueue {name} can never hold it: " + ("; ".join(reasons) or "it has no flavor")


def _amount(value: float) -> str:
    return f"{value:.0f}" if value >= 1e6 or value == int(value) else f"{value:g}"


def queue_problem(api_client: Any, cluster: ClusterConfig, *, nodes: int) -> BatchpilotError | None:
    """The LocalQueue `cluster.kueue_queue`, its ClusterQueue and flavors as the cluster has them: an error
    naming what is missing or short for a launch of `nodes` nodes, or None."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    assert cluster.kueue_queue is not None
    objects = client.CustomObjectsApi(api_client)
    queue, namespace = cluster.kueue_queue, cluster.namespace
    try:
        local = objects.get_namespaced_custom_object(
            GROUP, VERSION, namespace, "localqueues", queue, _request_timeout=30
        )
    except ApiException as error:
        if error.status == 404:
            return BatchpilotError(
                "cluster.kueue_queue",
                f"no LocalQueue {queue} in namespace {namespace} (or Kueue v0.15 or later is not installed)",
                f"use one of `kubectl get localqueues -n {namespace}`, or ask the cluster's admin for one",
            )
        raise
    cq_name = (local.get("spec") or {}).get("clusterQueue", "")
    cluster_queue = cluster_object(objects, GROUP, VERSION, "clusterqueues", cq_name)
    if cluster_queue is None:
        return BatchpilotError(
            "cluster.kueue_queue",
            f"LocalQueue {queue} points to ClusterQueue {cq_name!r}, which does not exist",
            "ask the cluster's admin to create it or to point the LocalQueue at one",
        )
    if cluster.provisioning == "flex-start":
        missing = provisioning_check_problem(objects, cluster_queue)
        if missing is not None:
            return BatchpilotError(
                "cluster.provisioning",
                f"flex-start through LocalQueue {queue} needs Kueue to ask GKE for the nodes: {missing}",
                "ask the cluster's admin to set up the ProvisioningRequestConfig, AdmissionCheck and ClusterQueue "
                "(docs/cluster.md, Shared clusters: Kueue queues), or set cluster.provisioning: resize",
            )
    names = {
        f["name"]
        for g in (cluster_queue.get("spec") or {}).get("resourceGroups") or []
        for f in g.get("flavors") or []
    }
    flavors = {}
    for flavor in sorted(names):
        found = cluster_object(objects, GROUP, VERSION, "resourceflavors", flavor)
        if found is None:
            continue  # Kueue keeps such a ClusterQueue inactive; its Workloads say so while they wait
        flavors[flavor] = dict((found.get("spec") or {}).get("nodeLabels") or {})
    needs = launch_needs(cluster, nodes=nodes)
    short = quota_shortfall(cluster_queue, flavors, needs=needs, accelerator_type=cluster.accelerator_type)
    if short is None:
        return None
    asked = ", ".join(f"{r} {_amount(v)}" for r, v in sorted(needs.items()))
    return BatchpilotError(
        "cluster.kueue_queue",
        f"a launch on {nodes} node(s) asks LocalQueue {queue} for {asked}; {short}",
        "ask the cluster's admin for that quota, or plan fewer nodes (cluster.max_nodes)",
    )


def provisioning_check_problem(objects: Any, cluster_queue: dict[str, Any]) -> str | None:
    """What keeps `cluster_queue` from asking GKE for flex-start nodes (None: nothing): it must list an
    admission check whose AdmissionCheck has controllerName `kueue.x-k8s.io/provisioning-request` and names a
    ProvisioningRequestConfig of class `queued-provisioning.gke.io`. `objects`: a CustomObjectsApi."""

    name = cluster_queue["metadata"]["name"]
    strategy = (cluster_queue.get("spec") or {}).get("admissionChecksStrategy") or {}
    checks = [c.get("name", "") for c in strategy.get("admissionChecks") or []]
    wanted = (
        f"an admission check whose AdmissionCheck has controllerName {PROVISIONING_CONTROLLER} and a "
        f"{PROVISIONING_CONFIG_KIND} of class {FLEX_START_CLASS}"
    )
    if not checks:
        return (
            f"ClusterQueue {name} lists no admission check (spec.admissionChecksStrategy); it needs {wanted}"
        )
    reasons = []
    for check in checks:
        found = cluster_object(objects, GROUP, VERSION, "admissionchecks", check)
        if found is None:
            reasons.append(f"AdmissionCheck {check} does not exist")
            continue
        spec = found.get("spec") or {}
        if spec.get("controllerName") != PROVISIONING_CONTROLLER:
            reasons.append(f"AdmissionCheck {check} has controllerName {spec.get('controllerName')!r}")
            continue
        parameters = spec.get("parameters") or {}
        if parameters.get("apiGroup") != GROUP or parameters.get("kind") != PROVISIONING_CONFIG_KIND:
            reasons.append(f"AdmissionCheck {check} names no {PROVISIONING_CONFIG_KIND} in spec.parameters")
            continue
        config = parameters.get("name", "")
        prc = cluster_object(objects, GROUP, VERSION, "provisioningrequestconfigs", config)
        if prc is None:
            reasons.append(f"{PROVISIONING_CONFIG_KIND} {config} (of AdmissionCheck {check}) does not exist")
            continue
        provisioning_class = (prc.get("spec") or {}).get("provisioningClassName")
        if provisioning_class != FLEX_START_CLASS:
            reasons.append(
                f"{PROVISIONING_CONFIG_KIND} {config} (of AdmissionCheck {check}) has class {provisioning_class!r}"
            )
            continue
        return None
    return f"ClusterQueue {name} has no {wanted}: " + "; ".join(reasons)
