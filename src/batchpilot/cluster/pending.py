"""A bound on a launch's pods waiting: a trainer pod that cannot start ends the launch, saying why.

Once the pool's nodes are ready, a trainer pod still Pending after `cluster.pending_timeout_s` will not
start by itself: the scheduler found no node for it (its FailedScheduling event says why, e.g.
`0/16 nodes are available: 16 Insufficient memory`), or its node cannot start the container (the image
cannot be pulled, a secret is missing). Without a bound the train task would follow the JobSet until its
own timeout, days later, with the GPUs billing. `PendingWatch.problem` turns the first such pod into one
line; the launcher then deletes the JobSet and fails the task with it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

# Container waiting reasons that do not resolve by waiting (kubelet's image and container-config errors).
STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError")  # fmt: skip


class PendingWatch:
    """The pods of one launch (by label selector) that have been Pending longer than `bound_s`.

    Args:
        api_client: a Kubernetes ApiClient.
        namespace: the launch's namespace.
        selector: a label selector matching the launch's pods (e.g. its JobSet's name label).
        bound_s: how long a pod may stay Pending, counted from its creation.
        clock: seconds since the epoch (the pods' creationTimestamp is wall-clock time).
    """

    def __init__(
        self,
        *,
        api_client: Any,
        namespace: str,
        selector: str,
        bound_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.selector = selector
        self.bound_s = bound_s
        self.clock = clock

    def problem(self) -> str | None:
        """One line about the first pod Pending for longer than the bound (None: none is)."""
        pods = self._core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            if pod.status is None or pod.status.phase != "Pending" or pod.metadata.deletion_timestamp:
                continue
            created = pod.metadata.creation_timestamp
            if created is None:
                continue
            if isinstance(created, str):
                created = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
            waited = self.clock() - created.timestamp()
            if waited <= self.bound_s:
                continue
            return f"pod {pod.metadata.name} has been Pending for {waited:.0f}s: {self._why(pod)}"
        return None

    def _why(self, pod: Any) -> str:
        """The scheduler's or the kubelet's reason, as they wrote it."""
        for status in pod.status.container_statuses or []:
            waiting = status.state.waiting if status.state else None
            if waiting is not None and waiting.reason in STUCK_REASONS:
                return f"{waiting.reason}: {waiting.message or ''}".strip()
        scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        if scheduled is not None and scheduled.status == "True":
            return "scheduled, but its container has not started"
        events = self._core.list_namespaced_event(
            namespace=self.namespace,
            field_selector=f"involvedObject.name={pod.metadata.name},involvedObject.kind=Pod",
        ).items
        failed = [e for e in events if e.reason == "FailedScheduling"]
        if failed:
            return f"FailedScheduling: {failed[-1].message}"
        if scheduled is not None and scheduled.message:
            return f"{scheduled.reason or 'Unschedulable'}: {scheduled.message}"
        return "not scheduled, and the scheduler has said nothing about it"
