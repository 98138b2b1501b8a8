"""Why the train task got SIGTERM (`cluster.eviction`), the rules a one-line slip would break unseen:

- a pod with the condition `DisruptionTarget=True` is being evicted, also before its deletion shows;
- a pod with `DisruptionTarget` whose status is not "True" and no deletionTimestamp is a cancel;
- a pod with a deletionTimestamp and no such condition (a graceful node shutdown, a plain delete) is being
  evicted;
- SIGTERM that is no eviction raises `Cancelled` (a KeyboardInterrupt, cleaned up as Ctrl-C is), an
  eviction raises `Evicted` (no KeyboardInterrupt), and the block's end puts the previous handler back.

The pod is read through the real kubernetes client (`CoreV1Api`, its deserializer); only its transport is a
stand-in (`PodApiClient.request` answers the one GET with the pod's JSON), so no server or process runs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from batchpilot.cluster.eviction import (
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    Cancelled,
    Evicted,
    SigtermCause,
    sigterm_cause,
    sigterm_interrupts,
)

NAMESPACE, NAME = "kubeflow", "ramp-train-abc"
ENV = {POD_NAME_ENV: NAME, POD_NAMESPACE_ENV: NAMESPACE}


class Response:
    """What the client's REST layer returns: status, JSON bytes, headers."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.status, self.reason, self.data = 200, "OK", json.dumps(body).encode()

    def getheaders(self) -> dict[str, str]:
        return {"content-type": "application/json"}


class PodApiClient(ApiClient):
    """A kubernetes ApiClient whose transport serves one pod object (404 for any other path)."""

    def __init__(self, pod: dict[str, Any]) -> None:
        super().__init__()
        self.pod = pod

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Response:
        if method == "GET" and url.endswith(f"/api/v1/namespaces/{NAMESPACE}/pods/{NAME}"):
            return Response(self.pod)
        raise ApiException(status=404, reason="Not Found")


def pod(*, conditions: list[dict[str, str]], deleted: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": NAME, "namespace": NAMESPACE}
    if deleted:
        metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": {"conditions": conditions}}


def cause_of(served: dict[str, Any]) -> SigtermCause:
    return sigterm_cause(env=ENV, api_client=lambda: PodApiClient(served))


READY = {"type": "Ready", "status": "True"}


def test_disruption_target_true_is_an_eviction_before_the_deletion_shows():
    disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
    cause = cause_of(pod(conditions=[READY, disrupted], deleted=False))
    assert cause == SigtermCause(True, f"pod {NAME} has DisruptionTarget (PreemptionByScheduler)")


def test_disruption_target_not_true_on_a_pod_not_being_deleted_is_a_cancel():
    cleared = {"type": "DisruptionTarget", "status": "False", "reason": "PreemptionByScheduler"}
    cause = cause_of(pod(conditions=[READY, cleared], deleted=False))
    assert cause == SigtermCause(False, f"pod {NAME} is not being deleted (a cancel or a deadline)")


def test_a_pod_being_deleted_without_the_condition_is_an_eviction():
    cause = cause_of(pod(conditions=[READY], deleted=True))
    assert cause == SigtermCause(True, f"pod {NAME} is being deleted")


def test_a_pod_neither_disrupted_nor_deleted_is_a_cancel():
    cause = cause_of(pod(conditions=[READY], deleted=False))
    assert cause == SigtermCause(False, f"pod {NAME} is not being deleted (a cancel or a deadline)")


def sigterm_within(classify: Any) -> None:
    """SIGTERM to this process inside the block; the handler raises within the bounded sleep."""
    with sigterm_interrupts(classify=classify):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler's exception ends it at once


def test_sigterm_that_is_no_eviction_raises_cancelled_with_its_cause():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Cancelled) as raised:
        sigterm_within(lambda: SigtermCause(False, "pod p is not being deleted (a cancel or a deadline)"))
    assert isinstance(raised.value, KeyboardInterrupt)
    assert raised.value.why == "pod p is not being deleted (a cancel or a deadline)"
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_that_is_an_eviction_raises_evicted_which_is_no_keyboard_interrupt():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Evicted) as raised:
        sigterm_within(lambda: SigtermCause(True, "pod p is being deleted"))
    assert not isinstance(raised.value, KeyboardInterrupt)
    assert raised.value.why == "pod p is being deleted"
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_without_a_classifier_is_a_cancel():
    with pytest.raises(Cancelled) as raised:
        sigterm_within(None)
    assert raised.value.why == f"signal {int(signal.SIGTERM)}"
