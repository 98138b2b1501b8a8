"""A simulated GKE cluster: node pools, Nodes, JobSets -> Jobs -> Pods, a scheduler and pod outcomes.

The fake Container API (`container_api_server.py`) resizes pools here and the fake Kubernetes API
(`kube_api_server.py`, with `KubeState.sim` set) serves these objects, so the real clients see one
consistent cluster. Every rule cites where it comes from (the real systems, not batchpilot):

- Nodes: `gke_nodes.py`; scheduling filters, quantities and validation: `k8s_rules.py`.
- JobSet and Job controllers: `workload_controllers.py`.
- Deletion (kubernetes.io docs "Garbage collection"): Background removes the owner at once and its
  dependents after; Foreground keeps the owner (deletionTimestamp, finalizer foregroundDeletion)
  until its dependents are gone; Orphan leaves the dependents.
- Events: FailedScheduling (Warning) from default-scheduler, Scheduled (Normal) on binding.

Without a kubelet (`run_pods=False`) a bound pod is Running at once and stays so until a test calls
`finish_pod`; with one (`pod_runner.py`) the pod's command runs as a local process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import gke_autoscaler
import gke_nodes
import k8s_rules
from k8s_rules import Invalid
from workload_controllers import WorkloadControllers, now, random5

JS = "jobset.sigs.k8s.io/"
INDEX = "batch.kubernetes.io/job-completion-index"
Key = tuple[str, str]  # (namespace, name)


class Kubelet(Protocol):
    """Runs bound pods; `pod_runner.LocalKubelet` is the one that starts real processes."""

    def start(self, pod: dict[str, Any], *, dns_names: set[str]) -> None: ...
    def stop(self, pod: dict[str, Any], *, grace_s: float) -> None: ...
    def poll(self, pod: dict[str, Any]) -> dict[str, Any] | None: ...  # a terminated state, or None
    def log(self, pod: dict[str, Any]) -> str: ...


@dataclass
class Pool:
    zones: list[str]
    machine_type: str
    autoscaling: dict[str, Any] = field(default_factory=dict)
    spot: bool = False  # Spot VMs: GKE labels their nodes (gke_nodes.gke_node)
    next_index: int = 0  # a managed instance group never reuses an instance name


@dataclass
class ClusterSim(WorkloadControllers):
    cluster: str = "train"
    ready_delay_s: float = 0.0
    gpu_delay_s: float = 0.0
    scale_down_unneeded_s: float = 600.0  # the cluster autoscaler's --scale-down-unneeded-time default
    kubelet: Kubelet | None = None
    pools: dict[str, Pool] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_born: dict[str, float] = field(default_factory=dict)
    pods: dict[Key, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    jobsets: dict[Key, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[Key, str] = field(default_factory=dict)  # pod logs a test sets (without a kubelet)
    lock: threading.RLock = field(default_factory=threading.RLock)
    uids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    idle_since: dict[str, float] = field(default_factory=dict)  # autoscaler: empty nodes, since when
    failures_counted: set[str] = field(default_factory=set)  # pod uids a Job has counted as failed
    pool_history: list[tuple[str, int]] = field(default_factory=list)  # (pool, nodes) after each setSize
    daemon_pods: dict[Key, dict[str, Any]] = field(default_factory=dict)  # system DaemonSets' pods, per node
    provisioning: Any = None  # a provisioning_controller.ProvisioningController: GKE's queued provisioning
    kueue: Any = None  # a kueue_controller.KueueController: Kueue's queues and Workloads
    trainer: Any = None  # a trainer_controller.TrainerController: Kubeflow Trainer's TrainJobs

    # -- node pools ---------------------------------------------------------------------------
    def add_pool(self, name: str, *, zones: list[str], machine_type: str, spot: bool = False) -> None:
        self.pools[name] = Pool(zones=list(zones), machine_type=machine_type, spot=spot)

    def resize_pool(self, name: str, *, per_zone: int, granted: dict[str, int] | None = None) -> None:
        """setSize: `per_zone` nodes in each zone; removed nodes take their pods with them. `granted`
        caps a zone below that (a stockout or an exhausted quota: the instance group asks for the target
        size, but only so many VMs are created)."""
        with self.lock:
            for zone in self.pools[name].zones:
                self._resize_zone(name, zone, min(per_zone, (granted or {}).get(zone, per_zone)))
            self.pool_history.append((name, self.pool_size(name)))
            self.reconcile()

    def _resize_zone(self, name: str, zone: str, count: int) -> None:
        pool = self.pools[name]
        members = [n for n, where in self.nodes.items() if where == {"pool": name, "zone": zone}]
        while len(members) < count:
            node = gke_nodes.node_name(self.cluster, name, zone, pool.next_index)
            pool.next_index += 1
            self.node_born[node] = time.monotonic()
            self.nodes[node] = {"pool": name, "zone": zone}
            members.append(node)
            machine = gke_nodes.MACHINES[pool.machine_type]
            for pod in gke_nodes.daemonset_pods(node, gpus=bool(machine.gpus)):
                self.daemon_pods[("kube-system", pod["metadata"]["name"])] = pod
        # A shrink removes empty nodes first, then the newest (which instances go is not specified).
        busy = {p["spec"].get("nodeName") for p in self.pods.values()}
        for node in sorted(members, key=lambda n: (n in busy, -self.node_born[n]))[
            : max(len(members) - count, 0)
        ]:
            self._remove_node(node)

    def pool_size(self, name: str) -> int:
        with self.lock:
            return sum(1 for where in self.nodes.values() if where["pool"] == name)

    def set_autoscaling(self, name: str, autoscaling: dict[str, Any]) -> None:
        """setAutoscaling: the bounds the simulated cluster autoscaler keeps the pool within."""
        with self.lock:
            self.pools[name].autoscaling = dict(autoscaling)
            self.reconcile()

    def _remove_node(self, node: str) -> None:
        self._shut_down(node)
        del self.nodes[node], self.node_born[node]
        for key in [k for k, pod in self.daemon_pods.items() if pod["spec"]["nodeName"] == node]:
            del self.daemon_pods[key]
        self.idle_since.pop(node, None)

    def _shut_down(self, node: str) -> None:
        """Graceful node shutdown: the kubelet marks each pod DisruptionTarget and terminates it
        (kubernetes.io docs "Node Shutdowns" and "Pod disruption conditions", reason TerminationByKubelet)."""
        for key, pod in list(self.pods.items()):
            if pod["spec"].get("nodeName") == node:
                pod["status"].setdefault("conditions", []).append({
                    "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                    "message": "Pod was terminated in response to imminent node shutdown.",
                })  # fmt: skip
                self.delete_pod(*key)

    def preempt_node(self, node: str) -> None:
        """A Spot VM preemption: the node's pods are shut down and the managed instance group
        recreates the VM under the same name, which registers again (NotReady for `ready_delay_s`)."""
        with self.lock:
            self._shut_down(node)
            self.node_born[node] = time.monotonic()
            self.reconcile()

    def node_objects(self) -> list[dict[str, Any]]:
        """Every Node as the API serves it now (Ready and GPUs follow the configured delays)."""
        with self.lock:
            now, found = time.monotonic(), []
            for name, where in sorted(self.nodes.items()):
                age = now - self.node_born[name]
                pool = self.pools[where["pool"]]
                found.append(
                    gke_nodes.gke_node(
                        name=name,
                        pool=where["pool"],
                        zone=where["zone"],
                        machine_type=pool.machine_type,
                        ready=age >= self.ready_delay_s,
                        gpus_published=age >= self.ready_delay_s + self.gpu_delay_s,
                        spot=pool.spot,
                    )
                )
            if self.provisioning is not None:
                self.provisioning.taint(found)
            return found

    # -- events -------------------------------------------------------------------------------
    def event(self, obj: dict[str, Any], *, kind: str, type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        for old in self.events:  # the event recorder aggregates repeats into a count
            involved = old["involvedObject"]
            if (involved["name"], old["reason"], old["message"]) == (meta["name"], reason, message):
                old["count"] += 1
                return
        self.events.append(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "type": type_,
                "reason": reason,
                "message": message,
                "metadata": {
                    "name": f"{meta['name']}.{next(self.uids):x}",
                    "namespace": meta.get("namespace", "default"),
                },
                "involvedObject": {
                    "kind": kind,
                    "name": meta["name"],
                    "namespace": meta.get("namespace", "default"),
                },
                "count": 1,
                "source": {"component": "default-scheduler" if kind == "Pod" else "jobset-controller"},
            }
        )

    # -- pods ---------------------------------------------------------------------------------
    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        """POST a pod: validated like the API server (Invalid on a bad resource name), then scheduled."""
        with self.lock:
            self._add_pod(namespace, pod)
            self.reconcile()
            return pod

    def _add_pod(self, namespace: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"].get("name") or pod["metadata"]["generateName"] + random5()
        if errors := k8s_rules.pod_spec_errors(pod["spec"]):
            raise Invalid(k8s_rules.invalid_status("Pod", name, errors))
        with self.lock:
            pod["metadata"].update(name=name, namespace=namespace, uid=f"uid-{next(self.uids)}")
            pod["metadata"].setdefault("creationTimestamp", now())
            pod["spec"].setdefault("terminationGracePeriodSeconds", 30)  # the API default
            pod["status"] = {"phase": "Pending", "conditions": []}
            self.pods[(namespace, name)] = pod

    def delete_pod(self, namespace: str, name: str) -> None:
        """Graceful deletion: the kubelet gets SIGTERM and the grace period; the object goes after."""
        with self.lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                return
            pod["metadata"].setdefault("deletionTimestamp", now())
            if self.kubelet and pod["status"]["phase"] == "Running":
                self.kubelet.stop(pod, grace_s=float(pod["spec"]["terminationGracePeriodSeconds"]))
            else:
                self._forget_pod(namespace, name)

    def _forget_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name))
        if pod["status"]["phase"] != "Succeeded":  # a pod deleted before it finished counts as failed
            self._count_failure(pod)

    def _count_failure(self, pod: dict[str, Any]) -> None:
        owner = pod["metadata"].get("labels", {}).get("batch.kubernetes.io/controller-uid")
        if pod["metadata"]["uid"] in self.failures_counted or owner is None:
            return
        self.failures_counted.add(pod["metadata"]["uid"])
        for job in self.jobs.values():
            if job["metadata"]["uid"] == owner:
                self.job_pod_failed(job, pod)

    def finish_pod(self, namespace: str, name: str, *, exit_code: int, reason: str | None = None) -> None:
        """Ends a running pod as its container would (only without a kubelet)."""
        with self.lock:
            _terminate(self.pods[(namespace, name)], exit_code=exit_code, reason=reason)
            self.reconcile()

    def pod_log(self, namespace: str, name: str) -> str:
        with self.lock:
            pod = self.pods[(namespace, name)]
            return self.kubelet.log(pod) if self.kubelet else self.logs.get((namespace, name), "")

    def pod_dns_names(self) -> set[str]:
        """`<hostname>.<subdomain>` of every pod that has both (its headless-service DNS name)."""
        with self.lock:
            return {
                f"{p['spec']['hostname']}.{p['spec']['subdomain']}"
                for p in self.pods.values()
                if p["spec"].get("hostname") and p["spec"].get("subdomain")
            }

    def select(
        self, objects: dict[Key, dict[str, Any]], namespace: str | None, selector: str
    ) -> list[dict[str, Any]]:
        with self.lock:
            return [
                obj
                for (ns, _), obj in sorted(objects.items())
                if namespace in (None, ns)
                and k8s_rules.selector_matches(obj["metadata"].get("labels", {}), selector)
            ]

    # -- the control loop ---------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, *, interval_s: float = 0.05) -> Iterator[ClusterSim]:
        """Runs the control loop in a thread (needed for a kubelet; requests also reconcile)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.reconcile()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def reconcile(self) -> None:
        """One pass of every controller: JobSets, Jobs, the scheduler, the kubelet."""
        with self.lock:
            if self.kueue is not None:
                self.kueue.reconcile(self)
            if self.trainer is not None:
                self.trainer.reconcile(self)
            for key in list(self.jobsets):
                self._reconcile_jobset(key)
            for key in list(self.jobs):
                self._reconcile_job(key)
            if self.provisioning is not None:
                self.provisioning.reconcile(self)
            self._schedule()
            gke_autoscaler.autoscale(self, scale_down_unneeded_s=self.scale_down_unneeded_s)
            self._run_kubelet()

    def _schedule(self) -> None:
        nodes = self.node_objects()
        used: dict[str, dict[str, Fraction]] = {n["metadata"]["name"]: {} for n in nodes}
        for pod in [*self.pods.values(), *self.daemon_pods.values()]:
            if (bound := pod["spec"].get("nodeName")) in used and pod["status"]["phase"] in (
                "Pending",
                "Running",
            ):
                for resource, amount in k8s_rules.pod_requests(pod["spec"]).items():
                    used[bound][resource] = used[bound].get(resource, Fraction(0)) + amount
        for pod in self.pods.values():
            if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                continue
            reasons: list[list[str]] = []  # per node, from the first filter that rejects it
            for node in nodes:
                name = node["metadata"]["name"]
                why = k8s_rules.unfit_reasons(pod, node, used[name])
                if not why and self.provisioning is not None:
                    why = self.provisioning.unfit(pod, name, self)
                if not why:
                    pod["spec"]["nodeName"] = name
                    for resource, amount in k8s_rules.pod_requests(pod["spec"]).items():
                        used[name][resource] = used[name].get(resource, Fraction(0)) + amount
                    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
                    self.event(
                        pod,
                        kind="Pod",
                        type_="Normal",
                        reason="Scheduled",
                        message=f"Successfully assigned {pod['metadata']['namespace']}/{pod['metadata']['name']} to {name}",
                    )
                    break
                reasons.append(why)
            else:
                message = k8s_rules.failed_scheduling_message(len(nodes), reasons)
                pod["status"]["conditions"] = [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                ]
                self.event(pod, kind="Pod", type_="Warning", reason="FailedScheduling", message=message)

    def _run_kubelet(self) -> None:
        for (namespace, name), pod in list(self.pods.items()):
            status = pod["status"]
            if (
                pod["spec"].get("nodeName")
                and status["phase"] == "Pending"
                and not pod["metadata"].get("deletionTimestamp")
            ):
                status.update(
                    phase="Running",
                    startTime=now(),
                    containerStatuses=[
                        {
                            "name": c["name"],
                            "image": c["image"],
                            "imageID": f"sim://{c['image']}",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": now()}},
                        }
                        for c in pod["spec"]["containers"]
                    ],
                )
                if self.kubelet:
                    self.kubelet.start(pod, dns_names=self.pod_dns_names())
            elif self.kubelet and status["phase"] == "Running" and (ended := self.kubelet.poll(pod)):
                _terminate(pod, exit_code=ended["exitCode"], reason=ended.get("reason"))
            if pod["metadata"].get("deletionTimestamp") and (
                not self.kubelet or status["phase"] != "Running"
            ):
                self._forget_pod(namespace, name)


def _terminate(pod: dict[str, Any], *, exit_code: int, reason: str | None) -> None:
    """Pod status of an ended container: Succeeded on exit 0, else Failed (reason Error/OOMKilled).

    A pod past its activeDeadlineSeconds fails with pod-level reason DeadlineExceeded (kubelet
    active_deadline.go) and its container shows the kill (Error, 137)."""
    pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
    if reason == "DeadlineExceeded":
        pod["status"].update(
            reason=reason, message="Pod was active on the node longer than the specified deadline"
        )
        reason = "Error"
    reason = reason or ("Completed" if exit_code == 0 else "Error")
    for container in pod["status"].get("containerStatuses", []):
        container.update(
            ready=False, state={"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now()}}
        )
