"""Flex-start with queued provisioning, without a cluster: the ProvisioningRequest and its PodTemplate
(against the published CRD and kubernetes-validate), the JobSet pods that consume it, and the settings
flex-start refuses."""

from __future__ import annotations

import copy

import pytest
from test_cluster_launch import dryrun, gke_config, validate_k8s

from batchpilot.cluster.provisioning import (
    CLASS_ANNOTATION,
    CONSUME_ANNOTATION,
    PROVISIONING_CLASS,
    describe,
    max_run_duration_s,
    pod_template_manifest,
    provisioning_request_manifest,
)
from batchpilot.config import parse_config
from batchpilot.plan.checks import plan_problems
from helpers import validate_crd

CRD = "autoscaling.x-k8s.io_provisioningrequests.yaml"
LABELS = {
    "batchpilot.dev/run": "ramp",
    "batchpilot.dev/stage": "final",
    "batchpilot.dev/plan": "0123456789ab",
}
QUEUED_TOLERATION = {
    "key": "cloud.google.com/gke-queued",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


@pytest.fixture(scope="module")
def flex_jobset(tmp_path_factory) -> dict:
    return dryrun(tmp_path_factory.mktemp("flex"), "final", provisioning="flex-start")


def test_the_request_validates_against_the_published_crd_and_asks_for_the_launchs_nodes():
    request = provisioning_request_manifest(
        name="ramp-final-1a2b3c4d", namespace="batchpilot", labels=LABELS, count=4, max_run_duration_s=86400
    )
    validate_crd(request, CRD, version="v1")
    assert request["apiVersion"] == "autoscaling.x-k8s.io/v1"
    assert request["spec"] == {
        "provisioningClassName": "queued-provisioning.gke.io",
        "parameters": {"maxRunDurationSeconds": "86400"},
        "podSets": [{"count": 4, "podTemplateRef": {"name": "ramp-final-1a2b3c4d"}}],
    }
    assert request["metadata"]["labels"] == LABELS  # found again by a retry and the exit handler
    broken = copy.deepcopy(request)
    broken["spec"]["podSets"][0]["count"] = 0  # the CRD's minimum is 1
    with pytest.raises(Exception, match="less than the minimum of 1"):
        validate_crd(broken, CRD, version="v1")


def test_the_run_duration_is_the_stage_timeout_at_most_gkes_seven_days():
    assert max_run_duration_s(3600.0) == 3600
    assert max_run_duration_s(30 * 24 * 3600.0) == 7 * 24 * 3600


def test_the_jobset_pods_consume_the_request_named_as_the_jobset_and_tolerate_the_queued_taint(flex_jobset):
    validate_crd(flex_jobset, "jobset.x-k8s.io_jobsets.yaml")
    (replicated,) = flex_jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"][CONSUME_ANNOTATION] == flex_jobset["metadata"]["name"]
    assert pod["metadata"]["annotations"][CLASS_ANNOTATION] == PROVISIONING_CLASS
    assert QUEUED_TOLERATION in pod["spec"]["tolerations"]


def test_a_resize_config_renders_no_consumption(tmp_path):
    (replicated,) = dryrun(tmp_path, "final")["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    assert CONSUME_ANNOTATION not in pod["metadata"].get("annotations", {})
    assert QUEUED_TOLERATION not in pod["spec"]["tolerations"]


def test_the_pod_template_is_the_trainer_pods_own_and_a_valid_podtemplate(flex_jobset):
    (replicated,) = flex_jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    template = pod_template_manifest(
        name="ramp-final-1a2b3c4d", namespace="batchpilot", labels=LABELS, pod=pod
    )
    validate_k8s(template)
    spec = template["template"]["spec"]
    assert spec["nodeSelector"] == pod["spec"]["nodeSelector"]
    assert spec["nodeSelector"]["cloud.google.com/gke-nodepool"] == "h100"
    assert spec["tolerations"] == pod["spec"]["tolerations"]
    (container,) = spec["containers"]
    assert container["resources"] == pod["spec"]["containers"][0]["resources"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_the_state_is_said_with_gkes_reason():
    waiting = {"status": {"conditions": [
        {"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""},
        {"type": "Provisioned", "status": "False", "reason": "NotProvisioned", "message": "no capacity"},
    ]}}  # fmt: skip
    assert describe(waiting) == "Accepted, not Provisioned (NotProvisioned: no capacity)"
    failed = copy.deepcopy(waiting)
    failed["status"]["conditions"].append(
        {"type": "Failed", "status": "True", "reason": "OutOfResources", "message": "out of a3"}
    )
    assert describe(failed) == "Failed (OutOfResources: out of a3)"
    assert describe({"status": {}}) == "not accepted yet (no condition)"


def problems(**cluster: object) -> list[str]:
    return [str(p) for p in plan_problems(parse_config(gke_config(provisioning="flex-start", **cluster)))]


def test_a_flex_start_gpu_config_on_a_jobset_is_accepted():
    assert problems() == []


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({"launcher": "volcano"}, "cluster.launcher: flex-start needs the jobset launcher"),
        ({"pool_mode": "static"}, "cluster.pool_mode: static cannot be used with flex-start"),
        ({"fewer_nodes": "allow"}, "cluster.fewer_nodes: allow has no effect with flex-start"),
        (
            {"accelerator_type": None},
            "cluster.accelerator_type: flex-start with queued provisioning is for GPU",
        ),
    ],
)
def test_what_flex_start_cannot_work_with_is_one_line_naming_the_field_and_the_fix(cluster, expected):
    found = [line for line in problems(**cluster) if "flex-start" in line]
    assert len(found) == 1 and found[0].startswith(expected), found
    assert "(fix: " in found[0] and "\n" not in found[0]


def test_a_tpu_config_is_told_flex_start_is_not_supported_here():
    from batchpilot.planning.provisioning import provisioning_problems

    (problem,) = provisioning_problems(
        provisioning="flex-start", backend="gke", launcher="jobset", accelerator_type="tpu-v6e-slice",
        pool_mode="resize", fewer_nodes="fail",
    )  # fmt: skip
    assert str(problem).startswith("cluster.provisioning: flex-start is not supported here for TPU slices")


def test_a_local_backend_with_flex_start_is_refused():
    from batchpilot.planning.provisioning import provisioning_problems

    (problem,) = provisioning_problems(
        provisioning="flex-start", backend="local", launcher="jobset", accelerator_type=None,
        pool_mode="resize", fewer_nodes="fail",
    )  # fmt: skip
    assert str(problem).startswith(
        "cluster.provisioning: flex-start asks GKE for nodes, but cluster.backend is local"
    )


def test_flex_start_beside_a_kueue_queue_is_accepted_and_keeps_flex_starts_refusals():
    """Issue #37: Kueue's ProvisioningRequest admission check asks GKE for the nodes (no request of batchpilot's
    beside it), so the pair passes the config check; what flex-start cannot work with is still refused."""
    assert problems(kueue_queue="team-a") == []
    from batchpilot.cluster.kueue import FLEX_START_CLASS

    assert FLEX_START_CLASS == PROVISIONING_CLASS  # the class the queue's check must have is the one we write
    (found,) = problems(kueue_queue="team-a", fewer_nodes="allow")
    assert found.startswith("cluster.fewer_nodes: allow has no effect with flex-start") and "Kueue" in found


@pytest.fixture(scope="module")
def kueue_flex_jobset(tmp_path_factory) -> dict:
    return dryrun(
        tmp_path_factory.mktemp("kueue-flex"), "final", provisioning="flex-start", kueue_queue="team-a"
    )


def test_through_kueue_the_pods_consume_nothing_of_their_own_and_the_jobset_carries_the_run_duration(
    kueue_flex_jobset,
):
    """Kueue writes the consume annotations (its own request's name) at admission; the JobSet's
    `provreq.kueue.x-k8s.io/maxRunDurationSeconds` becomes its request's parameter: the stage timeout (30 days
    by default) at most GKE's 7 days."""
    validate_crd(kueue_flex_jobset, "jobset.x-k8s.io_jobsets.yaml")
    assert kueue_flex_jobset["metadata"]["annotations"] == {
        "provreq.kueue.x-k8s.io/maxRunDurationSeconds": "604800"
    }
    assert kueue_flex_jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    (replicated,) = kueue_flex_jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    assert CONSUME_ANNOTATION not in (pod["metadata"].get("annotations") or {})
    assert CLASS_ANNOTATION not in (pod["metadata"].get("annotations") or {})
    assert QUEUED_TOLERATION in pod["spec"]["tolerations"]


def test_through_kueue_the_next_launchs_request_is_not_queued_ahead_and_says_why():
    from batchpilot.workflow.ahead import ahead_unavailable

    config = parse_config(gke_config(provisioning="flex-start", kueue_queue="team-a"))
    why = ahead_unavailable(config)
    assert why is not None and why.startswith(
        "with cluster.kueue_queue, Kueue's ProvisioningRequest admission check"
    )
    assert ahead_unavailable(parse_config(gke_config(provisioning="flex-start"))) is None
