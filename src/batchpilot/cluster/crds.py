"""The JobSet controller the cluster runs must understand what batchpilot's JobSets ask for.

batchpilot's JobSets fail at once on a trainer error and restart only after a disruption
(`spec.failurePolicy.rules`, `jobset.failure_policy`). Those rules exist from JobSet v0.6.0 (kubernetes-
sigs/jobset, "Implement configurable failure policy", first released in v0.6.0); an older controller's
CRD has no such field, the API server prunes it as an unknown field, and the JobSet then restarts on
every error until `maxRestarts`, retraining from the last checkpoint each time. The CRD of the served
`v1alpha2` version says which it is, so the first launch reads it and refuses, with the upgrade command,
before any pod is created.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

JOBSET_CRD = "jobsets.jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
MIN_JOBSET_RELEASE = "v0.6.0"
UPGRADE = (
    "install or upgrade JobSet (v0.6.0 or later), e.g. `kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml`"
)


def jobset_crd_problem(crd: dict[str, Any]) -> str | None:
    """Why this JobSet CRD cannot run batchpilot's JobSets (None: it can)."""
    versions = {v.get("name"): v for v in crd.get("spec", {}).get("versions", [])}
    served = versions.get(JOBSET_VERSION)
    if served is None or not served.get("served"):
        found = ", ".join(name for name, v in versions.items() if v.get("served")) or "none"
        return f"the cluster's JobSet CRD does not serve {JOBSET_VERSION} (served: {found})"
    spec = served.get("schema", {}).get("openAPIV3Schema", {}).get("properties", {}).get("spec", {})
    policy = spec.get("properties", {}).get("failurePolicy", {}).get("properties", {})
    if "rules" not in policy:
        return (
            f"the cluster's JobSet is older than {MIN_JOBSET_RELEASE}: its CRD has no spec.failurePolicy.rules, "
            "so the API server would drop the rules that fail a launch on a trainer error, and every error "
            "would restart the JobSet"
        )
    return None


def check_jobset_crd(api_client: Any) -> None:
    """Reads the JobSet CRD and raises one line when it is missing, unreadable or too old."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        # The raw JSON: the CRD's schema is large, and only a few of its keys are read here.
        response = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(
            JOBSET_CRD, _preload_content=False
        )
        crd = json.loads(response.data)
    except ApiException as error:
        if error.status == 404:
            raise BatchpilotError(
                "cluster.launcher", f"JobSet is not installed in the cluster (no CRD {JOBSET_CRD})", UPGRADE
            ) from None
        if error.status in (401, 403):
            raise BatchpilotError(
                "cluster.service_account",
                f"cannot read the CRD {JOBSET_CRD} to check the JobSet version ({error.status} {error.reason})",
                "grant `get` on customresourcedefinitions (the chart's ClusterRole does)",
            ) from None
        raise
    problem = jobset_crd_problem(crd)
    if problem:
        raise BatchpilotError("cluster.launcher", problem, UPGRADE)
    logger.info(
        "JobSet CRD %s serves %s with failurePolicy.rules (v0.6.0 or later)", JOBSET_CRD, JOBSET_VERSION
    )
