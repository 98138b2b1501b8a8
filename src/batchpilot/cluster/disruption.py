"""A PodDisruptionBudget over the train (or canary) task's own pod while it follows its launch, so that a
node drain, a node upgrade or a cluster-autoscaler scale-down does not evict it.

Why the task protects itself: whether Argo retries a task whose pod was deleted depends on the cluster's
Argo configuration (batchpilot.kfp.argo_retries; docs/cluster.md, "Argo retries"), and under Argo's
default it is not retried: the run fails and its exit handler stops the trainers. Eviction is the one
way a healthy pod is deleted that a budget can refuse.

Rules (facts from Kubernetes):
- a budget over pods no scalable controller owns (Argo's task pods are owned by their Workflow) may
  use only an integer `minAvailable` (kubernetes.io "Configure a PodDisruptionBudget", "Arbitrary
  workloads and arbitrary selectors"); the disruption controller then allows `healthy pods - minAvailable`
  evictions (pkg/controller/disruption/disruption.go), so `minAvailable: 1` over this one pod allows none;
- the Eviction API answers 429 TooManyRequests while a pod's budget allows no disruption, and refuses a
  pod that more than one budget covers (pkg/registry/core/pod/storage/eviction.go);
- a selector can only match labels, and neither Argo nor KFP gives a task pod a label of its own
  (argo-workflows workflowpod.go, kubeflow/pipelines argocompiler): the task labels its own pod with
  its UID, and the budget selects that label;
- the budget is owned by the pod (an ownerReference), so the garbage collector removes it with the pod
  even when the task is killed before it deletes the budget itself.

It does not stop what ignores budgets: a Spot reclaim or a node failure (the compiled task pods avoid
Spot and preemptible nodes; `batchpilot.kfp.pipeline`), or a GKE upgrade past its one-hour respect for
budgets. A cluster that refuses any of the calls (no RBAC for pods/patch or poddisruptionbudgets) gets one
warning line and an unprotected task, never a failed launch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV

logger = logging.getLogger(__name__)

PROTECTED_LABEL = "batchpilot.dev/protected-pod"
"""On the task's own pod, its UID: what its budget selects."""


def budget_name(pod_uid: str) -> str:
    return f"batchpilot-task-{pod_uid}"


def budget_manifest(*, pod_name: str, pod_uid: str, namespace: str) -> dict[str, Any]:
    """The budget over the one pod labelled with `pod_uid`, owned by that pod."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": budget_name(pod_uid),
            "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}],
        },
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {PROTECTED_LABEL: pod_uid}}},
    }


@contextlib.contextmanager
def own_pod_budget(
    *, env: Mapping[str, str] = os.environ, api_client: Callable[[], Any] | None = None
) -> Iterator[None]:
    """Within the block, a budget refuses the eviction of the task's own pod (named by the downward API's
    BATCHPILOT_POD_NAME / BATCHPILOT_POD_NAMESPACE; without them, not a pipeline task: nothing to do)."""
    name, namespace = env.get(POD_NAME_ENV), env.get(POD_NAMESPACE_ENV)
    if not name or not namespace:
        yield
        return
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    if api_client is None:
        from batchpilot.cluster.readiness import kube_api_client

        api_client = kube_api_client
    api = api_client()
    core, policy = client.CoreV1Api(api), client.PolicyV1Api(api)
    created = None
    try:
        uid = core.read_namespaced_pod(name, namespace, _request_timeout=10).metadata.uid
        core.patch_namespaced_pod(
            name, namespace, {"metadata": {"labels": {PROTECTED_LABEL: uid}}}, _request_timeout=10
        )
        body = budget_manifest(pod_name=name, pod_uid=uid, namespace=namespace)
        try:
            policy.create_namespaced_pod_disruption_budget(namespace, body, _request_timeout=10)
        except ApiException as error:
            if error.status != 409:  # a retried process in the same pod finds its budget there
                raise
        created = budget_name(uid)
        logger.info("task pod %s: PodDisruptionBudget %s refuses its eviction while it follows the launch",
                    name, created)  # fmt: skip
    except ApiException as error:
        logger.warning(
            "task pod %s: cannot protect it with a PodDisruptionBudget (HTTP %s %s): a node drain or upgrade "
            "may evict it (the chart's Role grants pods/patch and poddisruptionbudgets)",
            name, error.status, error.reason,
        )  # fmt: skip
    try:
        yield
    finally:
        if created is not None:
            with contextlib.suppress(ApiException):  # gone already, or the garbage collector's job
                policy.delete_namespaced_pod_disruption_budget(created, namespace, _request_timeout=10)
