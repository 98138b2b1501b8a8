"""Leases (coordination.k8s.io/v1) for the Kubernetes API stand-in, with or without a simulator.

Rules (Kubernetes API reference "Lease v1 coordination.k8s.io" and "API Concepts"):
- `/apis/coordination.k8s.io/v1/namespaces/NS/leases[/NAME]`: list, create (POST), read, replace (PUT),
  delete; `spec.holderIdentity`, `leaseDurationSeconds`, `acquireTime`, `renewTime` (MicroTime,
  RFC 3339 with microseconds) are stored as sent;
- the name is a DNS subdomain (lowercase alphanumerics, `-`, `.`; at most 253 characters), else 422;
- create of an existing name: 409 AlreadyExists; read, replace or delete of a missing one: 404
  NotFound `leases.coordination.k8s.io "NAME" not found`;
- optimistic concurrency ("API Concepts", resource versions): every write sets a new
  `metadata.resourceVersion`; a replace whose resourceVersion is not the stored one is 409 Conflict
  ("the object has been modified; please apply your changes to the latest version and try again").
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from workload_controllers import now

LEASES = re.compile(r"^/apis/coordination.k8s.io/v1/namespaces/(?P<ns>[^/]+)/leases(?:/(?P<name>[^/]+))?$")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_versions = itertools.count(1)
Key = tuple[str, str]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def _missing(name: str) -> tuple[int, dict[str, Any]]:
    return 404, _status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')


def route(leases: dict[Key, dict[str, Any]], method: str, path: str, body: Any) -> tuple[int, Any] | None:
    """The (code, payload) for a Lease request, or None when the path is no Lease route."""
    match = LEASES.match(path)
    if match is None:
        return None
    ns, name = match.group("ns"), match.group("name")
    if name is None:
        if method == "GET":
            items = [lease for (space, _), lease in sorted(leases.items()) if space == ns]
            return 200, {"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList",
                         "metadata": {"resourceVersion": str(next(_versions))}, "items": items}  # fmt: skip
        if method == "POST":
            return _create(leases, ns, body)
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported here")
    if (ns, name) not in leases:
        return _missing(name)
    if method == "GET":
        return 200, leases[(ns, name)]
    if method == "DELETE":
        del leases[(ns, name)]
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if method == "PUT":
        stored = leases[(ns, name)]
        sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent != stored["metadata"]["resourceVersion"]:
            message = (
                f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again"
            )
            return 409, _status(409, "Conflict", message)
        replaced = {**body, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
        replaced["metadata"] = {**stored["metadata"], "resourceVersion": str(next(_versions))}
        leases[(ns, name)] = replaced
        return 200, replaced
    return 405, _status(405, "MethodNotAllowed", f"{method} is not supported here")


def _create(leases: dict[Key, dict[str, Any]], ns: str, body: Any) -> tuple[int, Any]:
    name = str((body.get("metadata") or {}).get("name", ""))
    if len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        message = f'Lease.coordination.k8s.io "{name}" is invalid: metadata.name: Invalid value: "{name}"'
        return 422, _status(422, "Invalid", message)
    if (ns, name) in leases:
        return 409, _status(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
    created = {**body, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
    created["metadata"] = {**body["metadata"], "namespace": ns, "uid": f"lease-{next(_versions)}",
                           "resourceVersion": str(next(_versions)), "creationTimestamp": now()}  # fmt: skip
    leases[(ns, name)] = created
    return 201, created
