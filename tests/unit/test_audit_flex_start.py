"""A launch's ProvisioningRequest (`cluster.provisioning`), the rules a one-line slip would break unseen:

- a Provisioned request whose capacity was revoked (CapacityRevoked) is refused, consumed or not; one whose
  booking expired (BookingExpired) is refused unless the launch's pods already run on its nodes (`consumed`);
- a retried launch never adopts an ended request (Failed, CapacityRevoked, BookingExpired unconsumed) or one
  being deleted: it is deleted, and a live request of the same plan is adopted;
- `flex_start_capacity` deletes the request when the block ends, fails, or is cancelled, but leaves it when
  this task's pod is evicted (`Evicted`: the retry adopts it) or the block hands it over;
- `describe()` names an end condition before Provisioned: a Provisioned request that ended says how it ended.

The API is `RequestStore`, an in-memory stand-in with `provisioning.Requests`' surface (list by labels, get,
create, delete); the requests are the real manifests (`provisioning_request_manifest`) with GKE's conditions.
The conditions and what they mean are the ProvisioningRequest API's (kubernetes/autoscaler,
cluster-autoscaler/apis/provisioningrequest/autoscaling.x-k8s.io/v1/types.go): Accepted; Provisioned (every
requested resource created and registered); Failed (the resources cannot be obtained); BookingExpired (it was
Provisioned and its capacity reservation time expired); CapacityRevoked (the requested resources are no longer
valid). A list by labels matches every given label (a Kubernetes equality-based label selector).
"""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot.cluster import provisioning
from batchpilot.cluster.eviction import Cancelled, Evicted
from batchpilot.cluster.provisioning import (
    adopt_or_clear,
    describe,
    flex_start_capacity,
    provisioning_request_manifest,
    wait_provisioned,
)
from batchpilot.errors import BatchpilotError

NS = "batchpilot"
PLAN = "0123456789ab"
LABELS = {"batchpilot.dev/run": "ramp", "batchpilot.dev/stage": "final", "batchpilot.dev/plan": PLAN}
PROVISIONED = ("Provisioned", "True", "Provisioned", "nodes are ready")


class RequestStore:
    """`provisioning.Requests` over a dict: the requests by name, and the names deleted in order."""

    def __init__(self, *requests: dict[str, Any]) -> None:
        self.requests = {r["metadata"]["name"]: r for r in requests}
        self.deleted: list[str] = []

    def list(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [
            r for r in self.requests.values() if labels.items() <= (r["metadata"].get("labels") or {}).items()
        ]

    def get(self, name: str) -> dict[str, Any]:
        return self.requests[name]

    def create(self, *, template: dict[str, Any], request: dict[str, Any]) -> None:
        assert template["metadata"]["name"] == request["metadata"]["name"]
        self.requests[request["metadata"]["name"]] = request

    def delete(self, name: str, *, why: str) -> None:
        self.requests.pop(name, None)
        self.deleted.append(name)


def request(name: str, *conditions: tuple[str, str, str, str], plan: str = PLAN) -> dict[str, Any]:
    manifest = provisioning_request_manifest(
        name=name,
        namespace=NS,
        labels={**LABELS, "batchpilot.dev/plan": plan},
        count=2,
        max_run_duration_s=3600,
    )
    manifest["status"] = {
        "conditions": [
            {"type": kind, "status": status, "reason": reason, "message": message}
            for kind, status, reason, message in conditions
        ]
    }
    return manifest


REVOKED = ("CapacityRevoked", "True", "CapacityRevoked", "nodes taken back")
EXPIRED = ("BookingExpired", "True", "CapacityReservationTimeExpired", "booking over")
FAILED = ("Failed", "True", "OutOfResources", "out of a3")


def wait(store: RequestStore, name: str, *, consumed: bool = False) -> None:
    wait_provisioned(store, name=name, count=2, timeout_s=0.0, poll_s=0.0, consumed=consumed)


@pytest.mark.parametrize("consumed", [False, True])
def test_a_provisioned_request_whose_capacity_was_revoked_is_refused(consumed):
    store = RequestStore(request("r", PROVISIONED, REVOKED))
    with pytest.raises(BatchpilotError) as refused:
        wait(store, "r", consumed=consumed)
    assert (
        "ProvisioningRequest r for 2 node(s) ended: CapacityRevoked (CapacityRevoked: nodes taken back)"
        in str(refused.value)
    )


def test_a_provisioned_request_whose_booking_expired_is_refused_before_the_pods_run_on_it():
    store = RequestStore(request("r", PROVISIONED, EXPIRED))
    with pytest.raises(BatchpilotError, match="ended: BookingExpired"):
        wait(store, "r")
    wait(store, "r", consumed=True)  # the launch's pods hold the nodes: the request is still its own


def test_a_provisioned_request_that_did_not_end_is_taken():
    wait(RequestStore(request("r", PROVISIONED)), "r")


@pytest.mark.parametrize("end", [FAILED, REVOKED, EXPIRED], ids=lambda c: c[0])
def test_an_ended_request_is_not_adopted_but_deleted(end):
    store = RequestStore(request("old", PROVISIONED, end))
    assert adopt_or_clear(store, labels=LABELS, name="new") is None
    assert store.deleted == ["old"]


def test_a_request_being_deleted_is_not_adopted():
    going = request("going", PROVISIONED)
    going["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    store = RequestStore(going)
    assert adopt_or_clear(store, labels=LABELS, name="new") is None
    assert store.deleted == ["going"]


def test_a_live_request_of_the_plan_is_adopted_and_the_others_deleted():
    store = RequestStore(
        request("ended", PROVISIONED, FAILED),
        request("live", PROVISIONED),
        request("other-plan", PROVISIONED, plan="ba9876543210"),
    )
    adopted = adopt_or_clear(store, labels=LABELS, name="new")
    assert adopted is not None and adopted["metadata"]["name"] == "live"
    assert sorted(store.deleted) == ["ended", "other-plan"]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> RequestStore:
    """The launch's live, Provisioned request, which flex_start_capacity adopts through the stand-in."""
    found = RequestStore(request("launch", PROVISIONED))
    monkeypatch.setattr(provisioning, "Requests", lambda api_client, namespace: found)
    return found


def capacity() -> Any:
    return flex_start_capacity(
        api_client=None, namespace=NS, name="launch", labels=LABELS, pod={"spec": {}}, count=2,
        timeout_s=0.0, stage_timeout_s=3600.0, poll_s=0.0,
    )  # fmt: skip


def test_an_evicted_task_leaves_its_request_for_the_retry(store):
    with pytest.raises(Evicted), capacity():
        raise Evicted("pod p has DisruptionTarget (EvictionByEvictionAPI)")
    assert store.deleted == [] and "launch" in store.requests


def test_a_cancelled_or_failed_or_ended_launch_deletes_its_request(store):
    with pytest.raises(Cancelled), capacity():
        raise Cancelled("pod p is not being deleted (a cancel or a deadline)")
    assert store.deleted == ["launch"]
    store.requests["launch"] = request("launch", PROVISIONED)
    with pytest.raises(RuntimeError), capacity():
        raise RuntimeError("the JobSet failed")
    assert store.deleted == ["launch", "launch"]
    store.requests["launch"] = request("launch", PROVISIONED)
    with capacity():
        pass
    assert store.deleted == ["launch", "launch", "launch"]


def test_a_request_handed_over_is_kept(store):
    with capacity() as handover:
        handover.hand_over("ramp-final")
    assert store.deleted == []


def test_describe_names_how_a_provisioned_request_ended():
    assert describe(request("r", PROVISIONED)) == "Provisioned"
    assert (
        describe(request("r", PROVISIONED, REVOKED)) == "CapacityRevoked (CapacityRevoked: nodes taken back)"
    )
    assert describe(request("r", PROVISIONED, FAILED)) == "Failed (OutOfResources: out of a3)"
    waiting = ("Provisioned", "False", "NotProvisioned", "no capacity")
    assert describe(request("r", ("Accepted", "True", "Accepted", ""), waiting)) == (
        "Accepted, not Provisioned (NotProvisioned: no capacity)"
    )
