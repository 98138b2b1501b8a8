"""How the cluster's Argo retries the train and resize tasks (docs/cluster.md, "Argo retries")."""

from __future__ import annotations

from batchpilot.doctor.core import CALL_TIMEOUT_S, Check, Context, fail, ok, skip
from batchpilot.doctor.kube import kube_api

FIX = (
    "set retryPolicy: Always under workflowDefaults.spec.templateDefaults.retryStrategy in ConfigMap {ns}/"
    '{name}, then restart the workflow controller (docs/cluster.md, "Argo retries")'
)


def check_argo_retries(context: Context) -> Check:
    """Reads Argo's workflow-controller-configmap in KFP's namespace and says which tasks Argo retries."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from batchpilot.kfp.argo_retries import CONFIGMAP, retry_case

    api = kube_api(context, "argo retries")
    if isinstance(api, Check):
        return api
    namespace = context.kfp_namespace
    where = f"{namespace}/{CONFIGMAP}"
    try:
        found = client.CoreV1Api(api).read_namespaced_config_map(
            CONFIGMAP, namespace, _request_timeout=CALL_TIMEOUT_S
        )
        data = dict(found.data or {})
    except ApiException as error:
        if error.status == 403:
            return skip("argo retries", f"the caller may not read ConfigMap {where} (HTTP 403)")
        if error.status != 404:
            raise
        data = None  # no ConfigMap: Argo runs on its defaults
    try:
        case = retry_case(data)
    except ValueError as error:
        return fail("argo retries", f"ConfigMap {where}: {error}", FIX.format(ns=namespace, name=CONFIGMAP))
    fix = FIX.format(ns=namespace, name=CONFIGMAP)
    if case.retries_failed and case.retries_deleted:
        return ok(
            "argo retries",
            f"Argo retries a task whether it fails or its pod is deleted (retryPolicy {case.policy}, {case.source})",
        )
    if case.retries_failed:
        return fail(
            "argo retries",
            f"retryPolicy {case.policy} ({case.source}): a task whose pod is deleted before it ends (a node drain or "
            "upgrade, a Spot reclaim) is not retried, so the run fails and its exit handler stops the stage's "
            "trainers",
            fix,
        )
    if case.retries_deleted:
        return fail(
            "argo retries",
            f"retryPolicy {case.policy} ({case.source}): a task that fails on its own is not retried (exit 75 after "
            "an eviction, a resize GKE refused for a moment, a launch that found no capacity), so batchpilot's "
            "retries of the resize and train tasks never run",
            fix,
        )
    return fail(
        "argo retries",
        f"retryPolicy {case.policy} ({case.source}): neither a failed task nor one whose pod is deleted is retried",
        fix,
    )
