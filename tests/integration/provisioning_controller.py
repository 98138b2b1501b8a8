"""GKE's queued provisioning in the simulated cluster: ProvisioningRequests (class
`queued-provisioning.gke.io`) and their PodTemplates, served and acted on as GKE does.

Rules, and where each comes from:
- the API (kubernetes/autoscaler `cluster-autoscaler/apis/provisioningrequest/autoscaling.x-k8s.io/v1/
  types.go` and its CRD, tests/fixtures/schemas): `autoscaling.x-k8s.io/v1`, namespaced, validated
  against the published CRD schema on create (422 Invalid otherwise, as the API server answers a custom
  object that breaks its schema); `status` is a subresource, so a create's status is dropped; PodTemplates
  are core `v1` objects (`/api/v1/namespaces/NS/podtemplates`);
- conditions (same types.go): Accepted (the autoscaler took the request), Provisioned (every requested
  node was created and registered), Failed (the nodes cannot be had; reason and message say why);
  the reasons `NotProvisioned` (Provisioned=False while waiting) and `OutOfResources` (a Failed request)
  are the cluster autoscaler's, as its status shows them (kubernetes-sigs/kueue, "Troubleshooting
  Provisioning Requests"); the messages here are the simulator's own;
- a request whose pods do not fit a new node of its pool (the autoscaler's template node with the DaemonSets it
  would run, `gke_nodes.template_node`) never provisions: it stays Provisioned=False with the reason why;
- all or nothing (GKE "Run a large-scale workload with flex-start with queued provisioning"): GKE adds
  every node of a request at once, in one zone of the pool (location policy ANY), only to a pool with
  queued provisioning, and only within the pool's autoscaling maximum; until then the request waits.
  A zone's room is the Container API stand-in's `zone_capacity` (Compute Engine's stockout: the VMs a
  zone can still create), so a stockout keeps a request waiting;
- only requests bring nodes to such a pool: pods do not scale it up on their own (the autoscaler leaves
  pods that consume a request out of its scale-up loop, cluster-autoscaler `proposals/
  provisioning-request.md`, "Pods annotations"), and `gke_autoscaler.py` skips these pools;
- consumption (same proposal): a pod carrying both annotations `autoscaling.x-k8s.io/consume-provisioning-
  request` and `autoscaling.x-k8s.io/provisioning-class-name` runs on its request's capacity: here it is
  bound only to the nodes that request brought; a pod naming a request that does not exist stays
  unschedulable;
- the taint `cloud.google.com/gke-queued=true:NoSchedule` and the label `cloud.google.com/gke-flex-start:
  "true"` on the pool's nodes (GKE's queued-provisioning node pools carry them; pods that run there tolerate
  the taint, and GKE's Standard example selects the label);
- a PodTemplate without the label `cloud.google.com/apply-warden-policies: "true"` (GKE's guide: "necessary
  for GKE to calculate node resource requirements") brings no node: its request stays NotProvisioned; except a
  PodTemplate Kueue's ProvisioningRequest admission check made (labelled `kueue.x-k8s.io/managed: "true"`):
  GKE's guide has the user write no PodTemplate and no warden label when Kueue asks for the nodes, and Kueue
  v0.19.2 (pkg/controller/admissionchecks/provisioning/controller.go `createPodTemplate`) labels its templates
  only `kueue.x-k8s.io/managed`, so such a request provisions without it (docs/research/kueue_trainer.md
  section 15; that GKE tells them apart is inferred there, not documented);
- deleting a request cancels it (proposal, "Canceling the requests"): its nodes are no longer kept and
  go by the normal scale-down, once empty for the autoscaler's unneeded time (`scale_down_unneeded_s`).
- the booking expires (cluster-autoscaler `provisioningrequest/processors/provreq`, `refresh`): a request
  Provisioned for `defaultReservationTime` (10 minutes; `booking_s` here) gets BookingExpired=True, reason
  `CapacityReservationTimeExpired`; its nodes are then no longer kept for it (`_release`: an empty one goes
  by the normal scale-down), while the pods on them keep running.
Not modelled: CapacityRevoked and maxRunDurationSeconds (nodes taken back after the run duration), quota,
the processor's Failed after 7 days unprovisioned (`defaultExpirationTime`).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml
from k8s_rules import selector_matches
from workload_controllers import now

if TYPE_CHECKING:
    from cluster_sim import ClusterSim

CLASS = "queued-provisioning.gke.io"
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
QUEUED_TAINT = {"key": "cloud.google.com/gke-queued", "value": "true", "effect": "NoSchedule"}
WARDEN = "cloud.google.com/apply-warden-policies"
KUEUE_MANAGED = "kueue.x-k8s.io/managed"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
POOL_LABEL = "cloud.google.com/gke-nodepool"
_NS = r"/namespaces/(?P<ns>[^/]+)"
TEMPLATES = re.compile(rf"^/api/v1{_NS}/podtemplates(?:/(?P<name>[^/]+))?$")
REQUESTS = re.compile(rf"^/apis/autoscaling.x-k8s.io/v1{_NS}/provisioningrequests(?:/(?P<name>[^/]+))?$")
CRD = "autoscaling.x-k8s.io_provisioningrequests.yaml"
Key = tuple[str, str]


@functools.cache
def _schema() -> dict[str, Any]:
    from kube_api_server import FIXTURES

    crd = yaml.load((FIXTURES / CRD).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return dict(v1["schema"]["openAPIV3Schema"])


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def _condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now(), "observedGeneration": 1}  # fmt: skip


@dataclass
class ProvisioningController:
    """Requests, templates and the nodes each request brought.

    `zone_capacity()` is the Container API stand-in's stockout knob (zone -> VMs it can still create);
    `fail_with` (reason, message) makes every new request fail at once, as GKE fails one it can never
    serve.
    """

    zone_capacity: Callable[[], dict[str, int]] = dict
    fail_with: tuple[str, str] | None = None
    booking_s: float = 600.0  # the autoscaler's defaultReservationTime
    templates: dict[Key, dict[str, Any]] = field(default_factory=dict)
    requests: dict[Key, dict[str, Any]] = field(default_factory=dict)
    brought: dict[str, Key] = field(default_factory=dict)  # node -> the request that brought it
    queued_pools: set[str] = field(default_factory=set)  # pools created with queued provisioning
    deleted: list[Key] = field(default_factory=list)  # every request deleted, in order
    provisioned_at: dict[Key, float] = field(default_factory=dict)  # when each request became Provisioned

    # -- the API ------------------------------------------------------------------------------------
    @staticmethod
    def serves(path: str) -> bool:
        return TEMPLATES.match(path) is not None or REQUESTS.match(path) is not None

    def route(self, sim: ClusterSim, method: str, path: str, query: dict[str, list[str]], body: Any):
        """(code, payload) of a PodTemplate or ProvisioningRequest call; None for other paths."""
        for objects, pattern, kind in ((self.templates, TEMPLATES, "PodTemplate"),
                                       (self.requests, REQUESTS, "ProvisioningRequest")):  # fmt: skip
            if match := pattern.match(path):
                return self._serve(objects, kind, method, match["ns"], match["name"], query, body)
        return None

    def _serve(self, objects, kind, method, ns, name, query, body):  # type: ignore[no-untyped-def]
        resource = "podtemplates" if kind == "PodTemplate" else "provisioningrequests.autoscaling.x-k8s.io"
        if method == "GET" and not name:
            selector = query.get("labelSelector", [""])[0]
            items = [o for (n, _), o in sorted(objects.items())
                     if n == ns and selector_matches(o["metadata"].get("labels", {}), selector)]  # fmt: skip
            version = "v1" if kind == "PodTemplate" else "autoscaling.x-k8s.io/v1"
            return 200, {"apiVersion": version, "kind": f"{kind}List", "metadata": {}, "items": items}
        if method == "POST" and not name:
            return self._create(objects, kind, resource, ns, body)
        if (ns, name) not in objects:
            return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
        if method == "GET":
            return 200, objects[(ns, name)]
        if method == "DELETE":
            gone = objects.pop((ns, name))
            if kind == "ProvisioningRequest":
                self.deleted.append((ns, name))
            return 200, gone
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported here")

    def _create(self, objects, kind, resource, ns, body):  # type: ignore[no-untyped-def]
        import jsonschema

        name = body.get("metadata", {}).get("name")
        if kind == "ProvisioningRequest":
            errors = sorted(jsonschema.Draft7Validator(_schema()).iter_errors(body), key=str)
            if errors:
                where = ".".join(str(p) for p in errors[0].absolute_path)
                return 422, _status(422, "Invalid", f'ProvisioningRequest "{name}" is invalid: {where}: '
                                    f"{errors[0].message}")  # fmt: skip
            body = {**body, "status": {}}  # the status subresource: not set by a create
        if (ns, name) in objects:
            return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
        body["metadata"].update(
            namespace=ns, uid=f"uid-{name}-{time.monotonic_ns()}", creationTimestamp=now()
        )
        objects[(ns, name)] = body
        return 201, body

    # -- the controller -----------------------------------------------------------------------------
    def reconcile(self, sim: ClusterSim) -> None:
        """One pass (under the simulator's lock): accept, provision or fail requests; scale down the
        nodes of deleted ones."""
        for key, request in self.requests.items():
            self._reconcile_request(sim, key, request)
        self._release(sim)

    def _reconcile_request(self, sim: ClusterSim, key: Key, request: dict[str, Any]) -> None:
        spec, status = request["spec"], request["status"]
        if spec["provisioningClassName"] != CLASS:
            return  # another class: GKE's queued provisioning leaves it alone
        found = {c["type"]: c for c in status.setdefault("conditions", [])}
        if "Accepted" not in found:
            status["conditions"].append(_condition("Accepted", "True", "Accepted", "queued for capacity"))
        if found.get("Provisioned", {}).get("status") == "True":
            if (
                "BookingExpired" not in found
                and time.monotonic() - self.provisioned_at[key] >= self.booking_s
            ):
                self._set(status, _condition("BookingExpired", "True", "CapacityReservationTimeExpired",
                                             "Capacity reservation time is expired"))  # fmt: skip
            return
        if found.get("Failed", {}).get("status") == "True":
            return
        if self.fail_with is not None:
            reason, message = self.fail_with
            self._set(status, _condition("Provisioned", "False", "NotProvisioned", message))
            self._set(status, _condition("Failed", "True", reason, message))
            return
        (pod_set,) = spec["podSets"]
        template = self.templates.get((key[0], pod_set["podTemplateRef"]["name"]))
        pool = ((template or {}).get("template", {}).get("spec", {}).get("nodeSelector") or {}).get(
            POOL_LABEL
        )
        labels = (template or {}).get("metadata", {}).get("labels") or {}
        unlabelled = (
            template is not None and labels.get(WARDEN) != "true" and labels.get(KUEUE_MANAGED) != "true"
        )
        unfit = (
            f'PodTemplate {pod_set["podTemplateRef"]["name"]} lacks the label {WARDEN}: "true", which GKE needs '
            "to calculate the node resources its pods require"
            if unlabelled
            else self.unfit_template(sim, pool, template)
        )
        if unfit:
            self._set(status, _condition("Provisioned", "False", "NotProvisioned", unfit))
            return
        zone = self._zone_for(sim, pool, pod_set["count"])
        if zone is None or pool is None:
            why = (
                f"PodTemplate {pod_set['podTemplateRef']['name']} not found" if template is None
                else f"no queued-provisioning node pool {pool!r} can take {pod_set['count']} node(s) in one zone now"
            )  # fmt: skip
            self._set(status, _condition("Provisioned", "False", "NotProvisioned", why))
            return
        before = set(sim.nodes)
        in_zone = sum(1 for where in sim.nodes.values() if where == {"pool": pool, "zone": zone})
        sim._resize_zone(pool, zone, in_zone + pod_set["count"])  # every node at once
        for node in set(sim.nodes) - before:
            self.brought[node] = key
        sim.pool_history.append((pool, sim.pool_size(pool)))
        self._set(status, _condition("Provisioned", "True", "Provisioned",
                                     f"{pod_set['count']} node(s) of pool {pool} in {zone}"))  # fmt: skip
        self.provisioned_at[key] = time.monotonic()

    def unfit_template(
        self, sim: ClusterSim, pool: str | None, template: dict[str, Any] | None
    ) -> str | None:
        """Why the request's pods cannot fit a new node of `pool` (None: they can, or nothing to judge yet).

        The autoscaler serves a request by simulating its pods on the pool's template node with the DaemonSets
        it would run (`gke_autoscaler`): a pod larger than that never brings a node (cluster-autoscaler
        `proposals/provisioning-request.md`: the request is provisioned only when its pods' scale-up succeeds)."""
        import gke_autoscaler
        import gke_nodes
        import k8s_rules

        if template is None or pool not in sim.pools:
            return None
        machine_type = sim.pools[pool].machine_type
        node = gke_nodes.template_node(pool=pool, zone=sim.pools[pool].zones[0], machine_type=machine_type)
        self.taint([node])  # the template of a queued pool's node has what its nodes have
        pod = {"spec": template["template"]["spec"]}
        why = k8s_rules.unfit_reasons(pod, node, gke_autoscaler.template_requests(machine_type))
        if not why:
            return None
        return (
            f"pod didn't trigger scale-up: {', '.join(why)} on a new node of pool {pool} ({machine_type}: what the "
            "autoscaler's node template offers, less its DaemonSets)"
        )

    @staticmethod
    def _set(status: dict[str, Any], condition: dict[str, Any]) -> None:
        status["conditions"] = [c for c in status["conditions"] if c["type"] != condition["type"]] + [
            condition
        ]

    def _zone_for(self, sim: ClusterSim, pool: str | None, count: int) -> str | None:
        """A zone of `pool` that can create `count` more VMs within the pool's autoscaling maximum."""
        if pool not in self.queued_pools or pool not in sim.pools:
            return None
        import gke_autoscaler

        settings = sim.pools[pool]
        _, maximum = gke_autoscaler.bounds(settings.autoscaling, len(settings.zones))
        if not settings.autoscaling.get("enabled") or sim.pool_size(pool) + count > maximum:
            return None
        capacity = self.zone_capacity()
        return next((z for z in settings.zones if capacity.get(z, count) >= count), None)

    def _release(self, sim: ClusterSim) -> None:
        """Nodes of a deleted request are no longer kept: each goes once empty for the unneeded time."""
        # Pods that ended hold no node (the autoscaler's scale-down counts the pods still running there).
        busy = {
            p["spec"].get("nodeName")
            for p in sim.pods.values()
            if p["status"]["phase"] in ("Pending", "Running")
        }
        clock = time.monotonic()
        booked = {key for key, request in self.requests.items()
                  if not any(c["type"] == "BookingExpired" for c in request["status"].get("conditions", []))}  # fmt: skip
        for node, key in list(self.brought.items()):
            if key in booked or node not in sim.nodes:
                if node not in sim.nodes:
                    del self.brought[node]
                continue
            if node in busy:
                sim.idle_since.pop(node, None)
            elif clock - sim.idle_since.setdefault(node, clock) >= sim.scale_down_unneeded_s:
                pool = sim.nodes[node]["pool"]
                sim._remove_node(node)
                del self.brought[node]
                sim.pool_history.append((pool, sim.pool_size(pool)))

    # -- the scheduler and the nodes ----------------------------------------------------------------
    def unfit(self, pod: dict[str, Any], node: str, sim: ClusterSim) -> list[str]:
        """Why `node` cannot take `pod` because of requests (empty: it can)."""
        wanted = (pod["metadata"].get("annotations") or {}).get(CONSUME)
        if wanted is None:
            return []
        key = (pod["metadata"]["namespace"], wanted)
        if self.brought.get(node) != key:
            return [f"node(s) were not provisioned for ProvisioningRequest {wanted}"]
        return []

    def taint(self, nodes: list[dict[str, Any]]) -> None:
        """The queued-provisioning taint and the flex-start label on the nodes of such pools (in place)."""
        for node in nodes:
            if node["metadata"]["labels"].get(POOL_LABEL) in self.queued_pools:
                node["spec"].setdefault("taints", []).append(dict(QUEUED_TAINT))
                node["metadata"]["labels"][FLEX_START_LABEL] = "true"
