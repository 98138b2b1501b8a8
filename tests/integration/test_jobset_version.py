"""The first launch reads the cluster's JobSet CRD and refuses a JobSet controller too old for batchpilot's
JobSets (failurePolicy.rules exist from v0.6.0), or none, before any pod is created."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from kube_api_server import KubeServer, kube_server_running, published_crds

from batchpilot.cluster.crds import JOBSET_CRD, check_jobset_crd, jobset_crd_problem
from batchpilot.errors import BatchpilotError


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    with kube_server_running() as server:
        yield server


def without_rules(crd: dict) -> dict:
    """The published CRD as a JobSet before v0.6.0 served it: no spec.failurePolicy.rules."""
    old = copy.deepcopy(crd)
    for version in old["spec"]["versions"]:
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        del spec["properties"]["failurePolicy"]["properties"]["rules"]
    return old


def test_the_published_jobset_crd_passes(kube):
    check_jobset_crd(kube.api_client())
    assert any(path.endswith(JOBSET_CRD) for _, path, _, _ in kube.state.requests)


def test_a_jobset_older_than_0_6_0_is_refused_with_the_upgrade_command(kube):
    kube.state.crds = {JOBSET_CRD: without_rules(published_crds()[JOBSET_CRD])}
    with pytest.raises(BatchpilotError) as caught:
        check_jobset_crd(kube.api_client())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cluster.launcher: the cluster's JobSet is older than v0.6.0: its CRD has no ")
    assert (
        "kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/"
        in message
    )


def test_no_jobset_installed_is_refused(kube):
    kube.state.crds = {}
    with pytest.raises(BatchpilotError, match=r"^cluster.launcher: JobSet is not installed in the cluster"):
        check_jobset_crd(kube.api_client())


def test_a_crd_that_does_not_serve_v1alpha2_is_named():
    crd = copy.deepcopy(published_crds()[JOBSET_CRD])
    for version in crd["spec"]["versions"]:
        version["served"] = False
    assert jobset_crd_problem(crd) == "the cluster's JobSet CRD does not serve v1alpha2 (served: none)"
