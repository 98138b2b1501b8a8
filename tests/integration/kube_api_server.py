"""A local server speaking the few Kubernetes API routes batchpilot uses, for the real `kubernetes` client.

Routes:
- `GET /api/v1/nodes?labelSelector=k=v`: the node list; `node_snapshots` scripts how it changes
  (each list call serves the next snapshot, the last one stays).
- JobSets (`/apis/jobset.x-k8s.io/v1alpha2/namespaces/NS/jobsets[/NAME]`): create, get, delete;
  `jobset_statuses` scripts the status each get returns (the last one stays). A create is refused (422)
  as the API server and the JobSet webhook refuse bad names (`jobset_webhook.py`).
- Pods (`/api/v1/namespaces/NS/pods?labelSelector=...`) and their logs (`.../pods/NAME/log`).
- CRDs (`/apis/apiextensions.k8s.io/v1/customresourcedefinitions/NAME`, get): by default the cluster has
  JobSet installed as published (the CRD in tests/fixtures/schemas); `crds` replaces what is installed
  (an older JobSet, or none: 404).
- `GET /version`: the server's version.Info (k8s.io/apimachinery pkg/version/types.go: major, minor,
  gitVersion, gitCommit, gitTreeState, buildDate, goVersion, compiler, platform), `git_version` scripts it.
- SelfSubjectAccessReviews (`POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`): the review
  comes back with `status.allowed` (and `status.reason`), false for the (verb, resource) pairs in `denied`
  (resource as `kubectl auth can-i` writes it: `jobsets.jobset.x-k8s.io`, `pods/log`, `nodes`); a spec
  with neither or both of resourceAttributes and nonResourceAttributes is refused 422 Invalid, as
  kubernetes pkg/apis/authorization/validation ValidateSelfSubjectAccessReviewSpec refuses it.
- DaemonSets (`GET /apis/apps/v1/namespaces/NS/daemonsets/NAME`): those in `daemonsets`, else 404.
- With a simulator, PodDisruptionBudgets, the Eviction API and a pod's label patch (`kube_disruption.py`);
  (verb, resource) `("patch", "pods")` or `("create", "poddisruptionbudgets.policy")` in `denied` answers 403.
- ConfigMaps (`GET /api/v1/namespaces/NS/configmaps/NAME`): those in `configmaps` (e.g. Argo's
  workflow-controller-configmap), else 404; (verb, resource) `("get", "configmaps")` in `denied` answers 403
  Forbidden, as the API server answers a caller without that grant.

Without a simulator the JobSet routes also list (`labelSelector`) and DELETE removes the JobSet's pods
(any `propagationPolicy` but Orphan), and `.../events` answers the scripted `events`.

With `KubeState.sim` (a `cluster_sim.ClusterSim`; `kube_server_running(sim=...)`), every route is
served from the simulated cluster instead (`kube_sim_routes.py`): nodes follow the node pools, JobSets
make Jobs and pods, pods are scheduled, events are recorded.

Every request is recorded with its JSON body so tests can check what the real client sent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jobset_webhook
import kube_disruption
import kube_leases
import kube_sim_routes
import yaml
from cluster_sim import ClusterSim
from k8s_rules import selector_matches
from loopback_http import QuietHandler, serving

JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/"


def node(
    name: str, *, pool: str, ready: bool = True, cordoned: bool = False, gpus: int = 0
) -> dict[str, Any]:
    """A Node object as the API serves it (only the fields readiness reads, plus the pool label)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": pool}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "allocatable": {"cpu": "8", "memory": "32Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})},
        },
    }


def pod(name: str, *, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        "status": {"phase": "Running"},
    }


@dataclass
class KubeState:
    node_snapshots: list[list[dict[str, Any]]] = field(default_factory=lambda: [[]])
    node_lists: int = 0
    jobsets: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobset_statuses: list[dict[str, Any]] = field(default_factory=list)
    jobset_gets: int = 0
    pods: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    node_logs: dict[int, str] = field(default_factory=dict)  # log text of node k's pod, once created
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sim: ClusterSim | None = None
    leases: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # kube_leases.py
    lease_requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)
    crds: dict[str, dict[str, Any]] | None = None  # by name; None: the published ones (`published_crds`)
    git_version: str = "v1.31.4-gke.1000"  # what GET /version reports
    denied: set[tuple[str, str]] = field(default_factory=set)  # SelfSubjectAccessReview: (verb, resource)
    daemonsets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (namespace, name)
    configmaps: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (namespace, name)
    budgets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # PDBs (kube_disruption.py)


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "schemas"


@functools.cache
def published_crds() -> dict[str, dict[str, Any]]:
    """The CRDs a cluster with JobSet installed serves: the published JobSet CRD (tests/fixtures/schemas)."""
    text = (FIXTURES / "jobset.x-k8s.io_jobsets.yaml").read_text()
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return {crd["metadata"]["name"]: crd}


def _selected(obj: dict[str, Any], selector: str) -> bool:
    return selector_matches(obj["metadata"].get("labels", {}), selector)


class _Handler(QuietHandler):
    state: KubeState

    def _record(self) -> tuple[str, dict[str, list[str]], Any]:
        parts = urlsplit(self.path)
        data = self.read_body()
        body = json.loads(data) if data else None
        query = parse_qs(parts.query)
        with self.state.lock:
            # A run's Lease renewals (kube_leases.py) go on beside the calls a test checks: kept apart.
            leased = kube_leases.LEASES.match(parts.path) is not None
            (self.state.lease_requests if leased else self.state.requests).append(
                (self.command, parts.path, query, body)
            )
        return parts.path, query, body

    def _simulated(self, path: str, query: dict[str, list[str]], body: Any) -> bool:
        """Answers from the simulator when there is one; False when this server plays the script."""
        if self.state.sim is None:
            return False
        if refused := self._refused(path):
            self.reply(*refused)
            return True
        if (
            answer := kube_disruption.route(self.state.sim, self.state.budgets, self.command, path, body)
        ) is not None:
            self.reply(*answer)
            return True
        if self.command == "GET" and path.endswith("/log") and query.get("follow", [""])[0].lower() == "true":
            self._follow_log(self.state.sim, path)
            return True
        answer = kube_sim_routes.route(self.state.sim, self.command, path, query, body)
        code, payload = answer or (404, _status(404, "NotFound", f"no route {path}"))
        self.reply(code, payload)
        return True

    def _refused(self, path: str) -> tuple[int, dict[str, Any]] | None:
        """403 for a pod patch or a budget create that `denied` withholds (as `kubectl auth can-i` names them)."""
        verb = {"PATCH": "patch", "POST": "create", "DELETE": "delete"}.get(self.command)
        if kube_disruption.POD.match(path) and verb == "patch":
            resource = "pods"
        elif kube_disruption.BUDGETS.match(path) and verb:
            resource = "poddisruptionbudgets.policy"
        else:
            return None
        if (verb, resource) not in self.state.denied:
            return None
        return 403, _status(
            403, "Forbidden", f'{resource} is forbidden: User cannot {verb} resource "{resource}"'
        )

    def do_PATCH(self) -> None:
        path, query, body = self._record()
        if not self._simulated(path, query, body):
            self.reply(404, _status(404, "NotFound", f"no route {path}"))

    def _follow_log(self, sim: ClusterSim, path: str) -> None:
        """`log?follow=true`: the log so far, then what the pod writes, until it ends (the body ends
        when the connection closes, as the API server's streamed logs do)."""
        parts = path.split("/")
        key = (parts[4], parts[6])  # /api/v1/namespaces/NS/pods/NAME/log
        if key not in sim.pods:
            return self.reply(404, _status(404, "NotFound", f'pods "{key[1]}" not found'))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.end_headers()
        sent = 0
        while True:
            pod = sim.pods.get(key)
            text = sim.pod_log(*key) if pod else ""
            if len(text) > sent:
                self.wfile.write(text[sent:].encode())
                self.wfile.flush()
                sent = len(text)
            if pod is None or pod["status"]["phase"] in ("Succeeded", "Failed"):
                return
            time.sleep(0.1)

    def _lease(self, path: str, body: Any) -> bool:
        """Answers a Lease request (`kube_leases.py`, with or without a simulator)."""
        with self.state.lock:
            answer = kube_leases.route(self.state.leases, self.command, path, body)
        if answer is not None:
            self.reply(*answer)
        return answer is not None

    def _cluster_info(self, path: str) -> bool:
        """`/version`, DaemonSets and ConfigMaps, with or without a simulator; False for any other path."""
        if path in ("/version", "/version/"):  # the kubernetes client asks for /version/
            major, minor = self.state.git_version.removeprefix("v").split(".")[:2]
            self.reply(200, {"major": major, "minor": minor, "gitVersion": self.state.git_version,
                             "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                             "goVersion": "go1.23.4", "compiler": "gc", "platform": "linux/amd64"})  # fmt: skip
            return True
        if match := CONFIGMAP.match(path):
            if ("get", "configmaps") in self.state.denied:
                message = (f'configmaps "{match["name"]}" is forbidden: User cannot get resource "configmaps" in '
                           f'API group "" in the namespace "{match["ns"]}"')  # fmt: skip
                self.reply(403, _status(403, "Forbidden", message))
                return True
            found = self.state.configmaps.get((match["ns"], match["name"]))
            message = f'configmaps "{match["name"]}" not found'
            self.reply(*((200, found) if found else (404, _status(404, "NotFound", message))))
            return True
        if match := DAEMONSET.match(path):
            found = self.state.daemonsets.get((match["ns"], match["name"]))
            message = f'daemonsets.apps "{match["name"]}" not found'
            self.reply(*((200, found) if found else (404, _status(404, "NotFound", message))))
            return True
        return False

    def do_PUT(self) -> None:
        path, _, body = self._record()
        if not self._lease(path, body):
            self.reply(405, _status(405, "MethodNotAllowed", f"PUT {path} is not supported here"))

    def do_GET(self) -> None:
        path, query, _ = self._record()
        if self._lease(path, None):
            return
        if path.startswith(CRDS):  # apiextensions.k8s.io: what is installed, with or without a simulator
            name = path.removeprefix(CRDS)
            crds = published_crds() if self.state.crds is None else self.state.crds
            if name not in crds:
                message = f'customresourcedefinitions.apiextensions.k8s.io "{name}" not found'
                return self.reply(404, _status(404, "NotFound", message))
            return self.reply(200, crds[name])
        if self._cluster_info(path):
            return
        if self._simulated(path, query, None):
            return
        selector = query.get("labelSelector", [""])[0]
        with self.state.lock:
            state = self.state
            if path == "/api/v1/nodes":
                snapshot = state.node_snapshots[min(state.node_lists, len(state.node_snapshots) - 1)]
                state.node_lists += 1
                items = [n for n in snapshot if _selected(n, selector)]
                return self.reply(
                    200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
                )
            if path.startswith(JOBSETS) and path.endswith("/jobsets"):
                items = [j for j in state.jobsets.values() if _selected(j, selector)]
                return self.reply(200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSetList",
                                        "metadata": {}, "items": items})  # fmt: skip
            if path.endswith("/events"):
                return self.reply(
                    200, {"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": state.events}
                )
            if path.startswith(JOBSETS):
                name = path.rsplit("/", 1)[-1]
                if name not in state.jobsets:
                    return self.reply(404, _status(404, "NotFound", f'jobsets "{name}" not found'))
                if state.jobset_statuses:
                    index = min(state.jobset_gets, len(state.jobset_statuses) - 1)
                    state.jobsets[name]["status"] = state.jobset_statuses[index]
                state.jobset_gets += 1
                return self.reply(200, state.jobsets[name])
            if path.endswith("/log"):
                name = path.split("/")[-2]
                return self.reply(200, state.logs.get(name, ""))
            if path.endswith("/pods"):
                items = [p for p in state.pods if _selected(p, selector)]
                return self.reply(
                    200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
                )
        self.reply(404, _status(404, "NotFound", f"no route {path}"))

    def do_POST(self) -> None:
        path, query, body = self._record()
        if self._lease(path, body):
            return
        if path == ACCESS_REVIEWS:  # with or without a simulator
            return self.reply(*access_review(body, denied=self.state.denied))
        if self._simulated(path, query, body):
            return
        if not path.startswith(JOBSETS):
            return self.reply(404, _status(404, "NotFound", f"no route {path}"))
        name = body["metadata"]["name"]
        if denied := jobset_webhook.admit_create(body):  # the name rules, before storage (AlreadyExists)
            return self.reply(422, denied)
        with self.state.lock:
            if name in self.state.jobsets:
                return self.reply(409, _status(409, "AlreadyExists", f'jobsets "{name}" already exists'))
            self.state.jobsets[name] = body
            self._start_pods(body)
        self.reply(201, body)

    def _start_pods(self, jobset: dict[str, Any]) -> None:
        """Plays the JobSet controller: one Running pod per node, labelled as the controller labels them."""
        name = jobset["metadata"]["name"]
        for replicated in jobset["spec"]["replicatedJobs"]:
            for index in range(replicated["template"]["spec"]["parallelism"]):
                pod_name = f"{name}-{replicated['name']}-0-{index}-abcde"
                labels = {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                    "batch.kubernetes.io/job-completion-index": str(index),
                }
                self.state.pods.append(pod(pod_name, labels=labels))
                self.state.logs[pod_name] = self.state.node_logs.get(index, "")

    def do_DELETE(self) -> None:
        path, query, body = self._record()
        if self._lease(path, body):
            return
        if self._simulated(path, query, body):
            return
        name = path.rsplit("/", 1)[-1]
        policy = query.get("propagationPolicy", [None])[0] or (body or {}).get("propagationPolicy")
        with self.state.lock:
            found = self.state.jobsets.pop(name, None)
            if found is not None and policy != "Orphan":  # the dependents go too (garbage collection)
                label = "jobset.sigs.k8s.io/jobset-name"
                self.state.pods = [p for p in self.state.pods if p["metadata"]["labels"].get(label) != name]
        if found is None:
            return self.reply(404, _status(404, "NotFound", f'jobsets "{name}" not found'))
        self.reply(200, _status(200, "Success", "deleted"))


ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
DAEMONSET = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/daemonsets/(?P<name>[^/]+)$")
CONFIGMAP = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/configmaps/(?P<name>[^/]+)$")


def access_review(body: Any, *, denied: set[tuple[str, str]]) -> tuple[int, dict[str, Any]]:
    """The API server's answer to a SelfSubjectAccessReview: the review with `status` filled in
    (authorization.k8s.io/v1; the spec rule is ValidateSelfSubjectAccessReviewSpec's)."""
    spec = (body or {}).get("spec") or {}
    if ("resourceAttributes" in spec) == ("nonResourceAttributes" in spec):
        message = (
            'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: spec.resourceAttributes: Invalid value: '
            '"null": exactly one of nonResourceAttributes or resourceAttributes must be specified'
        )
        return 422, _status(422, "Invalid", message)
    attributes = spec.get("resourceAttributes") or {}
    resource = attributes.get("resource", "")
    if attributes.get("group"):
        resource += f".{attributes['group']}"
    if attributes.get("subresource"):
        resource += f"/{attributes['subresource']}"
    allowed = (attributes.get("verb", ""), resource) not in denied
    status = {"allowed": allowed, "reason": "allowed by the stand-in" if allowed else ""}
    return 201, {**body, "status": status}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


@dataclass
class KubeServer:
    server: ThreadingHTTPServer
    state: KubeState

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def api_client(self) -> Any:
        """A real `kubernetes` ApiClient talking to this server."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.endpoint
        return client.ApiClient(configuration)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig pointing at this server, as `gcloud container clusters get-credentials` would leave
        one (set KUBECONFIG to it)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.endpoint}}],
            "users": [{"name": "me", "user": {"token": "unused"}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "me"}}],
            "current-context": "local",
        }
        path.write_text(yaml.safe_dump(config))
        return path


@contextlib.contextmanager
def kube_server_running(*, sim: ClusterSim | None = None) -> Iterator[KubeServer]:
    state = KubeState(sim=sim)
    with serving(_Handler, state) as server:
        yield KubeServer(server, state)
