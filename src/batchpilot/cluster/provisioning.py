"""Capacity by flex-start with queued provisioning (`cluster.provisioning: flex-start`): each launch asks
GKE for its node count with a ProvisioningRequest and trains once GKE has granted every node at once.

Sources (facts, not text):
- the ProvisioningRequest API (kubernetes/autoscaler `cluster-autoscaler/apis/provisioningrequest/
  autoscaling.x-k8s.io/v1/types.go`, CRD `autoscaling.x-k8s.io_provisioningrequests.yaml`): group
  `autoscaling.x-k8s.io`, version `v1` (the stored version; `v1beta1` is deprecated, and GKE serves `v1`
  from 1.32.2-gke.1652000, the version flex-start needs), `spec.provisioningClassName`,
  `spec.podSets[].count` / `podTemplateRef.name` (a PodTemplate in the same namespace whose
  scheduling fields must match the pods that consume the request), `spec.parameters` (strings);
  conditions Accepted, Provisioned, Failed, BookingExpired, CapacityRevoked; pods consume a request
  with both annotations `autoscaling.x-k8s.io/consume-provisioning-request` (its name) and
  `autoscaling.x-k8s.io/provisioning-class-name` (its class), the older `cluster-autoscaler.kubernetes.io/`
  prefix being deprecated;
- the request's life (cluster-autoscaler `proposals/provisioning-request.md`, "CRD lifecycle"): the
  request and its PodTemplate are created first, the consuming pods once the request is Provisioned;
  pods created earlier "fire and forget" stay unschedulable meanwhile, and deleting the request cancels
  it and lets the autoscaler scale its nodes down;
- GKE ("Run a large-scale workload with flex-start with queued provisioning"): class
  `queued-provisioning.gke.io`, on a node pool created with `--flex-start --enable-queued-provisioning`,
  autoscaling on and no reservation affinity; GKE grants all of a request's nodes at once or none;
  parameter `maxRunDurationSeconds` (at most and by default seven days) bounds how long the nodes stay;
  GKE taints such nodes `cloud.google.com/gke-queued=true:NoSchedule`; its Standard example labels the
  PodTemplate `cloud.google.com/apply-warden-policies: "true"` (GKE needs it to calculate the node resources
  the pods require) and selects `cloud.google.com/gke-flex-start: "true"` in the pods.

Why the JobSet is created only once the request is Provisioned (the lifecycle above, not fire and
forget): its pods would otherwise sit Pending for as long as GKE queues the request, and the launch's
pending bound (`cluster.pending_timeout_s`) would end a launch that is only waiting for capacity; the
wait here is bounded by `cluster.capacity_timeout_s` instead and says what GKE reports while it lasts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from batchpilot.cluster.eviction import Evicted
from batchpilot.cluster.labels import PLAN_LABEL, RUN_LABEL, STAGE_LABEL
from batchpilot.cluster.objects import conditions, is_true
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

GROUP = "autoscaling.x-k8s.io"
VERSION = "v1"
PLURAL = "provisioningrequests"
PROVISIONING_CLASS = "queued-provisioning.gke.io"
CONSUME_ANNOTATION = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
QUEUED_TAINT_KEY = "cloud.google.com/gke-queued"
WARDEN_LABEL = "cloud.google.com/apply-warden-policies"
"""On the PodTemplate: GKE's guide has it there, "necessary for GKE to calculate node resource requirements"."""
MAX_RUN_DURATION_PARAMETER = "maxRunDurationSeconds"
MAX_RUN_DURATION_S = 7 * 24 * 3600  # GKE's limit and default for flex-start nodes
KUEUE_PARAMETER_PREFIX = "provreq.kueue.x-k8s.io/"
# Conditions that end a request's use: no node is (or will be) there for the launch. BookingExpired ends only
# the booking of nodes no pod took yet: the cluster autoscaler sets it 10 minutes after Provisioned
# (cluster-autoscaler provisioningrequest/processors/provreq, defaultReservationTime), while the launch's
# pods hold the nodes; a request whose pods run is still the launch's (`consumed`).
ENDED = ("Failed", "BookingExpired", "CapacityRevoked")
BOOKING_EXPIRED = "BookingExpired"
HOW_TO_CREATE_POOL = (
    "create the pool with `gcloud container node-pools create POOL --flex-start --enable-queued-provisioning "
    "--enable-autoscaling --num-nodes=0 --total-min-nodes=0 --total-max-nodes=MAX --location-policy=ANY "
    "--reservation-affinity=none ...` (docs/cluster.md, Flex-start), or use cluster.provisioning: resize"
)


# --- manifests (pure) ------------------------------------------------------------------------------


def consume_request(pod: dict[str, Any], *, name: str) -> None:
    """Makes a rendered pod template (`{"metadata", "spec"}`) consume request `name`: both annotations, and
    the toleration of the taint GKE puts on queued-provisioning nodes (changed in place)."""
    annotations = pod.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[CONSUME_ANNOTATION] = name
    annotations[CLASS_ANNOTATION] = PROVISIONING_CLASS
    tolerate_queued_nodes(pod)


def tolerate_queued_nodes(pod: dict[str, Any]) -> None:
    """The toleration of the taint GKE puts on queued-provisioning nodes, on a rendered pod template (in
    place). Through Kueue (`cluster.kueue_queue`) the pods get only this: Kueue writes the consume
    annotations itself at admission, naming its own request."""
    tolerations = pod.setdefault("spec", {}).setdefault("tolerations", [])
    if not any(t.get("key") == QUEUED_TAINT_KEY for t in tolerations):
        tolerations.append(
            {"key": QUEUED_TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        )


def pod_template_manifest(
    *, name: str, namespace: str, labels: dict[str, str], pod: dict[str, Any]
) -> dict[str, Any]:
    """The PodTemplate a request refers to: the trainer pods' own template (resources, node selector,
    tolerations), so that the nodes GKE brings are the ones those pods fit."""
    template = copy.deepcopy(pod)
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": {**labels, WARDEN_LABEL: "true"}},
        "template": template,
    }


def provisioning_request_manifest(
    *, name: str, namespace: str, labels: dict[str, str], count: int, max_run_duration_s: int
) -> dict[str, Any]:
    """The ProvisioningRequest for `count` nodes (one trainer pod each) from PodTemplate `name`."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ProvisioningRequest",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "provisioningClassName": PROVISIONING_CLASS,
            "parameters": {MAX_RUN_DURATION_PARAMETER: str(max_run_duration_s)},
            "podSets": [{"count": count, "podTemplateRef": {"name": name}}],
        },
    }


def kueue_request_annotations(stage_timeout_s: float) -> dict[str, str]:
    """The JobSet's annotations that Kueue's ProvisioningRequest admission check passes on as its request's
    parameters (Kueue v0.19.2: jobframework/utils.go copies a job's `provreq.kueue.x-k8s.io/` annotations to
    its Workload; provisioning.go `passProvReqParams` makes each a parameter of the request, overriding the
    ProvisioningRequestConfig's): the nodes' `maxRunDurationSeconds`, as GKE's guide sets it per job."""
    return {KUEUE_PARAMETER_PREFIX + MAX_RUN_DURATION_PARAMETER: str(max_run_duration_s(stage_timeout_s))}


def max_run_duration_s(stage_timeout_s: float) -> int:
    """The nodes need not outlive the train task that follows them (`cluster.stage_timeout_s`), and GKE
    keeps flex-start nodes seven days at most."""
    return min(int(stage_timeout_s), MAX_RUN_DURATION_S)


def ended(request: dict[str, Any], *, consumed: bool = False) -> bool:
    """Whether the request can no longer bring or hold the launch's nodes. `consumed`: the launch's pods run
    on its nodes, so an expired booking (after Provisioned) does not end it."""
    return any(
        is_true(request, kind)
        for kind in ENDED
        if not (consumed and kind == BOOKING_EXPIRED and is_true(request, "Provisioned"))
    )


def describe(request: dict[str, Any]) -> str:
    """The request's state in one phrase, e.g. `Accepted, not Provisioned (NotProvisioned: ...)`."""
    found = conditions(request)
    if not found:
        return "not accepted yet (no condition)"
    for kind in ENDED:
        if found.get(kind, {}).get("status") == "True":
            return f"{kind} ({found[kind].get('reason', '')}: {found[kind].get('message', '')})"
    if found.get("Provisioned", {}).get("status") == "True":
        return "Provisioned"
    accepted = found.get("Accepted", {})
    state = (
        "Accepted" if accepted.get("status") == "True" else f"not Accepted ({accepted.get('reason', '-')})"
    )
    provisioned = found.get("Provisioned")
    if provisioned is None:
        return f"{state}, not Provisioned yet"
    return f"{state}, not Provisioned ({provisioned.get('reason', '')}: {provisioned.get('message', '')})"


# --- the API ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """ProvisioningRequests and their PodTemplates in one namespace (CustomObjectsApi, CoreV1Api)."""

    api_client: Any
    namespace: str

    def _objects(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def _args(self) -> dict[str, str]:
        return {"group": GROUP, "version": VERSION, "namespace": self.namespace, "plural": PLURAL}

    def list(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        from batchpilot.cluster.jobset import label_selector

        with _refusals(self.namespace, "list"):
            found = self._objects().list_namespaced_custom_object(
                label_selector=label_selector(labels), **self._args()
            )
        return list(found.get("items", []))

    def served(self) -> bool:
        """Whether the API server serves ProvisioningRequests at all (a 404 on the list: no such API)."""
        from kubernetes.client.rest import ApiException

        try:
            self._objects().list_namespaced_custom_object(limit=1, **self._args())
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def get(self, name: str) -> dict[str, Any]:
        return dict(self._objects().get_namespaced_custom_object(name=name, **self._args()))

    def create(self, *, template: dict[str, Any], request: dict[str, Any]) -> None:
        """Creates the PodTemplate, then the request that refers to it."""
        with _refusals(self.namespace, "create"):
            self._core().create_namespaced_pod_template(self.namespace, template)
            self._objects().create_namespaced_custom_object(body=request, **self._args())

    def delete(self, name: str, *, why: str) -> None:
        """Deletes request `name` and its PodTemplate (either already gone is fine)."""
        from kubernetes.client.rest import ApiException

        logger.info("deleting ProvisioningRequest %s and its PodTemplate (%s)", name, why)
        for delete in (
            lambda: self._objects().delete_namespaced_custom_object(name=name, **self._args()),
            lambda: self._core().delete_namespaced_pod_template(name, self.namespace),
        ):
            try:
                delete()
            except ApiException as error:
                if error.status != 404:
                    raise


@contextlib.contextmanager
def _refusals(namespace: str, verb: str) -> Iterator[None]:
    """The API server's refusals as one line: no permission (403), or no ProvisioningRequest API (404: a GKE
    older than the version flex-start needs, which serves `autoscaling.x-k8s.io/v1`)."""
    from kubernetes.client.rest import ApiException

    try:
        yield
    except ApiException as error:
        if error.status == 403:
            raise BatchpilotError(
                "cluster.provisioning",
                f"the task's service account may not {verb} provisioningrequests.{GROUP} or podtemplates in "
                f"namespace {namespace} (HTTP 403)",
                "grant both (get, list, create, delete) to the KFP run's account in that namespace",
            ) from None
        if error.status == 404 and verb == "list":
            raise BatchpilotError(
                "cluster.provisioning",
                f"the cluster serves no {GROUP}/{VERSION} ProvisioningRequests (HTTP 404)",
                "use a GKE version with flex-start (1.32.2-gke.1652000 or later), or cluster.provisioning: resize",
            ) from None
        raise


# --- a launch's request ----------------------------------------------------------------------------


def adopt_or_clear(
    requests: Requests, *, labels: dict[str, str], name: str, consumed: bool = False
) -> dict[str, Any] | None:
    """The launch's request of this plan that can still bring or hold its nodes (a retried launch: it is
    followed, not asked for twice), else None, after deleting the launch's other requests (another plan,
    Failed, CapacityRevoked, being deleted, or BookingExpired unless `consumed`: the launch's JobSet runs on
    its nodes, and the retry adopts both)."""
    existing = requests.list({RUN_LABEL: labels[RUN_LABEL], STAGE_LABEL: labels[STAGE_LABEL]})
    live = [
        item
        for item in existing
        if (item["metadata"].get("labels") or {}).get(PLAN_LABEL) == labels[PLAN_LABEL]
        and not item["metadata"].get("deletionTimestamp")
        and not ended(item, consumed=consumed)
    ]
    for item in existing:
        if item not in live[:1]:
            requests.delete(item["metadata"]["name"], why=f"{describe(item)}; replaced by this launch")
    if live:
        logger.info(
            "%s: adopting its ProvisioningRequest %s (%s)",
            name,
            live[0]["metadata"]["name"],
            describe(live[0]),
        )
        return live[0]
    return None


def wait_provisioned(
    requests: Requests,
    *,
    name: str,
    count: int,
    timeout_s: float,
    poll_s: float,
    consumed: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Waits until request `name` is Provisioned, logging each state GKE reports as it changes; raises in
    one line when it fails (at once) or is not provisioned within `timeout_s`. `consumed`: the launch's pods
    already run on its nodes (see `ended`)."""
    deadline = clock() + timeout_s
    said = ""
    while True:
        request = requests.get(name)
        state = describe(request)
        if state != said:
            logger.info("ProvisioningRequest %s for %d node(s): %s", name, count, state)
            said = state
        if is_true(request, "Provisioned") and not ended(request, consumed=consumed):
            return
        if ended(request, consumed=consumed):
            raise BatchpilotError(
                "cluster.provisioning",
                f"ProvisioningRequest {name} for {count} node(s) ended: {state}; it is deleted",
                "see what GKE says above: a pool created for queued provisioning whose autoscaling maximum "
                "admits the launch and whose machine type fits the trainer pods, a GPU type the zone offers, "
                "quota; or use cluster.provisioning: resize",
            )
        if clock() >= deadline:
            raise BatchpilotError(
                "cluster.capacity_timeout_s",
                f"ProvisioningRequest {name} for {count} node(s) not provisioned after {timeout_s:g}s: {state}; "
                "it is deleted",
                "raise cluster.capacity_timeout_s (GKE queues flex-start requests until every node is free), "
                "or plan fewer nodes (cluster.max_nodes)",
            )
        time.sleep(poll_s)


@dataclass
class Handover:
    """What a flex-start block may do with its request before it ends: leave it to another launch."""

    name: str
    count: int
    to: str | None = None

    def hand_over(self, launch: str) -> None:
        self.to = launch
        logger.info("keeping ProvisioningRequest %s and its %d node(s) for %s", self.name, self.count, launch)


def _create(
    requests: Requests, *, name: str, labels: dict[str, str], pod: dict[str, Any], count: int,
    stage_timeout_s: float,
) -> None:  # fmt: skip
    """Creates the launch's PodTemplate (from its trainer pod template `pod`) and ProvisioningRequest."""
    template = pod_template_manifest(name=name, namespace=requests.namespace, labels=labels, pod=pod)
    request = provisioning_request_manifest(
        name=name, namespace=requests.namespace, labels=labels, count=count,
        max_run_duration_s=max_run_duration_s(stage_timeout_s),
    )  # fmt: skip
    requests.create(template=template, request=request)


@contextlib.contextmanager
def flex_start_capacity(
    *,
    api_client: Any,
    namespace: str,
    name: str,
    labels: dict[str, str],
    pod: dict[str, Any],
    count: int,
    timeout_s: float,
    stage_timeout_s: float,
    consumed: bool = False,
    poll_s: float = 2.0,
) -> Iterator[Handover]:
    """The launch's nodes through a ProvisioningRequest named `name` (the JobSet's name): adopts the
    launch's live request or creates one (with its PodTemplate, from the trainer pod template `pod`),
    waits until it is Provisioned, runs the block, then deletes both whatever happened, except when this
    task's pod is evicted (`Evicted`): the retry adopts the JobSet and the request that holds its nodes.
    `consumed`: the launch's JobSet runs (a retried task adopts it), so its request's expired booking is no
    end (`ended`). The block may hand the request over (`Handover.to`): it then stays for the launch that
    adopts it (the canary, having run on the first launch's nodes, leaves them to it).
    """
    requests = Requests(api_client, namespace)
    handover = Handover(name=name, count=count)
    keep = False
    try:
        if adopt_or_clear(requests, labels=labels, name=name, consumed=consumed) is None:
            logger.info(
                "asking GKE for %d node(s) at once: ProvisioningRequest %s (class %s), waiting up to %gs",
                count, name, PROVISIONING_CLASS, timeout_s,
            )  # fmt: skip
            _create(requests, name=name, labels=labels, pod=pod, count=count, stage_timeout_s=stage_timeout_s)
        wait_provisioned(
            requests, name=name, count=count, timeout_s=timeout_s, poll_s=poll_s, consumed=consumed
        )
        yield handover
        keep = handover.to is not None
    except Evicted:
        keep = True
        logger.warning("%s: leaving ProvisioningRequest %s for the retry to adopt", name, name)
        raise
    finally:
        if not keep:
            requests.delete(name, why="the launch ended")


def ask_ahead(
    *,
    api_client: Any,
    namespace: str,
    name: str,
    labels: dict[str, str],
    pod: dict[str, Any],
    count: int,
    stage_timeout_s: float,
) -> str:
    """Asks GKE for launch `name`'s nodes before the launch starts (`cluster.capacity_ahead`): creates its
    request and PodTemplate as `flex_start_capacity` would, unless a live one of the same plan is there, and
    neither waits nor deletes: the launch adopts the request (`adopt_or_clear`), and the exit handler deletes
    it with the run's others. Returns what it did, in words."""
    requests = Requests(api_client, namespace)
    live = adopt_or_clear(requests, labels=labels, name=name)
    if live is not None:
        return f"ProvisioningRequest {name} for {count} node(s) was asked for already ({describe(live)})"
    _create(requests, name=name, labels=labels, pod=pod, count=count, stage_timeout_s=stage_timeout_s)
    return f"asked GKE for {count} node(s) ahead: ProvisioningRequest {name} (class {PROVISIONING_CLASS})"


def delete_run_requests(
    *, api_client: Any, namespace: str, run: str, unserved_is_none: bool = False
) -> list[str]:
    """Deletes every ProvisioningRequest of the run (label RUN_LABEL=`run`) and its PodTemplate; returns
    their names. The exit handler calls it: a cancelled or evicted launch's request must not keep asking
    GKE for nodes (or holding them) after the run. `unserved_is_none`: a cluster that serves no
    ProvisioningRequest API holds none (the orphan reaper, which does not know how the run provisioned)."""
    requests = Requests(api_client, namespace)
    if unserved_is_none and not requests.served():
        return []
    names = [item["metadata"]["name"] for item in requests.list({RUN_LABEL: run})]
    for name in names:
        requests.delete(name, why=f"the end of run {run}")
    return names
