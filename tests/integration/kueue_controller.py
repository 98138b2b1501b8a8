"""Kueue in the simulated cluster: LocalQueues, ClusterQueues with quota per ResourceFlavor, and a Workload
per queued JobSet, admitted as Kueue v0.19.2 admits it (kubernetes-sigs/kueue at tag v0.19.2; the files named
per rule; docs/research/kueue_trainer.md has more).

Rules:
- the JobSet webhook (pkg/controller/jobs/jobset/jobset_webhook.go, jobframework/defaults.go
  `ApplyDefaultForSuspend`): on create, a JobSet labelled `kueue.x-k8s.io/queue-name` is suspended
  (`spec.suspend: true`) whatever it asked; the label's value must be a DNS-1123 subdomain
  (jobframework/validation.go `ValidateQueueName`);
- the Workload (jobframework/reconciler.go `ConstructWorkload`, utils.go `NewWorkload`, workload_names.go):
  `kueue.x-k8s.io/v1beta2`, named `jobset-<name>-<first 5 hex of SHA-1 of "JobSet\\njobset.x-k8s.io\\n<name>\\n
  <uid>">`, labelled `kueue.x-k8s.io/job-uid: <uid>`, owned by the JobSet, `spec.queueName` from the label,
  one pod set per replicated job with count replicas x min(parallelism, completions) (pkg/controller/jobs/
  jobset/jobset_controller.go `PodSets`); its priority is the value of the WorkloadPriorityClass the label
  `kueue.x-k8s.io/priority-class` names, else 0 (pkg/util/priority/priority.go);
- admission (pkg/scheduler/scheduler.go, flavorassigner/flavorassigner.go `fitsResourceQuota`): the pending
  Workloads in priority order, then by creation (BestEffortFIFO: one that does not fit does not block the
  next); a Workload's requests (pod requests x count, per resource) must fit one flavor of the ClusterQueue
  behind its LocalQueue: usage + request <= nominalQuota for every resource the flavor covers. Otherwise it
  stays QuotaReserved=False, reason Pending, with the flavor assigner's message: "couldn't assign flavors to
  pod set <name>: insufficient unused quota for <resource> in flavor <flavor>, <n> more needed", or
  "insufficient quota for <resource> in flavor <flavor>, previously considered podsets requests (0) + current
  podset request (<n>) > maximum capacity (<quota>)" when it could never fit (reason ExceedsMaxQuota with
  the observability gate; Pending by default); a missing LocalQueue: QuotaReserved=False, reason Inadmissible,
  "LocalQueue <name> is terminating or missing" (pkg/controller/core/workload_controller.go);
- admitted (pkg/workload/workload.go `SetQuotaReservation`, admissionchecks.go `SyncAdmittedCondition`):
  `status.admission` {clusterQueue, podSetAssignments}, QuotaReserved=True "Quota reserved in ClusterQueue
  <cq>", Admitted=True "The workload is admitted" (no admission checks here); the JobSet's pod templates get
  the flavor's nodeLabels as node selectors and the JobSet is unsuspended (jobframework/reconciler.go
  `startJob`, podset.Merge);
- finished (reconciler.go): a JobSet Completed or Failed finishes its Workload (Finished=True, reason
  Succeeded or Failed) and frees its quota; a deleted JobSet's Workload goes with it (owner reference);
- preemption within the ClusterQueue (`spec.preemption.withinClusterQueue: LowerPriority`; pkg/scheduler/
  preemption/preemption.go): a pending Workload that does not fit evicts admitted Workloads of lower priority,
  the lowest first, until it fits: Evicted=True and Preempted=True (reasons Preempted and InClusterQueue,
  "Preempted to accommodate a workload (UID: <uid>, JobUID: <job uid>) due to prioritization in the
  ClusterQueue; preemptor path: /<cq>; preemptee path: /<cq>"), Admitted=False, and its JobSet suspended
  (jobframework/reconciler.go `stopJob`); its quota is freed once its pods are gone, and it waits again
  (QuotaReserved=False, Requeued=True reason Preempted: pkg/workload/evict/evict.go, reconciler.go).

ProvisioningRequest admission checks (GKE flex-start through Kueue; pkg/controller/admissionchecks/provisioning/
controller.go and provisioning.go unless another file is named):
- objects (apis/kueue/v1beta2/admissioncheck_types.go, provisioningrequestconfig_types.go, clusterqueue_types.go):
  an AdmissionCheck {controllerName, parameters {apiGroup, kind, name}}, a ProvisioningRequestConfig
  {provisioningClassName, parameters, retryStrategy {backoffLimitCount 3, backoffBaseSeconds 60,
  backoffMaxSeconds 1800 by default}}, and the ClusterQueue's `spec.admissionChecksStrategy.admissionChecks[].name`;
- the Workload's `status.admissionChecks` follows its ClusterQueue's checks, each starting Pending
  (workload_controller.go `reconcileSyncAdmissionChecks`); with checks, quota reserved is not admitted:
  Admitted=False, reason UnsatisfiedChecks, "The workload has not all checks ready", until every check is
  Ready (pkg/workload/admissionchecks.go `SyncAdmittedCondition`); the JobSet stays suspended meanwhile;
- the Workload carries its job's `provreq.kueue.x-k8s.io/` annotations (jobframework/utils.go `NewWorkload`);
- the request is created only once quota is reserved (`Reconcile`), named `<workload>-<check>-<attempt>`
  (attempt = the check's retryCount + 1; `ProvisioningRequestName`), labelled `kueue.x-k8s.io/managed: "true"`,
  owned by the Workload, its class and parameters the config's, each `provreq.kueue.x-k8s.io/<P>` annotation
  of the Workload overriding parameter P (`passProvReqParams`), one pod set per Workload pod set with the
  assigned count; its PodTemplate `ppt-<request>-<podset>` (`getProvisioningRequestPodTemplateName`) labelled
  `kueue.x-k8s.io/managed: "true"`, the pod set's template with the flavor's node labels merged in
  (`createPodTemplate`), owned by the Workload, then by the request (`syncProvisionRequestsPodTemplates`);
- the check's state from the request's conditions (`syncCheckStates`): Failed -> Retry ("Retrying after
  failure: <message>", requeueAfterSeconds base x 2^retryCount capped at max: pkg/workload/admissionchecks.go
  `UpdateAdmissionCheckRequeueState`) while the attempt <= backoffLimitCount, else Rejected with the Failed
  message; CapacityRevoked -> Rejected with its message; Provisioned -> Ready with its message and podSetUpdates
  (annotations `autoscaling.x-k8s.io/consume-provisioning-request: <request>` and
  `autoscaling.x-k8s.io/provisioning-class-name: <class>`: `podSetUpdates`); Accepted with a Provisioned
  condition -> Pending with that condition's message; no condition -> Pending, no message;
- a Retry check evicts the Workload (workload_controller.go `reconcileCheckBasedEviction`): Evicted=True, reason
  AdmissionCheck, "Evicted due to AdmissionCheck in Retry state: "<check>" (<message>)"; its checks go back to
  Pending, "Reset to Pending after eviction. Previously: <state>", a Retry one's retryCount + 1
  (pkg/workload/evict/evict.go); its quota is freed and it waits requeueAfterSeconds before it is tried again;
  a Rejected check deactivates it: spec.active false, Evicted=True, reason DeactivatedDueToAdmissionCheck,
  "The workload is deactivated due to AdmissionCheck in Rejected state: ..." (workload_controller.go), never
  admitted again;
- at admission the checks' podSetUpdates are merged into the JobSet's pod templates with the flavor's node
  labels (jobframework/reconciler.go `startJob`, pkg/podset/podset.go `Merge`);
- a finished or evicted Workload's requests are deleted (`Reconcile`, CleanupProvisioningRequestsOnEviction on by
  default since 0.19), and a deleted Workload's go with it (owner references), their PodTemplates with them.
Kubeflow Trainer's TrainJobs (pkg/controller/jobs/trainjob/trainjob_controller.go and trainjob_webhook.go): a
TrainJob labelled with a queue is suspended on create and gets Kueue's own runtime patch (manager
`kueue.x-k8s.io/manager`); its Workload `trainjob-<name>-<hash>` (group trainer.kubeflow.org) is owned by it, its
pod sets those of the JobSet Trainer builds from its runtime (`getChildJobSet`, `PodSets`); at admission the
flavor's node labels and the checks' podSetUpdates go into that patch, one replicated job per pod set, and the
TrainJob is unsuspended in the same update (`RunWithPodSetsInfo`); a preemption suspends the TrainJob (`Stop`),
whose JobSet Trainer then suspends; it is finished by its Complete or Failed condition (`Finished`).
Not modelled: other admission check controllers, onFlavors, managedResources, BookingExpired before admission,
pod set merging, cohorts and borrowing, several resource groups, partial admission, waitForPodsReady, the
v1beta1 API.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import re
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from k8s_rules import pod_requests, quantity
from workload_controllers import now

if TYPE_CHECKING:
    from cluster_sim import ClusterSim

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
_PATH = re.compile(
    rf"^/apis/{re.escape(GROUP)}/{VERSION}(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?$"
)
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
KINDS = {
    "localqueues": "LocalQueue", "clusterqueues": "ClusterQueue", "resourceflavors": "ResourceFlavor",
    "workloads": "Workload", "workloadpriorityclasses": "WorkloadPriorityClass",
    "admissionchecks": "AdmissionCheck", "provisioningrequestconfigs": "ProvisioningRequestConfig",
}  # fmt: skip
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
KUEUE_MANAGER = "kueue.x-k8s.io/manager"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
PROVREQ_PREFIX = "provreq.kueue.x-k8s.io/"
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
NAMESPACED = {"localqueues", "workloads"}


def workload_name(jobset: str, uid: str, *, kind: str = "JobSet", group: str = "jobset.x-k8s.io") -> str:
    """workload_names.go: `<lower(kind)>-<owner name>-<5 hex of SHA-1(kind, group, name, uid)>`."""
    digest = hashlib.sha1("\n".join([kind, group, jobset, uid]).encode()).hexdigest()[:5]
    return f"{kind.lower()}-{jobset}"[:247] + "-" + digest


def _is_trainjob(job: dict[str, Any]) -> bool:
    return job.get("kind") == "TrainJob"


def _finished_as(job: dict[str, Any]) -> str | None:
    """ "Completed" or "Failed" once the job has ended: a JobSet's terminalState, a TrainJob's Complete or
    Failed condition (trainjob_controller.go `Finished`), else None."""
    if not _is_trainjob(job):
        return job["status"].get("terminalState")  # type: ignore[no-any-return]
    for condition in job["status"].get("conditions") or []:
        if condition["status"] == "True" and condition["type"] in ("Complete", "Failed"):
            return "Completed" if condition["type"] == "Complete" else "Failed"
    return None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def _set(workload: dict[str, Any], kind: str, status: str, reason: str, message: str) -> None:
    conditions = workload["status"].setdefault("conditions", [])
    found = next((c for c in conditions if c["type"] == kind), None)
    if found is None:
        conditions.append(found := {"type": kind})
    if (found.get("status"), found.get("reason"), found.get("message")) != (status, reason, message):
        found.update(status=status, reason=reason, message=message, lastTransitionTime=now())


class KueueController:
    """Kueue's objects (`objects[plural][(namespace or "", name)]`) and its controllers, driven by the sim."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {plural: {} for plural in KINDS}
        self.order = itertools.count()
        self.admitted: list[str] = []  # workload names in the order they were admitted (for tests)
        self.requeue_at: dict[str, float] = {}  # workload -> when an admission check's backoff ends
        self.requests_created: list[
            dict[str, Any]
        ] = []  # every ProvisioningRequest Kueue created (for tests)

    # -- what an administrator creates -------------------------------------------------------------
    def add_flavor(self, name: str, *, node_labels: dict[str, str] | None = None) -> None:
        self._store(
            "resourceflavors", "", {"metadata": {"name": name}, "spec": {"nodeLabels": node_labels or {}}}
        )

    def add_provisioning_check(
        self, name: str, *, config: str, provisioning_class: str = "queued-provisioning.gke.io",
        controller: str = PROVISIONING_CONTROLLER, backoff_limit_count: int = 3, backoff_base_s: int = 60,
        backoff_max_s: int = 1800, make_config: bool = True,
    ) -> None:  # fmt: skip
        """An AdmissionCheck `name` of `controller` naming ProvisioningRequestConfig `config` (created unless
        `make_config` is False) of `provisioning_class` and that retry strategy."""
        self._store("admissionchecks", "", {"metadata": {"name": name}, "spec": {
            "controllerName": controller,
            "parameters": {"apiGroup": GROUP, "kind": "ProvisioningRequestConfig", "name": config}}})  # fmt: skip
        if make_config:
            self._store("provisioningrequestconfigs", "", {"metadata": {"name": config}, "spec": {
                "provisioningClassName": provisioning_class,
                "retryStrategy": {"backoffLimitCount": backoff_limit_count, "backoffBaseSeconds": backoff_base_s,
                                  "backoffMaxSeconds": backoff_max_s}}})  # fmt: skip

    def add_cluster_queue(
        self, name: str, *, quota: dict[str, dict[str, str]], preemption: str = "Never",
        admission_checks: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        """`quota`: flavor -> {resource: nominal quota}, one resource group covering every named resource;
        `preemption`: withinClusterQueue (Never, Kueue's default, or LowerPriority); `admission_checks`: the
        AdmissionChecks every Workload must pass (`spec.admissionChecksStrategy`)."""
        covered = sorted({resource for resources in quota.values() for resource in resources})
        group = {
            "coveredResources": covered,
            "flavors": [
                {"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in resources.items()]}
                for flavor, resources in quota.items()
            ],
        }
        strategy = {"admissionChecksStrategy": {"admissionChecks": [{"name": c} for c in admission_checks]}}
        self._store("clusterqueues", "", {"metadata": {"name": name}, "spec": {
            "resourceGroups": [group], "preemption": {"withinClusterQueue": preemption},
            **(strategy if admission_checks else {})}})  # fmt: skip

    def add_local_queue(self, namespace: str, name: str, *, cluster_queue: str) -> None:
        self._store("localqueues", namespace, {"metadata": {"name": name, "namespace": namespace},
                                               "spec": {"clusterQueue": cluster_queue}})  # fmt: skip

    def add_priority_class(self, name: str, value: int) -> None:
        self._store("workloadpriorityclasses", "", {"metadata": {"name": name}, "value": value})

    def _store(self, plural: str, namespace: str, obj: dict[str, Any]) -> None:
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KINDS[plural], "status": {}, **obj}
        self.objects[plural][(namespace, obj["metadata"]["name"])] = obj

    # -- the API ---------------------------------------------------------------------------------
    @staticmethod
    def serves(path: str) -> bool:
        return bool(_PATH.match(path))

    def route(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        from k8s_rules import selector_matches

        match = _PATH.match(path)
        assert match is not None
        plural, ns, name = match["plural"], match["ns"] or "", match["name"]
        if (
            plural not in KINDS
            or (ns and plural not in NAMESPACED)
            or (name and plural in NAMESPACED and not ns)
        ):
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        if method != "GET":
            return 405, _status(405, "MethodNotAllowed", f"{method} on {plural} is not simulated")
        objects = self.objects[plural]
        if name is None:
            selector = query.get("labelSelector", [""])[0]
            items = [o for (n, _), o in objects.items() if (not match["ns"] or n == ns)
                     and selector_matches(o["metadata"].get("labels", {}), selector)]  # fmt: skip
            return 200, {"apiVersion": f"{GROUP}/{VERSION}", "kind": f"{KINDS[plural]}List",
                         "metadata": {"resourceVersion": "1"}, "items": items}  # fmt: skip
        if (ns, name) not in objects:
            return 404, _status(404, "NotFound", f'{plural}.{GROUP} "{name}" not found')
        return 200, objects[(ns, name)]

    # -- the JobSet webhook -------------------------------------------------------------------------
    def admit_jobset(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Mutating (suspend a queued JobSet) and validating (the queue name); a refusal's Status, or None."""
        queue = (body.get("metadata", {}).get("labels") or {}).get(QUEUE_LABEL)
        if queue is None:
            return None
        if len(queue) > 253 or not _SUBDOMAIN.match(queue):
            return _status(422, "Invalid", f'admission webhook "vjobset.kb.io" denied the request: '
                           f'metadata.labels[{QUEUE_LABEL}]: Invalid value: "{queue}": a lowercase RFC 1123 '
                           "subdomain must consist of lower case alphanumeric characters, '-' or '.'")  # fmt: skip
        body.setdefault("spec", {})["suspend"] = True
        return None

    # -- the TrainJob webhook (pkg/controller/jobs/trainjob/trainjob_webhook.go) ----------------------------
    def admit_trainjob(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Mutating: a queued TrainJob is suspended and gets Kueue's own runtime patch (manager
        `kueue.x-k8s.io/manager`, empty until admission); validating: the queue name. A refusal, or None."""
        queue = (body.get("metadata", {}).get("labels") or {}).get(QUEUE_LABEL)
        if queue is None:
            return None
        if len(queue) > 253 or not _SUBDOMAIN.match(queue):
            return _status(422, "Invalid", f'admission webhook "vtrainjob.kb.io" denied the request: '
                           f'metadata.labels[{QUEUE_LABEL}]: Invalid value: "{queue}"')  # fmt: skip
        spec = body.setdefault("spec", {})
        spec["suspend"] = True
        patches = spec.setdefault("runtimePatches", [])
        if not any(p["manager"] == KUEUE_MANAGER for p in patches):
            patches.append({"manager": KUEUE_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {}}}})
        return None

    # -- the controllers ------------------------------------------------------------------------------
    def reconcile(self, sim: ClusterSim) -> None:
        workloads = self.objects["workloads"]
        jobs = {js["metadata"]["uid"]: (key, js) for key, js in sim.jobsets.items()}
        if sim.trainer is not None:  # Kueue's TrainJob integration: the TrainJob is queued, not its JobSet
            jobs.update({tj["metadata"]["uid"]: (key, tj) for key, tj in sim.trainer.trainjobs.items()})
        for key, workload in list(workloads.items()):
            uid = workload["metadata"]["labels"][JOB_UID_LABEL]
            if uid not in jobs:  # the owner is gone: garbage-collected
                del workloads[key]
                continue
            terminal = _finished_as(jobs[uid][1])
            if terminal and not self._finished(workload):
                _set(workload, "Finished", "True", "Succeeded" if terminal == "Completed" else "Failed",
                     f"{jobs[uid][1]['kind']} {terminal.lower()}")  # fmt: skip
        for workload in workloads.values():  # an evicted Workload's quota is freed once its pods are gone
            if self._evicted(workload) and workload["status"].get("admission"):
                uid = workload["metadata"]["labels"][JOB_UID_LABEL]
                name = jobs[uid][0][1]
                if not any(p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
                           for p in sim.pods.values()):  # fmt: skip
                    del workload["status"]["admission"]
                    evicted = _condition_of(workload, "Evicted")
                    if evicted["reason"] == "Preempted":
                        _set(workload, "QuotaReserved", "False", "Preempted", evicted["message"])
                        _set(workload, "Requeued", "True", "Preempted", evicted["message"])
                    else:  # an admission check's Retry (after its backoff) or a deactivation (never)
                        _set(workload, "QuotaReserved", "False", "Pending", evicted["message"])
                        _set(workload, "Requeued", "False", evicted["reason"], evicted["message"])
        known = {w["metadata"]["labels"][JOB_UID_LABEL] for w in workloads.values()}
        for uid, ((ns, name), jobset) in jobs.items():
            if uid not in known and QUEUE_LABEL in (jobset["metadata"].get("labels") or {}):
                self._create_workload(sim, ns, name, jobset)
        if sim.provisioning is not None:
            self._provisioning_checks(sim, jobs)
        clock = time.monotonic()
        pending = [w for w in workloads.values()
                   if not self._admitted(w) and not self._finished(w) and not w["status"].get("admission")
                   and w["spec"].get("active", True)
                   and self.requeue_at.get(w["metadata"]["name"], 0.0) <= clock]  # fmt: skip
        pending.sort(key=lambda w: (-w["spec"]["priority"], w["metadata"]["creationOrder"]))
        for workload in pending:
            if self.requeue_at.pop(workload["metadata"]["name"], None) is not None:
                _set(workload, "Requeued", "True", "BackoffFinished",
                     "The workload backoff was finished")  # fmt: skip
            self._try_admit(sim, workload, jobs)

    def _create_workload(self, sim: ClusterSim, namespace: str, name: str, jobset: dict[str, Any]) -> None:
        """`jobset` may be a TrainJob: its pod sets are those of the JobSet Trainer builds for it, computed
        from its runtime (trainjob_controller.go `getChildJobSet`, `PodSets`)."""
        owner = jobset
        if _is_trainjob(jobset):
            from trainer_controller import build_jobset

            jobset = build_jobset(sim.trainer.runtimes[owner["spec"]["runtimeRef"]["name"]], owner)
            jobset["metadata"]["annotations"] = owner["metadata"].get("annotations") or {}
        uid = owner["metadata"]["uid"]
        labels = owner["metadata"]["labels"]
        priority_class = labels.get(PRIORITY_LABEL)
        wpc = self.objects["workloadpriorityclasses"].get(("", priority_class or ""))
        if priority_class and wpc is None:
            return  # "workloadpriorityclass not found": the creation fails and is retried (reconciler.go)
        pod_sets = []
        for rj in jobset["spec"]["replicatedJobs"]:
            job = rj["template"]["spec"]
            count = rj.get("replicas", 1) * min(job.get("parallelism", 1), job.get("completions", 1))
            pod_sets.append(
                {"name": rj["name"].lower(), "count": count, "template": rj["template"]["spec"]["template"]}
            )
        kind, api_version = owner["kind"], owner["apiVersion"]
        wl_name = workload_name(name, uid, kind=kind, group=api_version.split("/")[0])
        provreq = {
            k: v
            for k, v in (jobset["metadata"].get("annotations") or {}).items()
            if k.startswith(PROVREQ_PREFIX)
        }
        self.objects["workloads"][(namespace, wl_name)] = {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
            "metadata": {
                "name": wl_name, "namespace": namespace, "labels": {JOB_UID_LABEL: uid}, "annotations": provreq,
                "finalizers": ["kueue.x-k8s.io/resource-in-use"], "creationOrder": next(self.order),
                "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": name,
                                     "uid": uid, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": {
                "queueName": labels[QUEUE_LABEL], "podSets": pod_sets,
                "priority": wpc["value"] if wpc else 0,
                **({"priorityClassRef": {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority_class}}
                   if wpc else {}),
            },
            "status": {},
        }  # fmt: skip

    @staticmethod
    def _admitted(workload: dict[str, Any]) -> bool:
        return _is(workload, "Admitted")

    @staticmethod
    def _evicted(workload: dict[str, Any]) -> bool:
        return _is(workload, "Evicted")

    @staticmethod
    def _finished(workload: dict[str, Any]) -> bool:
        return _is(workload, "Finished")

    @staticmethod
    def _requests(workload: dict[str, Any]) -> dict[str, Fraction]:
        total: dict[str, Fraction] = {}
        for pod_set in workload["spec"]["podSets"]:
            for resource, amount in pod_requests(pod_set["template"]["spec"]).items():
                total[resource] = total.get(resource, Fraction(0)) + amount * pod_set["count"]
        return total

    def _usage(self, cluster_queue: str) -> dict[tuple[str, str], Fraction]:
        """(flavor, resource) -> what the admitted, unfinished Workloads of `cluster_queue` hold."""
        used: dict[tuple[str, str], Fraction] = {}
        for workload in self.objects["workloads"].values():
            admission = workload["status"].get("admission")
            if admission is None or admission["clusterQueue"] != cluster_queue or self._finished(workload):
                continue
            flavors = admission["podSetAssignments"][0]["flavors"]
            for resource, amount in self._requests(workload).items():
                if resource in flavors:
                    key = (flavors[resource], resource)
                    used[key] = used.get(key, Fraction(0)) + amount
        return used

    def _try_admit(self, sim: ClusterSim, workload: dict[str, Any], jobs: dict[str, Any]) -> None:
        ns = workload["metadata"]["namespace"]
        local = self.objects["localqueues"].get((ns, workload["spec"]["queueName"]))
        cq = self.objects["clusterqueues"].get(("", local["spec"]["clusterQueue"])) if local else None
        if local is None or cq is None:
            _set(workload, "QuotaReserved", "False", "Inadmissible",
                 f"LocalQueue {workload['spec']['queueName']} is terminating or missing")  # fmt: skip
            return
        cq_name = local["spec"]["clusterQueue"]
        need = self._requests(workload)
        used = self._usage(cq_name)
        group = cq["spec"]["resourceGroups"][0]
        pod_set = workload["spec"]["podSets"][0]["name"]
        reasons = []
        for flavor in group["flavors"]:
            quota = {r["name"]: quantity(r["nominalQuota"]) for r in flavor["resources"]}
            why = []
            for resource, amount in sorted(need.items()):
                if resource not in group["coveredResources"] or amount == 0:
                    continue
                have = quota.get(resource, Fraction(0))
                if amount > have:
                    why.append(f"insufficient quota for {resource} in flavor {flavor['name']}, previously "
                               f"considered podsets requests (0) + current podset request ({_show(amount)}) > "
                               f"maximum capacity ({_show(have)})")  # fmt: skip
                elif used.get((flavor["name"], resource), Fraction(0)) + amount > have:
                    more = used.get((flavor["name"], resource), Fraction(0)) + amount - have
                    why.append(f"insufficient unused quota for {resource} in flavor {flavor['name']}, "
                               f"{_show(more)} more needed")  # fmt: skip
            if not why:
                self._admit(sim, workload, jobs, cq_name=cq_name, flavor=flavor["name"], need=need)
                return
            if cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority" and self._preempt(
                sim, workload, jobs, cq_name=cq_name, flavor=flavor["name"], quota=quota, need=need, used=used
            ):  # admitted in a later pass, once the preempted Workloads' pods are gone
                _set(workload, "QuotaReserved", "False", "Pending",
                     f"couldn't assign flavors to pod set {pod_set}: {', '.join(why)}")  # fmt: skip
                return
            reasons += why
        _set(workload, "QuotaReserved", "False", "Pending",
             f"couldn't assign flavors to pod set {pod_set}: {', '.join(reasons)}")  # fmt: skip

    def _preempt(
        self,
        sim: ClusterSim,
        workload: dict[str, Any],
        jobs: dict[str, Any],
        *,
        cq_name: str,
        flavor: str,
        quota: dict[str, Fraction],
        need: dict[str, Fraction],
        used: dict[tuple[str, str], Fraction],
    ) -> bool:
        """Evicts admitted Workloads of `cq_name` in `flavor` of lower priority, the lowest (then the newest)
        first, until `workload` fits; False (nothing evicted) when even all of them would not make room."""
        candidates = sorted(
            (w for w in self.objects["workloads"].values()
             if self._admitted(w) and not self._finished(w) and w["status"]["admission"]["clusterQueue"] == cq_name
             and w["spec"]["priority"] < workload["spec"]["priority"]
             and flavor in w["status"]["admission"]["podSetAssignments"][0]["flavors"].values()),
            key=lambda w: (w["spec"]["priority"], -w["metadata"]["creationOrder"]),
        )  # fmt: skip
        free = dict(used)
        victims = []
        for victim in candidates:
            if all(
                free.get((flavor, r), Fraction(0)) + a <= quota.get(r, Fraction(0))
                for r, a in need.items()
                if a
            ):
                break
            victims.append(victim)
            for resource, amount in self._requests(victim).items():
                free[(flavor, resource)] = free.get((flavor, resource), Fraction(0)) - amount
        if not victims or not all(free.get((flavor, r), Fraction(0)) + a <= quota.get(r, Fraction(0))
                                  for r, a in need.items() if a):  # fmt: skip
            return False
        preemptor_uid = workload["metadata"]["labels"][JOB_UID_LABEL]
        message = (f"Preempted to accommodate a workload (UID: {preemptor_uid}, JobUID: {preemptor_uid}) due to "
                   f"prioritization in the ClusterQueue; preemptor path: /{cq_name}; preemptee path: /{cq_name}")  # fmt: skip
        for victim in victims:
            _set(victim, "Evicted", "True", "Preempted", message)
            _set(victim, "Preempted", "True", "InClusterQueue", message)
            _set(victim, "Admitted", "False", "NoReservation", "The workload has no reservation")
            _set(victim, "Requeued", "False", "Preempted", message)
            jobs[victim["metadata"]["labels"][JOB_UID_LABEL]][1]["spec"]["suspend"] = True
        return True

    def _admit(self, sim: ClusterSim, workload: dict[str, Any], jobs: dict[str, Any], *, cq_name: str, flavor: str,
               need: dict[str, Fraction]) -> None:  # fmt: skip
        workload["status"]["admission"] = {
            "clusterQueue": cq_name,
            "podSetAssignments": [
                {"name": ps["name"], "flavors": dict.fromkeys(need, flavor), "count": ps["count"]}
                for ps in workload["spec"]["podSets"]
            ],
        }
        if self._evicted(workload):
            _set(
                workload,
                "Evicted",
                "False",
                "QuotaReserved",
                "Previously: " + _condition_of(workload, "Evicted")["reason"],
            )
        _set(workload, "QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {cq_name}")
        strategy = self.objects["clusterqueues"][("", cq_name)]["spec"].get("admissionChecksStrategy") or {}
        names = [c["name"] for c in strategy.get("admissionChecks") or []]
        if names:  # the checks follow the ClusterQueue's; new ones start Pending
            states = {c["name"]: c for c in workload["status"].get("admissionChecks") or []}
            workload["status"]["admissionChecks"] = [
                states.get(n) or {"name": n, "state": "Pending", "message": "", "lastTransitionTime": now()}
                for n in names
            ]
            _set(workload, "Admitted", "False", "UnsatisfiedChecks", "The workload has not all checks ready")
            return
        self._start(workload, jobs)

    def _start(self, workload: dict[str, Any], jobs: dict[str, Any]) -> None:
        """Admitted: the flavor's node labels and the checks' podSetUpdates into the JobSet's pod templates, and
        the JobSet unsuspended."""
        _set(workload, "Admitted", "True", "Admitted", "The workload is admitted")
        self.admitted.append(workload["metadata"]["name"])
        _, jobset = jobs[workload["metadata"]["labels"][JOB_UID_LABEL]]
        (flavor,) = set(workload["status"]["admission"]["podSetAssignments"][0]["flavors"].values())
        node_labels = self.objects["resourceflavors"][("", flavor)]["spec"].get("nodeLabels") or {}
        updates = {
            u["name"]: u
            for c in workload["status"].get("admissionChecks") or []
            for u in c.get("podSetUpdates") or []
        }
        if _is_trainjob(jobset):  # RunWithPodSetsInfo: into Kueue's runtime patch, then unsuspended
            (patch,) = [p for p in jobset["spec"]["runtimePatches"] if p["manager"] == KUEUE_MANAGER]
            patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"] = [
                {"name": ps["name"], "template": {"spec": {"template": {
                    "metadata": {k: updates.get(ps["name"], {}).get(k, {}) for k in ("labels", "annotations")},
                    "spec": {"nodeSelector": {**node_labels, **updates.get(ps["name"], {}).get("nodeSelector", {})}},
                }}}}
                for ps in workload["spec"]["podSets"]
            ]  # fmt: skip
            jobset["spec"]["suspend"] = False
            return
        for rj in jobset["spec"]["replicatedJobs"]:
            template = rj["template"]["spec"]["template"]
            pod = template["spec"]
            update = updates.get(rj["name"].lower(), {})
            pod["nodeSelector"] = {
                **(pod.get("nodeSelector") or {}),
                **node_labels,
                **update.get("nodeSelector", {}),
            }
            metadata = template.setdefault("metadata", {})
            for field in ("annotations", "labels"):
                if update.get(field):
                    metadata[field] = {**(metadata.get(field) or {}), **update[field]}
        jobset["spec"]["suspend"] = False

    # -- the ProvisioningRequest admission check ---------------------------------------------------------
    def _provisioning_checks(self, sim: ClusterSim, jobs: dict[str, Any]) -> None:
        provisioning = sim.provisioning
        workloads = self.objects["workloads"]
        for key, request in list(
            provisioning.requests.items()
        ):  # owner references: the Workload's go with it
            owners = request["metadata"].get("ownerReferences") or []
            if owners and owners[0]["kind"] == "Workload" and (key[0], owners[0]["name"]) not in workloads:
                self._delete_request(provisioning, key)
        for (ns, name), workload in workloads.items():
            checks = workload["status"].get("admissionChecks") or []
            if not checks:
                continue
            if self._finished(workload) or self._evicted(workload):
                for key, request in list(provisioning.requests.items()):
                    if key[0] == ns and _owner(request) == name:
                        self._delete_request(provisioning, key)
                continue
            if not workload["status"].get("admission"):
                continue  # nothing happens before quota is reserved
            for state in checks:
                self._sync_check(provisioning, workload, state)
            rejected = [c for c in checks if c["state"] == "Rejected"]
            retry = [c for c in checks if c["state"] == "Retry"]
            if rejected:
                message = f"The workload is deactivated due to {_checks_message(rejected, 'Rejected')}"
                workload["spec"]["active"] = False
                self._evict(workload, "DeactivatedDueToAdmissionCheck", message)
            elif retry:
                self._evict(workload, "AdmissionCheck", f"Evicted due to {_checks_message(retry, 'Retry')}")
                wait_s = max(c.get("requeueAfterSeconds", 0) for c in checks)
                self.requeue_at[name] = time.monotonic() + wait_s
            elif all(c["state"] == "Ready" for c in checks) and not self._admitted(workload):
                self._start(workload, jobs)

    def _evict(self, workload: dict[str, Any], reason: str, message: str) -> None:
        """Evicted with `reason`; every check not Pending back to Pending, a Retry one's retryCount + 1."""
        _set(workload, "Evicted", "True", reason, message)
        _set(workload, "Admitted", "False", "NoReservation", "The workload has no reservation")
        checks = workload["status"]["admissionChecks"]
        for i, check in enumerate(checks):
            if check["state"] == "Pending":
                continue
            reset = {"name": check["name"], "state": "Pending", "lastTransitionTime": now(),
                     "message": f"Reset to Pending after eviction. Previously: {check['state']}"}  # fmt: skip
            if "requeueAfterSeconds" in check:
                reset["requeueAfterSeconds"] = check["requeueAfterSeconds"]
            if check["state"] == "Retry":
                reset["retryCount"] = check.get("retryCount", 0) + 1
            checks[i] = reset

    def _sync_check(self, provisioning: Any, workload: dict[str, Any], state: dict[str, Any]) -> None:
        """Creates the check's request for the current attempt, or maps its conditions to the check's state."""
        check = self.objects["admissionchecks"].get(("", state["name"]))
        if check is None or check["spec"]["controllerName"] != PROVISIONING_CONTROLLER:
            return  # other controllers are not modelled
        config = self.objects["provisioningrequestconfigs"].get(("", check["spec"]["parameters"]["name"]))
        if config is None:
            _check(state, "Pending", "the check is not active")
            return
        if state["state"] == "Ready":
            return
        ns, wl_name = workload["metadata"]["namespace"], workload["metadata"]["name"]
        attempt = state.get("retryCount", 0) + 1
        name = f"{wl_name}-{state['name']}-{attempt}"
        request = provisioning.requests.get((ns, name))
        if request is None:
            if state["state"] == "Pending":
                self._create_request(provisioning, workload, name=name, config=config)
            return
        found = {c["type"]: c for c in request["status"].get("conditions") or []}

        def true(kind: str) -> bool:
            return found.get(kind, {}).get("status") == "True"

        retry = config["spec"]["retryStrategy"]
        if true("Failed"):
            if attempt <= retry["backoffLimitCount"]:
                _check(state, "Retry", f"Retrying after failure: {found['Failed']['message']}")
                state["requeueAfterSeconds"] = min(
                    retry["backoffBaseSeconds"] * 2 ** state.get("retryCount", 0), retry["backoffMaxSeconds"]
                )
            else:
                _check(state, "Rejected", found["Failed"]["message"])
        elif true("CapacityRevoked"):
            _check(state, "Rejected", found["CapacityRevoked"]["message"])
        elif true("Provisioned"):
            _check(state, "Ready", found["Provisioned"]["message"])
            state["podSetUpdates"] = [
                {"name": ps["name"], "annotations": {CONSUME: name, CLASS_ANNOTATION: request["spec"]["provisioningClassName"]}}
                for ps in workload["spec"]["podSets"]
            ]  # fmt: skip
        elif true("Accepted") and "Provisioned" in found:
            _check(state, "Pending", found["Provisioned"]["message"])

    def _create_request(
        self, provisioning: Any, workload: dict[str, Any], *, name: str, config: dict[str, Any]
    ) -> None:
        ns = workload["metadata"]["namespace"]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload", "name": workload["metadata"]["name"],
                 "uid": workload["metadata"].get("uid", workload["metadata"]["name"]), "controller": True,
                 "blockOwnerDeletion": True}  # fmt: skip
        assignments = {a["name"]: a for a in workload["status"]["admission"]["podSetAssignments"]}
        pod_sets = []
        for pod_set in workload["spec"]["podSets"]:
            assignment = assignments[pod_set["name"]]
            (flavor,) = set(assignment["flavors"].values())
            node_labels = self.objects["resourceflavors"][("", flavor)]["spec"].get("nodeLabels") or {}
            template = copy.deepcopy(pod_set["template"])
            spec = template.setdefault("spec", {})
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_labels}
            template_name = f"ppt-{name}-{pod_set['name']}"
            code, body = provisioning._create(provisioning.templates, "PodTemplate", "podtemplates", ns, {
                "apiVersion": "v1", "kind": "PodTemplate", "template": template, "metadata": {
                    "name": template_name, "labels": {MANAGED_LABEL: "true"}, "ownerReferences": [owner]}})  # fmt: skip
            assert code == 201, body
            pod_sets.append({"podTemplateRef": {"name": template_name}, "count": assignment["count"]})
        parameters = {**(config["spec"].get("parameters") or {}), **{
            k.removeprefix(PROVREQ_PREFIX): v for k, v in (workload["metadata"].get("annotations") or {}).items()
            if k.startswith(PROVREQ_PREFIX)}}  # fmt: skip
        code, body = provisioning._create(provisioning.requests, "ProvisioningRequest", "provisioningrequests", ns, {
            "apiVersion": "autoscaling.x-k8s.io/v1", "kind": "ProvisioningRequest",
            "metadata": {"name": name, "labels": {MANAGED_LABEL: "true"}, "ownerReferences": [owner]},
            "spec": {"provisioningClassName": config["spec"]["provisioningClassName"], "parameters": parameters,
                     "podSets": pod_sets},
        })  # fmt: skip
        assert code == 201, body
        self.requests_created.append(body)
        for pod_set in pod_sets:  # the templates' owner is now the request
            provisioning.templates[(ns, pod_set["podTemplateRef"]["name"])]["metadata"]["ownerReferences"] = [
                {"apiVersion": "autoscaling.x-k8s.io/v1", "kind": "ProvisioningRequest", "name": name,
                 "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]  # fmt: skip

    @staticmethod
    def _delete_request(provisioning: Any, key: tuple[str, str]) -> None:
        request = provisioning.requests.pop(key)
        provisioning.deleted.append(key)
        for pod_set in request["spec"]["podSets"]:
            provisioning.templates.pop((key[0], pod_set["podTemplateRef"]["name"]), None)


def _owner(obj: dict[str, Any]) -> str | None:
    owners = obj["metadata"].get("ownerReferences") or []
    return owners[0]["name"] if owners else None


def _check(state: dict[str, Any], value: str, message: str) -> None:
    if state["state"] != value:
        state["lastTransitionTime"] = now()
    state.update(state=value, message=message)


def _checks_message(checks: list[dict[str, Any]], state: str) -> str:
    """workload_controller.go `buildAdmissionChecksMessage`."""
    parts = [f'"{c["name"]}" ({c["message"]})' if c.get("message") else f'"{c["name"]}"'
             for c in sorted(checks, key=lambda c: c["name"])]  # fmt: skip
    return (
        f"{'AdmissionChecks' if len(checks) > 1 else 'AdmissionCheck'} in {state} state: {'; '.join(parts)}"
    )


def _is(workload: dict[str, Any], kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in workload["status"].get("conditions", []))


def _condition_of(workload: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in workload["status"]["conditions"] if c["type"] == kind)


def _show(amount: Fraction) -> str:
    return str(int(amount)) if amount.denominator == 1 else f"{float(amount):g}"
