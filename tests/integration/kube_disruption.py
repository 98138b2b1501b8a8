"""PodDisruptionBudgets (policy/v1), the Eviction API and a pod's label patch, for the simulated cluster.

Rules, and where each comes from:
- the disruption controller (kubernetes pkg/controller/disruption/disruption.go): a budget with an integer
  `minAvailable` wants that many healthy pods (desiredHealthy) and expects every pod its selector matches
  (getExpectedPodCount, no controller looked up); healthy pods are those Ready, not being deleted and not
  already being disrupted (countHealthyPods; here: Running, as the simulator's pods have no probes);
  `disruptionsAllowed = healthy - desiredHealthy`, 0 when that or the expected count is not positive
  (updatePdbStatus). A `maxUnavailable` or a percentage needs the pods' controller's scale, which a pod
  owned by no scalable controller does not have: the controller then allows no disruption (failSafe);
- the Eviction API (pkg/registry/core/pod/storage/eviction.go, EvictionREST.Create): a pod that is
  Pending, Succeeded or Failed, or already being deleted, is deleted with no budget check; a pod covered
  by more than one budget is refused with 500 "This pod has more than one PodDisruptionBudget, which the
  eviction subresource does not support."; one whose budget allows no disruption with 429
  TooManyRequests "Cannot evict pod as it would violate the pod's disruption budget."; otherwise the
  budget's allowance goes down by one and the pod is deleted, after the condition DisruptionTarget=True
  (reason EvictionByEvictionAPI) is added (kubernetes.io "Pod disruption conditions");
- a selector matches labels only (metav1.LabelSelector: matchLabels and matchExpressions);
- a strategic merge patch of a pod's `metadata.labels` merges the maps (a null value removes a key);
- an object with an ownerReference to a pod is garbage-collected when that pod is gone (kubernetes.io
  "Garbage collection": dependents of a deleted owner are deleted).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from k8s_rules import selector_matches
from workload_controllers import now

if TYPE_CHECKING:
    from cluster_sim import ClusterSim

_NS = r"/namespaces/(?P<ns>[^/]+)"
BUDGETS = re.compile(rf"^/apis/policy/v1{_NS}/poddisruptionbudgets(?:/(?P<name>[^/]+))?$")
EVICTION = re.compile(rf"^/api/v1{_NS}/pods/(?P<name>[^/]+)/eviction$")
POD = re.compile(rf"^/api/v1{_NS}/pods/(?P<name>[^/]+)$")
MORE_THAN_ONE = (
    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
)
VIOLATES = "Cannot evict pod as it would violate the pod's disruption budget."


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason,
            "message": message, "metadata": {}}  # fmt: skip


def _success() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201, "metadata": {}}


def _selects(budget: dict[str, Any], pod: dict[str, Any]) -> bool:
    selector = budget["spec"].get("selector") or {}
    labels = pod["metadata"].get("labels") or {}
    text = ",".join(f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items())
    if not selector_matches(labels, text):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if (op == "In" and labels.get(key) not in values) or (
            op == "NotIn" and present and labels[key] in values
        ):
            return False
        if (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def _healthy(pod: dict[str, Any]) -> bool:
    return pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp")


def budget_status(sim: ClusterSim, budget: dict[str, Any]) -> dict[str, Any]:
    """What the disruption controller would write into the budget's status now."""
    namespace = budget["metadata"]["namespace"]
    pods = [p for (ns, _), p in sim.pods.items() if ns == namespace and _selects(budget, p)]
    disrupted = budget.get("status", {}).get("disruptedPods") or {}
    healthy = sum(1 for p in pods if _healthy(p) and p["metadata"]["name"] not in disrupted)
    minimum = budget["spec"].get("minAvailable")
    if isinstance(minimum, int):
        desired, expected = minimum, len(pods)
        allowed = max(0, healthy - desired) if expected > 0 else 0
    else:  # maxUnavailable or a percentage: no scale to read for bare or Workflow-owned pods (failSafe)
        desired, expected, allowed = 0, len(pods), 0
    return {"currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": expected,
            "disruptionsAllowed": allowed, "disruptedPods": disrupted,
            "observedGeneration": budget["metadata"].get("generation", 1)}  # fmt: skip


def route(sim: ClusterSim, budgets: dict[tuple[str, str], dict[str, Any]], method: str, path: str,
          body: Any) -> tuple[int, Any] | None:  # fmt: skip
    """(code, payload) of a budget, eviction or pod-patch request; None for other paths."""
    if match := BUDGETS.match(path):
        with sim.lock:
            return _budget(sim, budgets, method, match["ns"], match["name"], body)
    if (match := EVICTION.match(path)) and method == "POST":
        with sim.lock:
            return _evict(sim, budgets, match["ns"], match["name"])
    if (match := POD.match(path)) and method == "PATCH":
        with sim.lock:
            pod = sim.pods.get((match["ns"], match["name"]))
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{match["name"]}" not found')
            labels = pod["metadata"].setdefault("labels", {})
            for key, value in ((body or {}).get("metadata", {}).get("labels") or {}).items():
                if value is None:
                    labels.pop(key, None)
                else:
                    labels[key] = value
            return 200, pod
    return None


def collect_garbage(sim: ClusterSim, budgets: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Budgets whose owner pod is gone go (the garbage collector)."""
    uids = {p["metadata"]["uid"] for p in sim.pods.values()}
    for key, budget in list(budgets.items()):
        owners = [o for o in budget["metadata"].get("ownerReferences") or [] if o.get("kind") == "Pod"]
        if owners and not any(o["uid"] in uids for o in owners):
            del budgets[key]


def _budget(sim, budgets, method, ns, name, body):  # type: ignore[no-untyped-def]
    collect_garbage(sim, budgets)
    if method == "GET" and not name:
        items = [dict(b, status=budget_status(sim, b)) for (n, _), b in sorted(budgets.items()) if n == ns]
        return 200, {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudgetList",
            "metadata": {},
            "items": items,
        }
    if method == "POST" and not name:
        name = (body.get("metadata") or {}).get("name")
        spec = body.get("spec") or {}
        if ("minAvailable" in spec) == ("maxUnavailable" in spec):  # validation: exactly one of them here
            return 422, _status(422, "Invalid", f'PodDisruptionBudget.policy "{name}" is invalid: spec: '
                                "minAvailable and maxUnavailable cannot be both set")  # fmt: skip
        if (ns, name) in budgets:
            message = f'poddisruptionbudgets.policy "{name}" already exists'
            return 409, _status(409, "AlreadyExists", message)
        body["metadata"].update(namespace=ns, uid=f"uid-pdb-{time.monotonic_ns()}", generation=1,
                                creationTimestamp=now())  # fmt: skip
        budgets[(ns, name)] = body
        return 201, body
    if (ns, name) not in budgets:
        return 404, _status(404, "NotFound", f'poddisruptionbudgets.policy "{name}" not found')
    if method == "GET":
        return 200, dict(budgets[(ns, name)], status=budget_status(sim, budgets[(ns, name)]))
    if method == "DELETE":
        return 200, budgets.pop((ns, name))
    return 405, _status(405, "MethodNotAllowed", f"{method} is not supported here")


def _evict(sim, budgets, ns, name):  # type: ignore[no-untyped-def]
    collect_garbage(sim, budgets)
    pod = sim.pods.get((ns, name))
    if pod is None:
        return 404, _status(404, "NotFound", f'pods "{name}" not found')
    if pod["status"]["phase"] in ("Pending", "Succeeded", "Failed") or pod["metadata"].get(
        "deletionTimestamp"
    ):
        sim.delete_pod(ns, name)
        return 201, _success()
    covering = [b for (n, _), b in budgets.items() if n == ns and _selects(b, pod)]
    if len(covering) > 1:
        return 500, _status(500, "InternalError", MORE_THAN_ONE)
    if covering:
        budget = covering[0]
        found = budget_status(sim, budget)
        if found["disruptionsAllowed"] <= 0:
            answer = _status(429, "TooManyRequests", VIOLATES)
            answer["details"] = {"causes": [{"reason": "DisruptionBudget", "message": (
                f"The disruption budget {budget['metadata']['name']} needs {found['desiredHealthy']} healthy pods "
                f"and has {found['currentHealthy']} currently")}]}  # fmt: skip
            return 429, answer
        budget.setdefault("status", {}).setdefault("disruptedPods", {})[name] = now()
    pod["status"].setdefault("conditions", []).append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "EvictionByEvictionAPI",
            "lastTransitionTime": now(),
        }
    )
    sim.delete_pod(ns, name)
    return 201, _success()
