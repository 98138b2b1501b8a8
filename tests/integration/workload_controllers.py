"""The JobSet and Job controllers of the cluster simulator (mixed into `cluster_sim.ClusterSim`).

- JobSet controller (kubernetes-sigs/jobset pkg/controllers/jobset_controller.go, pkg/constants):
  child Jobs `<jobset>-<replicatedJob>-<jobIndex>` labelled and annotated `jobset.sigs.k8s.io/
  jobset-name, replicatedjob-name, replicatedjob-replicas, job-index, restart-attempt`; with
  `network.enableDNSHostnames` pods get `subdomain` = `network.subdomain` or the JobSet name; a failed
  Job restarts the whole JobSet (all Jobs deleted and recreated with restart-attempt + 1) while
  `status.restarts < failurePolicy.maxRestarts`, else the JobSet fails (reason ReachedMaxRestarts, or
  FailedJobs without a failure policy); all Jobs complete -> Completed, "jobset completed
  successfully"; a Job the API server refuses -> a JobCreationFailed Warning event with the error;
  suspending a running JobSet suspends its Jobs (condition Suspended True, SuspendedJobs, "jobset is
  suspended"), resuming it merges each replicated job's pod-template labels, annotations, node selector and
  tolerations into its Jobs and resumes them (Suspended False, ResumeJobs, "jobset is resumed"): v0.12.0
  `suspendJobs`, `resumeJob`, pkg/constants (how Kueue preempts a JobSet and admits it again).
- Job controller, Indexed mode (kubernetes pkg/controller/job/indexed_job_utils.go and the Job docs):
  pods `<job>-<index>-<5 random>`, label/annotation `batch.kubernetes.io/job-completion-index`,
  env `JOB_COMPLETION_INDEX`, hostname `<job>-<index>`; a failed pod counts against `backoffLimit`
  (a pod deleted before it finished counts as failed); `failed > backoffLimit` -> condition Failed,
  BackoffLimitExceeded, and the Job's remaining pods are deleted; a suspended Job deletes its active pods
  (SIGTERM and their grace period) and creates none until resumed (kubernetes.io docs, Jobs, "Suspending a
  Job"), condition Suspended; the pods it deletes for a suspension do not count against backoffLimit
  (inferred: Kueue preempts by suspending, which would otherwise fail a Job after backoffLimit preemptions).
"""

from __future__ import annotations

import copy
import itertools
import random
import string
import time
from typing import TYPE_CHECKING, Any

import k8s_rules
from k8s_rules import Invalid

if TYPE_CHECKING:
    import threading

    from cluster_sim import Key

JS = "jobset.sigs.k8s.io/"
INDEX = "batch.kubernetes.io/job-completion-index"


class WorkloadControllers:
    """JobSet -> Jobs -> pods; the state and pod operations come from `ClusterSim`."""

    pods: dict[Key, dict[str, Any]]
    jobs: dict[Key, dict[str, Any]]
    jobsets: dict[Key, dict[str, Any]]
    lock: threading.RLock
    uids: itertools.count[int]
    failures_counted: set[str]

    if TYPE_CHECKING:  # provided by ClusterSim

        def reconcile(self) -> None: ...
        def event(self, obj: dict[str, Any], *, kind: str, type_: str, reason: str, message: str) -> None: ...
        def delete_pod(self, namespace: str, name: str) -> None: ...
        def _add_pod(self, namespace: str, pod: dict[str, Any]) -> None: ...
        def _count_failure(self, pod: dict[str, Any]) -> None: ...

    def job_pod_failed(self, job: dict[str, Any], pod: dict[str, Any]) -> None:
        """A pod of `job` failed: its podFailurePolicy decides (kubernetes pkg/controller/job/
        pod_failure_policy.go; docs "Pod failure policy"): the first rule whose onExitCodes (In/NotIn
        over the exit codes of containers that ended non-zero) or onPodConditions match acts -
        FailJob fails the Job (reason PodFailurePolicy), Ignore does not count, Count counts against
        backoffLimit; without a matching rule the failure counts."""
        status = job["status"]
        action = _policy_action(job["spec"].get("podFailurePolicy") or {}, pod)
        if action == "FailJob":
            status["failed"] = status.get("failed", 0) + 1
            status["conditions"] = [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                     "message": f"Pod {pod['metadata']['namespace']}/{pod['metadata']['name']} "
                                                "matched a FailJob rule of the pod failure policy"}]  # fmt: skip
        elif action != "Ignore":
            status["failed"] = status.get("failed", 0) + 1

    # -- Jobs ----------------------------------------------------------------------------------
    def _reconcile_job(self, key: Key) -> None:
        job = self.jobs[key]
        spec, status = job["spec"], job["status"]
        if _condition(job, "Complete"):
            return
        uid = job["metadata"]["uid"]
        pods = [
            p
            for p in self.pods.values()
            if p["metadata"]["labels"].get("batch.kubernetes.io/controller-uid") == uid
        ]
        if spec.get("suspend"):
            for pod in pods:
                if pod["status"]["phase"] in ("Pending", "Running") and not pod["metadata"].get(
                    "deletionTimestamp"
                ):
                    self.failures_counted.add(pod["metadata"]["uid"])  # a suspension is no failure
                    self.delete_pod(key[0], pod["metadata"]["name"])
            status.update(active=0, ready=0)
            _set_condition(status, "Suspended", "True", "JobSuspended", "Job suspended")
            return
        if _condition(job, "Suspended"):
            _set_condition(status, "Suspended", "False", "JobResumed", "Job resumed")
        done = {p["metadata"]["labels"][INDEX] for p in pods if p["status"]["phase"] == "Succeeded"}
        for pod in pods:
            if pod["status"]["phase"] == "Failed":
                self._count_failure(pod)
        active = [
            p
            for p in pods
            if p["status"]["phase"] in ("Pending", "Running") and not p["metadata"].get("deletionTimestamp")
        ]
        status.update(
            active=len(active),
            succeeded=len(done),
            ready=sum(1 for p in active if p["status"]["phase"] == "Running"),
        )
        if _condition(job, "Failed"):  # the controller deletes a failed Job's remaining pods
            for pod in active:
                self.delete_pod(key[0], pod["metadata"]["name"])
            return
        if status.get("failed", 0) > spec.get("backoffLimit", 6):
            status["conditions"] = [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                }
            ]
            return
        if len(done) >= spec.get("completions", 1):
            status["conditions"] = [{"type": "Complete", "status": "True"}]
            return
        running = {p["metadata"]["labels"][INDEX] for p in active}
        for index in range(spec.get("completions", 1)):
            if str(index) not in done | running:
                self._create_job_pod(key, job, index)

    def _create_job_pod(self, key: Key, job: dict[str, Any], index: int) -> None:
        template = job["spec"]["template"]
        meta = template.get("metadata") or {}
        labels = {
            **meta.get("labels", {}),
            INDEX: str(index),
            "batch.kubernetes.io/job-name": key[1],
            "job-name": key[1],
            "batch.kubernetes.io/controller-uid": job["metadata"]["uid"],
        }
        spec = _copy(template["spec"])
        spec["hostname"] = f"{key[1]}-{index}"
        for container in spec["containers"]:
            container.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": spec,
            "metadata": {
                "name": f"{key[1]}-{index}-{random5()}",
                "labels": labels,
                "annotations": {**meta.get("annotations", {}), INDEX: str(index)},
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": key[1],
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
        }
        try:
            self._add_pod(key[0], pod)  # the pass that made it schedules it
        except Invalid as error:  # the Job controller's FailedCreate event (job_controller.go)
            self.event(
                job, kind="Job", type_="Warning", reason="FailedCreate", message=f"Error creating: {error}"
            )

    # -- JobSets -------------------------------------------------------------------------------
    def create_jobset(self, namespace: str, jobset: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            jobset["metadata"].update(
                namespace=namespace, uid=f"uid-{next(self.uids)}", creationTimestamp=now()
            )
            jobset["status"] = {"restarts": 0, "replicatedJobsStatus": []}
            self.jobsets[(namespace, jobset["metadata"]["name"])] = jobset
            self.reconcile()
            return jobset

    def delete_jobset(self, namespace: str, name: str, *, propagation: str = "Background") -> bool:
        with self.lock:
            jobset = self.jobsets.get((namespace, name))
            if jobset is None:
                return False
            if propagation == "Foreground":
                jobset["metadata"].update(deletionTimestamp=now(), finalizers=["foregroundDeletion"])
            else:
                del self.jobsets[(namespace, name)]
            if propagation != "Orphan":
                self._delete_children(namespace, name)
            self.reconcile()
            return True

    def _delete_children(self, namespace: str, jobset: str, *, attempt: str | None = None) -> None:
        for key, job in list(self.jobs.items()):
            labels = job["metadata"]["labels"]
            if (
                key[0] == namespace
                and labels[JS + "jobset-name"] == jobset
                and attempt in (None, labels[JS + "restart-attempt"])
            ):
                del self.jobs[key]
                for (ns, pod), obj in list(self.pods.items()):
                    if (
                        obj["metadata"]["labels"].get("batch.kubernetes.io/controller-uid")
                        == job["metadata"]["uid"]
                    ):
                        self.delete_pod(ns, pod)

    def _reconcile_jobset(self, key: Key) -> None:
        jobset = self.jobsets[key]
        status, spec = jobset["status"], jobset["spec"]
        if jobset["metadata"].get("deletionTimestamp"):
            if not any(p["metadata"]["labels"].get(JS + "jobset-name") == key[1] for p in self.pods.values()):
                del self.jobsets[key]  # foreground: the last dependent is gone
            return
        if status.get("terminalState"):
            return
        children = [j for j in self.jobs.values() if j["metadata"]["labels"][JS + "jobset-name"] == key[1]]
        if spec.get("suspend"):
            for job in children:
                job["spec"]["suspend"] = True
            if children:
                _set_condition(status, "Suspended", "True", "SuspendedJobs", "jobset is suspended")
            return
        suspended = [j for j in children if j["spec"].get("suspend")]
        for job in suspended:  # resumeJob: what Kueue may have changed while it was suspended, merged
            template = next(
                rj
                for rj in spec["replicatedJobs"]
                if rj["name"] == job["metadata"]["labels"][JS + "replicatedjob-name"]
            )["template"]
            source, target = template["spec"]["template"], job["spec"]["template"]
            for field in ("labels", "annotations"):
                target.setdefault("metadata", {})[field] = {
                    **(target["metadata"].get(field) or {}),
                    **((source.get("metadata") or {}).get(field) or {}),
                }
            target["spec"]["nodeSelector"] = {
                **(target["spec"].get("nodeSelector") or {}),
                **(source["spec"].get("nodeSelector") or {}),
            }
            target["spec"]["tolerations"] = (target["spec"].get("tolerations") or []) + [
                t
                for t in source["spec"].get("tolerations") or []
                if t not in (target["spec"].get("tolerations") or [])
            ]
            job["spec"]["suspend"] = False
        if suspended:
            _set_condition(status, "Suspended", "False", "ResumeJobs", "jobset is resumed")
        if failed := [j for j in children if _condition(j, "Failed")]:
            self._jobset_failed(key, jobset, failed[0])
            return
        status["replicatedJobsStatus"] = [
            _replicated_status(rj["name"], children) for rj in spec["replicatedJobs"]
        ]
        if children and all(_condition(j, "Complete") for j in children) and len(children) == _num_jobs(spec):
            _finish(status, "Completed", "AllJobsCompleted", "jobset completed successfully")
            return
        for rj in spec["replicatedJobs"]:
            for index in range(rj.get("replicas", 1)):
                if (key[0], f"{key[1]}-{rj['name']}-{index}") not in self.jobs:
                    self._create_job(key, jobset, rj, index)

    def _jobset_failed(self, key: Key, jobset: dict[str, Any], failed: dict[str, Any]) -> None:
        """failurePolicy (jobset api FailurePolicy / FailurePolicyRule): the first rule whose
        onJobFailureReasons has the failed Job's condition reason (and whose targetReplicatedJobs, if
        any, has its replicated job) acts: FailJobSet, RestartJobSet (counts toward maxRestarts) or
        RestartJobSetAndIgnoreMaxRestarts; without a matching rule the JobSet restarts while
        restarts < maxRestarts."""
        status, policy = jobset["status"], jobset["spec"].get("failurePolicy")
        reason = next(c.get("reason") for c in failed["status"]["conditions"] if c["type"] == "Failed")
        replicated = failed["metadata"]["labels"][JS + "replicatedjob-name"]
        rule = next((r for r in (policy or {}).get("rules", [])
                     if reason in r.get("onJobFailureReasons", [reason])
                     and replicated in r.get("targetReplicatedJobs", [replicated])), None)  # fmt: skip
        action = rule["action"] if rule else "RestartJobSet"
        if action == "FailJobSet":
            self.event(jobset, kind="JobSet", type_="Warning", reason="FailJobSetFailurePolicyAction",
                       message="applying FailJobSet failure policy action")  # fmt: skip
            _finish(status, "Failed", "FailedJobs", "jobset failed due to one or more job failures")
            return
        within = status["restarts"] < (policy or {}).get("maxRestarts", 0)
        if policy and (within or action == "RestartJobSetAndIgnoreMaxRestarts"):
            self._delete_children(key[0], key[1], attempt=str(status["restarts"]))
            status["restarts"] += 1
            self.event(
                jobset,
                kind="JobSet",
                type_="Warning",
                reason="Restarting",
                message=f"restarting jobset, attempt {status['restarts']}",
            )
            return
        reason, message = (
            ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
            if policy
            else ("FailedJobs", "jobset failed due to one or more job failures")
        )
        _finish(status, "Failed", reason, message)

    def _create_job(self, key: Key, jobset: dict[str, Any], rj: dict[str, Any], index: int) -> None:
        name = f"{key[1]}-{rj['name']}-{index}"
        marks = {
            JS + "jobset-name": key[1],
            JS + "replicatedjob-name": rj["name"],
            JS + "replicatedjob-replicas": str(rj.get("replicas", 1)),
            JS + "job-index": str(index),
            JS + "restart-attempt": str(jobset["status"]["restarts"]),
        }
        spec = _copy(rj["template"]["spec"])
        errors = k8s_rules.pod_spec_errors(spec["template"]["spec"], "spec.template.spec")
        if len(name) > 63:  # the API server labels the pod template job-name=<name>, a label value
            errors.insert(0, ("spec.template.labels", name, "must be no more than 63 characters"))
        if errors:  # the API server refuses the Job; the controller reports it and retries
            message = k8s_rules.invalid_status("Job.batch", name, errors)["message"]
            self.event(jobset, kind="JobSet", type_="Warning", reason="JobCreationFailed", message=message)
            return
        template_meta = spec["template"].setdefault("metadata", {})
        template_meta["labels"] = {**template_meta.get("labels", {}), **marks}
        template_meta["annotations"] = {**template_meta.get("annotations", {}), **marks}
        network = jobset["spec"].get("network") or {}
        if network.get("enableDNSHostnames", True):
            spec["template"]["spec"]["subdomain"] = network.get("subdomain") or key[1]
        self.jobs[(key[0], name)] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "spec": spec,
            "status": {},
            "metadata": {
                "name": name,
                "namespace": key[0],
                "uid": f"uid-{next(self.uids)}",
                "labels": dict(marks),
                "annotations": dict(marks),
                "ownerReferences": [
                    {
                        "apiVersion": "jobset.x-k8s.io/v1alpha2",
                        "kind": "JobSet",
                        "name": key[1],
                        "uid": jobset["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
        }


def _condition(obj: dict[str, Any], kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in obj["status"].get("conditions", []))


def _set_condition(status: dict[str, Any], kind: str, value: str, reason: str, message: str) -> None:
    conditions = status.setdefault("conditions", [])
    found = next((c for c in conditions if c["type"] == kind), None)
    if found is None:
        conditions.append(found := {"type": kind})
    found.update(status=value, reason=reason, message=message)


def _finish(status: dict[str, Any], state: str, reason: str, message: str) -> None:
    status["terminalState"] = state
    status["conditions"] = [{"type": state, "status": "True", "reason": reason, "message": message}]


def _num_jobs(spec: dict[str, Any]) -> int:
    return sum(rj.get("replicas", 1) for rj in spec["replicatedJobs"])


def _replicated_status(name: str, children: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [j for j in children if j["metadata"]["labels"][JS + "replicatedjob-name"] == name]
    active = [j for j in mine if j["status"].get("active")]
    return {
        "name": name,
        "active": len(active),
        "ready": sum(1 for j in active if j["status"].get("ready") == j["spec"].get("parallelism", 1)),
        "succeeded": sum(1 for j in mine if _condition(j, "Complete")),
        "failed": sum(1 for j in mine if _condition(j, "Failed")),
        "suspended": 0,
    }


def _policy_action(policy: dict[str, Any], pod: dict[str, Any]) -> str:
    """The action of the first podFailurePolicy rule matching a failed pod ("Count" when none does)."""
    ended = [c for c in pod["status"].get("containerStatuses", []) if "terminated" in c.get("state", {})]
    conditions = {(c["type"], c["status"]) for c in pod["status"].get("conditions", [])}
    for rule in policy.get("rules", []):
        if codes := rule.get("onExitCodes"):
            for container in ended:
                code = container["state"]["terminated"]["exitCode"]
                named = codes.get("containerName") in (None, container["name"])
                if named and code != 0 and (code in codes["values"]) == (codes["operator"] == "In"):
                    return str(rule["action"])
        for wanted in rule.get("onPodConditions", []):
            if (wanted["type"], wanted.get("status", "True")) in conditions:
                return str(rule["action"])
    return "Count"


def _copy(value: Any) -> Any:
    return copy.deepcopy(value)


def random5() -> str:
    """The random suffix of a generated name."""
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
