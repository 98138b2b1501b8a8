"""The Kubernetes API routes served from a `ClusterSim` (what `kube_api_server` uses when `sim` is set).

Shapes follow the Kubernetes API conventions (kubernetes.io docs "API Concepts"): lists are
`<Kind>List` with `items`; `labelSelector` filters lists; `fieldSelector` on events supports
`involvedObject.name` / `involvedObject.kind`; DELETE takes `propagationPolicy` from the query or a
`DeleteOptions` body (Background is the default for JobSets, as for every custom resource); errors are
`Status` objects (404 NotFound, 409 AlreadyExists, 422 Invalid).

Routes: nodes (list, get); pods (list in a namespace or all, create, get, delete, log); events (list);
batch/v1 Jobs (list, get); JobSets jobset.x-k8s.io/v1alpha2 (create, list, get, delete); with GKE's queued
provisioning (`sim.provisioning`), PodTemplates and ProvisioningRequests (provisioning_controller.py); with Kueue
(`sim.kueue`), its objects (kueue_controller.py); with Kubeflow Trainer (`sim.trainer`), ClusterTrainingRuntimes
and TrainJobs (trainer_controller.py). A JobSet create passes Kueue's webhook (a queued JobSet is
suspended), the API server's name check and the JobSet webhook's name rules first (`jobset_webhook.py`).
"""

from __future__ import annotations

import re
from typing import Any

import jobset_webhook
from cluster_sim import ClusterSim, Invalid

_NS = r"/namespaces/(?P<ns>[^/]+)"
ROUTES = [
    ("nodes", re.compile(r"^/api/v1/nodes(?:/(?P<name>[^/]+))?$")),
    ("pod_log", re.compile(rf"^/api/v1{_NS}/pods/(?P<name>[^/]+)/log$")),
    ("pods", re.compile(rf"^/api/v1(?:{_NS})?/pods(?:/(?P<name>[^/]+))?$")),
    ("events", re.compile(rf"^/api/v1(?:{_NS})?/events$")),
    ("jobs", re.compile(rf"^/apis/batch/v1(?:{_NS})?/jobs(?:/(?P<name>[^/]+))?$")),
    ("jobsets", re.compile(rf"^/apis/jobset.x-k8s.io/v1alpha2(?:{_NS})?/jobsets(?:/(?P<name>[^/]+))?$")),
]
KINDS = {"nodes": "Node", "pods": "Pod", "jobs": "Job", "jobsets": "JobSet", "events": "Event"}
GROUPS = {"jobs": "batch", "jobsets": "jobset.x-k8s.io"}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A failure `Status` as the API server answers it."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def _not_found(route: str, name: str) -> tuple[int, dict[str, Any]]:
    resource = f"{route}.{GROUPS[route]}" if route in GROUPS else route
    return 404, status(404, "NotFound", f'{resource} "{name}" not found')


def _list(route: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    version = {"jobs": "batch/v1", "jobsets": "jobset.x-k8s.io/v1alpha2"}.get(route, "v1")
    return {"apiVersion": version, "kind": f"{KINDS[route]}List", "metadata": {"resourceVersion": "1"},
            "items": items}  # fmt: skip


def route(
    sim: ClusterSim, method: str, path: str, query: dict[str, list[str]], body: Any
) -> tuple[int, Any] | None:
    """The (code, payload) for one request, or None when no route matches."""
    if sim.provisioning is not None and sim.provisioning.serves(path):  # PodTemplates, ProvisioningRequests
        with sim.lock:
            sim.reconcile()
            return sim.provisioning.route(sim, method, path, query, body)  # type: ignore[no-any-return]
    if sim.kueue is not None and sim.kueue.serves(path):  # Kueue's queues and Workloads
        with sim.lock:
            sim.reconcile()
            return sim.kueue.route(method, path, query)  # type: ignore[no-any-return]
    if sim.trainer is not None and sim.trainer.serves(path):  # Kubeflow Trainer's runtimes and TrainJobs
        with sim.lock:
            sim.reconcile()
            return sim.trainer.route(sim, method, path, query, body)  # type: ignore[no-any-return]
    for name, pattern in ROUTES:
        if match := pattern.match(path):
            with sim.lock:
                sim.reconcile()
                return _serve(sim, name, method, match.groupdict(), query, body)
    return None


def _serve(
    sim: ClusterSim,
    route: str,
    method: str,
    where: dict[str, str | None],
    query: dict[str, list[str]],
    body: Any,
) -> tuple[int, Any]:
    selector = query.get("labelSelector", [""])[0]
    ns, name = where.get("ns"), where.get("name")
    if route == "nodes":
        nodes = sim.node_objects()
        if name:
            found = [n for n in nodes if n["metadata"]["name"] == name]
            return (200, found[0]) if found else _not_found("nodes", name)
        return 200, _list(route, [n for n in nodes if _labels_match(n, selector)])
    if route == "pod_log":
        assert ns and name
        return (200, sim.pod_log(ns, name)) if (ns, name) in sim.pods else _not_found("pods", name)
    if route == "events":
        return 200, _list(route, [e for e in sim.events if _event_matches(e, ns, query)])
    objects = {"pods": sim.pods, "jobs": sim.jobs, "jobsets": sim.jobsets}[route]
    if method == "GET" and not name:
        if route == "pods":  # the system DaemonSets' pods are listed too (read-only here)
            found = sim.select({**sim.daemon_pods, **sim.pods}, ns, selector)
            return 200, _list(route, [p for p in found if _pod_fields_match(p, query)])
        return 200, _list(route, sim.select(objects, ns, selector))
    if method == "POST" and ns and not name:
        return _create(sim, route, ns, body)
    if not (ns and name):
        return 405, status(405, "MethodNotAllowed", f"{method} is not supported here")
    if (ns, name) not in objects:
        return _not_found(route, name)
    if method == "GET":
        return 200, objects[(ns, name)]
    if method == "DELETE":
        deleted = objects[(ns, name)]
        policy = (
            query.get("propagationPolicy", [None])[0] or (body or {}).get("propagationPolicy") or "Background"
        )
        if route == "jobsets":
            sim.delete_jobset(ns, name, propagation=policy)
        elif route == "pods":
            sim.delete_pod(ns, name)
        else:
            return 405, status(405, "MethodNotAllowed", "deleting Jobs directly is not simulated")
        return 200, deleted
    return 405, status(405, "MethodNotAllowed", f"{method} is not supported here")


def _create(sim: ClusterSim, route: str, ns: str, body: Any) -> tuple[int, Any]:
    name = body.get("metadata", {}).get("name")
    objects = {"pods": sim.pods, "jobsets": sim.jobsets}.get(route)
    if objects is None:
        return 405, status(405, "MethodNotAllowed", f"creating {route} is not simulated")
    # Mutating admission (Kueue's JobSet webhook), then validation and validating admission, all before
    # storage, hence before AlreadyExists (store.go).
    if route == "jobsets" and sim.kueue is not None and (denied := sim.kueue.admit_jobset(body)):
        return 422, denied
    if route == "jobsets" and (denied := jobset_webhook.admit_create(body)):
        return 422, denied
    if name and (ns, name) in objects:
        resource = f"{route}.{GROUPS[route]}" if route in GROUPS else route
        return 409, status(409, "AlreadyExists", f'{resource} "{name}" already exists')
    try:
        created = sim.create_pod(ns, body) if route == "pods" else sim.create_jobset(ns, body)
    except Invalid as error:
        return 422, error.status
    return 201, created


def _labels_match(obj: dict[str, Any], selector: str) -> bool:
    from k8s_rules import selector_matches

    return selector_matches(obj["metadata"].get("labels", {}), selector)


def _pod_fields_match(pod: dict[str, Any], query: dict[str, list[str]]) -> bool:
    """Pod field selectors `spec.nodeName` and `status.phase`, with = or != (kubernetes.io docs "Field
    Selectors": both are supported for pods; terms are ANDed)."""
    values = {
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "status.phase": pod["status"].get("phase", ""),
    }
    for term in filter(None, query.get("fieldSelector", [""])[0].split(",")):
        key, negate, value = re.match(r"^([^!=]+)(!?)==?(.*)$", term).groups()  # type: ignore[union-attr]
        if key not in values:
            raise ValueError(f"field selector {key!r} is not simulated for pods")
        if (values[key] == value) == bool(negate):
            return False
    return True


def _event_matches(event: dict[str, Any], ns: str | None, query: dict[str, list[str]]) -> bool:
    if ns not in (None, event["metadata"]["namespace"]):
        return False
    for term in filter(None, query.get("fieldSelector", [""])[0].split(",")):
        key, _, value = term.partition("=")
        field = key.removeprefix("involvedObject.")
        if event["involvedObject"].get(field) != value:
            return False
    return True
