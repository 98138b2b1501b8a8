"""Readers of Kubernetes objects that several cluster modules share (it imports none of them, so any may import
it): an object's conditions by type, and a cluster-scoped custom object that may not exist."""

from __future__ import annotations

from typing import Any


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`status.conditions` of `obj` by type (the last one of a type, as a list keyed by type has one)."""
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def is_true(obj: dict[str, Any], kind: str) -> bool:
    """Whether `obj` has condition `kind` with status True."""
    return conditions(obj).get(kind, {}).get("status") == "True"


def cluster_object(objects: Any, group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
    """The cluster-scoped custom object `plural`/`name` through `objects` (a CustomObjectsApi), or None when
    there is none (404); any other API error is raised."""
    from kubernetes.client.rest import ApiException

    try:
        found: dict[str, Any] = objects.get_cluster_custom_object(
            group, version, plural, name, _request_timeout=30
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return found
