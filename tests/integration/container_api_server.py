"""A local server speaking the few routes of the GKE Container API (REST, v1) that batchpilot uses.

Routes: nodePools get, `:setSize`, `:setAutoscaling`, and operations get. Each write starts an
operation that reports RUNNING for `polls_until_done` polls, then DONE. Faults are scripted:
`conflicts` writes answer 400 FAILED_PRECONDITION as GKE does while another operation runs, and
`deny` answers 403 PERMISSION_DENIED. Every request is recorded (method, path, query, JSON body) so
tests can check what the real client sent.

With `ContainerState.sim` (a `cluster_sim.ClusterSim`; `container_server_running(sim=...)`), a pool
added with a `machine_type` is a pool of the simulated cluster: `:setSize` (nodes per zone) creates
and deletes its Node objects there, and `:setAutoscaling` hands its bounds to the simulated cluster
autoscaler. The pool's `config.machineType` (and `config.accelerators`) is served as GKE does.

Point `google.cloud.container_v1.ClusterManagerClient` at it with `transport="rest"`,
`client_options={"api_endpoint": server.endpoint}` and anonymous credentials.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cluster_sim import ClusterSim
from gke_nodes import MACHINES
from loopback_http import QuietHandler, serving

POOL = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)/nodePools/([^/:]+)(:\w+)?$")
OPERATION = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/operations/([^/]+)$")
# The client asks for `$alt=json;enum-encoding=int`, so enums go out as their numbers
# (Operation.Status RUNNING/DONE, NodePool.Status RUNNING, Operation.Type values).
STATUS_RUNNING, STATUS_DONE = 2, 3
TYPE_SET_NODE_POOL_MANAGEMENT, TYPE_SET_NODE_POOL_SIZE = 9, 14


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: dict[str, Any] | None


@dataclass
class ContainerState:
    """The fake's world: one cluster's node pools, operations, scripted faults and the request log."""

    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)
    polls: dict[str, int] = field(default_factory=dict)
    polls_until_done: int = 2
    conflicts: int = 0
    deny: bool = False
    fail_operation: str | None = None
    requests: list[Request] = field(default_factory=list)
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)
    sim: ClusterSim | None = None

    def add_pool(
        self, name: str, *, locations: list[str], node_count: int = 0, machine_type: str | None = None
    ) -> None:
        """Adds `projects/P/locations/L/clusters/C/nodePools/NAME`-style pool named by its full name.

        With a simulator, `machine_type` (a key of `gke_nodes.MACHINES`) makes it a simulated pool
        with `node_count` nodes per zone.
        """
        short = name.rsplit("/", 1)[-1]
        self.pools[name] = {
            "name": short,
            "locations": locations,
            "initialNodeCount": node_count,
            "status": STATUS_RUNNING,
            "autoscaling": {},
            "nodeCountPerZone": node_count,
        }
        if machine_type is not None:
            machine = MACHINES[machine_type]
            config: dict[str, Any] = {"machineType": machine_type}
            if machine.gpus:
                config["accelerators"] = [
                    {"acceleratorCount": str(machine.gpus), "acceleratorType": machine.accelerator}
                ]
            self.pools[name]["config"] = config
            if self.sim is not None:
                self.sim.add_pool(short, zones=locations, machine_type=machine_type)
                self.sim.resize_pool(short, per_zone=node_count)


def _error(code: int, status: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "status": status}}


class _Handler(QuietHandler):
    state: ContainerState  # set on the subclass made per server

    def _record(self) -> Request:
        parts = urlsplit(self.path)
        data = self.read_body()
        body = json.loads(data) if data else None
        request = Request(self.command, parts.path, parse_qs(parts.query), body)
        with self.state.lock:
            self.state.requests.append(request)
        return request

    def do_GET(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = self._get(request.path)
        self.reply(code, payload)

    def do_POST(self) -> None:
        request = self._record()
        with self.state.lock:
            code, payload = self._post(request.path, request.body or {})
        self.reply(code, payload)

    def _get(self, path: str) -> tuple[int, dict[str, Any]]:
        state = self.state
        if match := POOL.match(path):
            if match.group(5):
                return _error(404, "NOT_FOUND", "no such method")
            full = path.removeprefix("/v1/")
            if full not in state.pools:
                return _error(404, "NOT_FOUND", f"Not found: {full}.")
            return 200, {k: v for k, v in state.pools[full].items() if k != "nodeCountPerZone"}
        if match := OPERATION.match(path):
            name = match.group(3)
            if name not in state.operations:
                return _error(404, "NOT_FOUND", f"Not found: operation {name}.")
            state.polls[name] = state.polls.get(name, 0) + 1
            operation = dict(state.operations[name])
            if state.polls[name] >= state.polls_until_done:
                operation["status"] = STATUS_DONE
                if state.fail_operation:
                    operation["error"] = {"code": 9, "message": state.fail_operation}
            return 200, operation
        return _error(404, "NOT_FOUND", f"no route {path}")

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        state = self.state
        match = POOL.match(path)
        if not match or match.group(5) not in (":setSize", ":setAutoscaling"):
            return _error(404, "NOT_FOUND", f"no route {path}")
        full = path.removeprefix("/v1/").rsplit(":", 1)[0]
        if state.deny:
            return _error(
                403,
                "PERMISSION_DENIED",
                f'Required "container.clusters.update" permission(s) for "{full.rsplit("/nodePools", 1)[0]}".',
            )
        if full not in state.pools:
            return _error(404, "NOT_FOUND", f"Not found: {full}.")
        if state.conflicts > 0:
            state.conflicts -= 1
            return _error(
                400,
                "FAILED_PRECONDITION",
                f"Operation operation-9999 is currently upgrading cluster {match.group(3)}. "
                "Please wait and try again once it is done.",
            )
        pool = state.pools[full]
        simulated = state.sim is not None and pool["name"] in state.sim.pools
        if match.group(5) == ":setSize":
            pool["nodeCountPerZone"] = int(body.get("nodeCount", 0))
            kind = TYPE_SET_NODE_POOL_SIZE
            if simulated:
                assert state.sim is not None
                state.sim.resize_pool(pool["name"], per_zone=pool["nodeCountPerZone"])
        else:
            pool["autoscaling"] = body.get("autoscaling", {})
            kind = TYPE_SET_NODE_POOL_MANAGEMENT
            if simulated:
                assert state.sim is not None
                state.sim.set_autoscaling(pool["name"], pool["autoscaling"])
        name = f"operation-{next(state.ids)}"
        state.operations[name] = {
            "name": name,
            "operationType": kind,
            "status": STATUS_RUNNING,
            "location": match.group(2),
            "targetLink": f"https://container.example/v1/{full}",
        }
        return 200, state.operations[name]


@dataclass
class ContainerServer:
    """A running fake Container API server."""

    server: ThreadingHTTPServer
    state: ContainerState

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def client(self) -> Any:
        """The real google-cloud-container client, REST transport, pointed at this server."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import container_v1

        return container_v1.ClusterManagerClient(
            transport="rest",
            client_options={"api_endpoint": self.endpoint},
            credentials=AnonymousCredentials(),
        )


@contextlib.contextmanager
def container_server_running(*, sim: ClusterSim | None = None) -> Iterator[ContainerServer]:
    state = ContainerState(sim=sim)
    with serving(_Handler, state) as server:
        yield ContainerServer(server, state)
