"""What the rehearsal reads and does on the user's cluster: its KFP run, the run's JobSets and pods, the
train task's pod, the pool's size, ProvisioningRequests, the Lease and the checkpoints.

Each call is one API request with a short timeout; the waits around them (`steps.py`) carry the bounds.
The train task's pod is found as KFP's API server labels every pod of a run (`pipeline/runid`,
kubeflow/pipelines backend/src/apiserver/template/v2_template.go) and as its main container runs the
component (`--function_to_execute train_stage`, the KFP executor's argument).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchpilot.cluster.jobset import JOBSET_NAME_LABEL
from batchpilot.cluster.labels import RUN_LABEL
from batchpilot.config import ClusterConfig

RUN_ID_LABEL = "pipeline/runid"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
TRAIN_FUNCTION = "train_stage"
CALL_TIMEOUT_S = 10


@dataclass(frozen=True)
class Pod:
    name: str
    phase: str
    restart_attempt: str
    deleting: bool


class ClusterView:
    """The run's objects on the cluster through the Kubernetes API (in-cluster, else KUBECONFIG)."""

    def __init__(self, cluster: ClusterConfig, *, kfp_namespace: str) -> None:
        from batchpilot.cluster.readiness import kube_api_client

        self.cluster = cluster
        self.kfp_namespace = kfp_namespace
        self.api = kube_api_client()

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def jobsets(self, run: str) -> list[dict[str, Any]]:
        """The run's JobSets not being deleted."""
        from batchpilot.cluster import jobset

        found = jobset.list_jobsets(self.api, namespace=self.cluster.namespace, labels={RUN_LABEL: run})
        return [item for item in found if not item["metadata"].get("deletionTimestamp")]

    def all_jobsets(self, run: str) -> list[str]:
        """The names of every JobSet of the run, being deleted or not."""
        from batchpilot.cluster import jobset

        found = jobset.list_jobsets(self.api, namespace=self.cluster.namespace, labels={RUN_LABEL: run})
        return [item["metadata"]["name"] for item in found]

    def trainer_pods(self, jobset_name: str) -> list[Pod]:
        pods = self._core().list_namespaced_pod(
            self.cluster.namespace, label_selector=f"{JOBSET_NAME_LABEL}={jobset_name}",
            _request_timeout=CALL_TIMEOUT_S,
        ).items  # fmt: skip
        return [_pod(p) for p in pods]

    def log(self, pod: str, *, namespace: str | None = None) -> str:
        from kubernetes.client.rest import ApiException

        try:
            return str(
                self._core().read_namespaced_pod_log(
                    pod, namespace or self.cluster.namespace, _request_timeout=CALL_TIMEOUT_S
                )
            )
        except ApiException as error:
            if error.status in (400, 404):  # not started yet, or gone
                return ""
            raise

    def delete_pod(self, pod: str, *, namespace: str | None = None) -> None:
        self._core().delete_namespaced_pod(
            pod, namespace or self.cluster.namespace, _request_timeout=CALL_TIMEOUT_S
        )

    def train_task_pods(self, run_id: str) -> list[Pod]:
        """The run's train task pods (KFP's namespace), each attempt its own pod."""
        pods = (
            self._core()
            .list_namespaced_pod(
                self.kfp_namespace, label_selector=f"{RUN_ID_LABEL}={run_id}", _request_timeout=CALL_TIMEOUT_S
            )
            .items
        )
        return [
            _pod(p)
            for p in pods
            if any(
                TRAIN_FUNCTION in " ".join([*(c.command or []), *(c.args or [])]) for c in p.spec.containers
            )
        ]

    def provisioning_requests(self, run: str) -> list[dict[str, Any]]:
        from batchpilot.cluster.provisioning import Requests

        requests = Requests(self.api, self.cluster.namespace)
        return requests.list({RUN_LABEL: run}) if requests.served() else []

    def lease_held(self, run: str) -> bool:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        from batchpilot.cluster.ownership import lease_name

        try:
            client.CoordinationV1Api(self.api).read_namespaced_lease(
                lease_name(run), self.cluster.namespace, _request_timeout=CALL_TIMEOUT_S
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True


def _pod(pod: Any) -> Pod:
    labels = pod.metadata.labels or {}
    return Pod(
        name=str(pod.metadata.name),
        phase=str(pod.status.phase if pod.status else "Pending"),
        restart_attempt=str(labels.get(RESTART_ATTEMPT_LABEL, "0")),
        deleting=pod.metadata.deletion_timestamp is not None,
    )


class KfpRuns:
    """The rehearsal's run through the KFP API (kfp.Client, as `batchpilot submit`)."""

    def __init__(self, *, host: str, token: str | None, namespace: str | None) -> None:
        from batchpilot.kfp.submit import _client

        self.client = _client(host=host, token=token, namespace=namespace)

    def state(self, run_id: str) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED, CANCELING, CANCELED, ... (kfp_server_api V2beta1RuntimeState)."""
        return str(self.client.get_run(run_id).state or "")

    def terminate(self, run_id: str) -> None:
        self.client.terminate_run(run_id)


def latest_step(checkpoint_uri: str) -> int | None:
    from batchpilot.runstate import latest_step as latest
    from batchpilot.storage import open_storage

    return latest(open_storage(checkpoint_uri))


def _saves(checkpoint_uri: str) -> list[tuple[int, dict[str, Any]]]:
    """Every committed step with its meta (a step pruned while read is left out)."""
    from batchpilot.runstate import committed_steps, read_meta
    from batchpilot.storage import ObjectNotFound, open_storage

    storage = open_storage(checkpoint_uri)
    saves = []
    for step in committed_steps(storage):
        try:
            saves.append((step, read_meta(storage, step)))
        except ObjectNotFound:
            continue
    return saves


def saved_before(checkpoint_uri: str, *, after_step: int) -> list[int]:
    """The committed steps after `after_step` that a trainer which had not resumed from `after_step` or
    later saved (their meta's `resumed_from_step`: None, a start from scratch, or an earlier step). A meta
    without the field (an image older than this command) says nothing either way."""
    return [
        step
        for step, meta in _saves(checkpoint_uri)
        if step > after_step
        and "resumed_from_step" in meta
        and (meta["resumed_from_step"] is None or meta["resumed_from_step"] < after_step)
    ]


def resumed_from(checkpoint_uri: str) -> int | None:
    """The step the first trainer that resumed started from, as its saves' meta says (None: no save by a
    resumed trainer yet). A rehearsal's first stage starts from scratch in a folder of its own, so a save
    with `resumed_from_step` set was made after a restart."""
    points = [
        meta["resumed_from_step"]
        for _, meta in _saves(checkpoint_uri)
        if meta.get("resumed_from_step") is not None
    ]
    return min(points) if points else None


def pool_size(cluster: ClusterConfig) -> int:
    from batchpilot.cluster.gke import gke_node_pool

    return gke_node_pool(cluster).current_size()


def pool_target(cluster: ClusterConfig, pool: str) -> Any:
    """The named node pool as the Container API describes it (its config and size)."""
    from batchpilot.cluster.gke import PoolRef, container_client

    assert cluster.project and cluster.location and cluster.cluster_name
    ref = PoolRef(cluster.project, cluster.location, cluster.cluster_name, pool)
    return container_client(api_endpoint=cluster.container_api_endpoint).get_node_pool(
        request={"name": ref.name}, timeout=CALL_TIMEOUT_S
    )
