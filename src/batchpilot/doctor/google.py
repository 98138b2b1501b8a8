"""Google credentials, the Container API's node pool, and the region's GPU quota."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from batchpilot.config import Config
from batchpilot.credentials import HOW_TO_FIX, google_credentials
from batchpilot.doctor.core import (
    CALL_TIMEOUT_S,
    Check,
    Context,
    Largest,
    fail,
    nodes_text,
    ok,
    one_line,
    skip,
)
from batchpilot.errors import BatchpilotError

COMPUTE_API = "https://compute.googleapis.com"

# GKE accelerator type -> the Compute Engine regional quota metric its GPUs count against (regions.get
# `quotas[].metric`); Spot, preemptible and flex-start VMs count against the same name prefixed PREEMPTIBLE_.
# Sources: the Compute Engine v1 API's Quota.Metric enum (NVIDIA_A100_GPUS, NVIDIA_A100_80GB_GPUS,
# NVIDIA_H100_GPUS, NVIDIA_L4_GPUS, NVIDIA_T4_GPUS, NVIDIA_V100_GPUS, NVIDIA_P100_GPUS, NVIDIA_P4_GPUS,
# NVIDIA_K80_GPUS and their COMMITTED_ forms); NVIDIA_H100_MEGA_GPUS, NVIDIA_H200_GPUS and NVIDIA_B200_GPUS
# (A3 Mega, A3 Ultra, A4) are the names published `gcloud compute regions describe` listings and quota
# requests use, not yet in that enum. regions.get may not list the newer families at all (reports say their
# quota shows only in the Cloud Quotas API), so a metric it does not list is reported as not checked,
# never as zero.
GPU_QUOTA_METRICS = {
    "nvidia-tesla-k80": "NVIDIA_K80_GPUS",
    "nvidia-tesla-p4": "NVIDIA_P4_GPUS",
    "nvidia-tesla-p100": "NVIDIA_P100_GPUS",
    "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    "nvidia-h100-mega-80gb": "NVIDIA_H100_MEGA_GPUS",
    "nvidia-h200-141gb": "NVIDIA_H200_GPUS",
    "nvidia-b200": "NVIDIA_B200_GPUS",
}


@dataclass(frozen=True)
class Google:
    """The credentials doctor uses (None: anonymous, for an emulator)."""

    credentials: Any
    emulator: str | None = None


def check_credentials(context: Context) -> Check:
    """Application Default Credentials and whose they are, found and given a first token the way a run's
    storage and Container API clients get them (`batchpilot.credentials`); none with an http:// emulator."""
    endpoint = context.config.cluster.container_api_endpoint
    if endpoint and endpoint.startswith("http://"):
        message = (
            f"none needed: cluster.container_api_endpoint {endpoint} is an emulator (anonymous credentials)"
        )
        return ok("credentials", message, found=Google(None, emulator=endpoint))
    try:
        credentials = google_credentials(
            field="credentials", scopes=["https://www.googleapis.com/auth/cloud-platform"]
        )
    except BatchpilotError as error:
        return fail("credentials", error.problem, error.fix or HOW_TO_FIX)
    return ok(
        "credentials", f"Application Default Credentials: {_identity(credentials)}", found=Google(credentials)
    )


def _identity(credentials: Any) -> str:
    email = getattr(credentials, "service_account_email", None)
    if email and email != "default":
        return f"service account {email}"
    account = getattr(credentials, "account", None)
    return f"user credentials ({account})" if account else f"user credentials ({type(credentials).__name__})"


def _google(context: Context, name: str) -> Google | Check:
    """The credentials, or the skip line when the credentials check did not pass."""
    found = context.found.get("credentials")
    return found if found is not None else skip(name, "no credentials")


def check_node_pool(context: Context) -> Check:
    """The cluster's node pool exists with the config's machine type, accelerator type and count."""
    from batchpilot.cluster.gke import PoolRef, container_client, require_gke_settings
    from batchpilot.planning.tpu import is_tpu

    google = _google(context, "node pool")
    if isinstance(google, Check):
        return google
    cluster = context.config.cluster
    require_gke_settings(cluster)
    assert cluster.project and cluster.location and cluster.cluster_name and cluster.node_pool
    if is_tpu(cluster.accelerator_type):
        return skip(
            "node pool", "TPU: batchpilot creates one slice pool per launch shape (<node_pool>-<topology>)"
        )
    ref = PoolRef(cluster.project, cluster.location, cluster.cluster_name, cluster.node_pool)
    pools = _node_pools(container_client(api_endpoint=cluster.container_api_endpoint), parent=ref.parent)
    pool = pools.get(cluster.node_pool)
    if pool is None:
        names = ", ".join(sorted(pools)) or "none"
        return fail(
            "node pool",
            f"cluster {cluster.cluster_name} has no node pool {cluster.node_pool!r} (its pools: {names})",
            "create it (docs/cluster.md), or set cluster.node_pool to one of its pools",
        )
    if problem := _pool_problem(pool, context.config):
        return fail("node pool", problem[0], problem[1])
    accelerators = ", ".join(
        f"{a.accelerator_count} x {a.accelerator_type}" for a in pool.config.accelerators
    )
    return ok(
        "node pool",
        f"{cluster.node_pool}: {pool.config.machine_type}, {accelerators or 'no accelerators'}",
        found=pool,
    )


def _node_pools(client: Any, *, parent: str) -> dict[str, Any]:
    """The cluster's node pools by name, one Container API call; its errors as one line naming the fix."""
    from google.api_core import exceptions

    try:
        response = client.list_node_pools(parent=parent, retry=None, timeout=CALL_TIMEOUT_S)
    except exceptions.NotFound as error:
        raise BatchpilotError(
            "cluster.cluster_name",
            f"the Container API has no cluster {parent} ({one_line(error.message)})",
            "check cluster.project, cluster.location and cluster.cluster_name",
        ) from None
    except exceptions.PermissionDenied as error:
        raise BatchpilotError(
            "cluster.project",
            f"the credentials may not list the node pools of {parent} ({one_line(error.message)})",
            "grant container.clusters.get (e.g. roles/container.viewer) to them",
        ) from None
    except (exceptions.GoogleAPIError, OSError) as error:
        raise BatchpilotError(
            "cluster.container_api_endpoint",
            f"cannot list the node pools of {parent}: {one_line(str(error))}",
            "check that the Container API (or cluster.container_api_endpoint) is reachable from here",
        ) from None
    return {pool.name: pool for pool in response.node_pools}


def _pool_problem(pool: Any, config: Config) -> tuple[str, str] | None:
    """(problem, fix) when the pool is not the one the config describes."""
    cluster = config.cluster
    machine = pool.config.machine_type
    if cluster.machine_type and machine != cluster.machine_type:
        return (
            f"node pool {pool.name} has machine type {machine}, cluster.machine_type says {cluster.machine_type}",
            f"set cluster.machine_type: {machine}, or use a pool of {cluster.machine_type}",
        )
    accelerators = {a.accelerator_type: int(a.accelerator_count) for a in pool.config.accelerators}
    wanted = cluster.accelerator_type
    if wanted and wanted not in accelerators:
        found = ", ".join(accelerators) or "none"
        return (
            f"node pool {pool.name} has accelerators {found}, cluster.accelerator_type says {wanted}",
            f"use a pool of {wanted}, or set cluster.accelerator_type to the pool's",
        )
    if wanted and accelerators[wanted] != cluster.devices_per_node:
        return (
            f"node pool {pool.name} has {accelerators[wanted]} {wanted} per node, cluster.devices_per_node says "
            f"{cluster.devices_per_node}",
            f"set cluster.devices_per_node: {accelerators[wanted]}",
        )
    queued = bool(pool.queued_provisioning.enabled)
    if cluster.provisioning == "flex-start" and not (queued and pool.autoscaling.enabled):
        from batchpilot.cluster.provisioning import HOW_TO_CREATE_POOL

        missing = "queued provisioning" if not queued else "autoscaling"
        return (
            f"cluster.provisioning is flex-start, but node pool {pool.name} has no {missing}",
            HOW_TO_CREATE_POOL,
        )
    if cluster.provisioning == "resize" and queued:
        return (
            f"node pool {pool.name} has queued provisioning: its nodes come only for ProvisioningRequests, "
            "cluster.provisioning says resize",
            "set cluster.provisioning: flex-start",
        )
    return None


def check_quota(context: Context) -> Check:
    """The region's GPU quota (Compute Engine regions.get) covers the plan's largest launch."""
    from batchpilot.planning.tpu import is_tpu, is_zone

    google, largest = _google(context, "quota"), context.found.get("plan")
    cluster = context.config.cluster
    if isinstance(google, Check):
        return google
    if largest is None or not cluster.accelerator_type:
        return skip("quota", "no plan" if largest is None else "no cluster.accelerator_type (CPU nodes)")
    if is_tpu(cluster.accelerator_type):
        return skip("quota", "TPU chips count against per-version TPU quotas, which doctor does not read yet")
    metric = GPU_QUOTA_METRICS.get(cluster.accelerator_type)
    if metric is None:
        known = ", ".join(GPU_QUOTA_METRICS)
        return skip("quota", f"no quota metric known for {cluster.accelerator_type} (known: {known})")
    pool = context.found.get("node pool")
    # Flex-start VMs (what a ProvisioningRequest brings) count against the preemptible quota too (GKE "About
    # flex-start provisioning mode", quota requirements), whatever the pool's own Spot setting.
    if cluster.provisioning == "flex-start" or (
        pool is not None and (pool.config.spot or pool.config.preemptible)
    ):
        metric = f"PREEMPTIBLE_{metric}"
    region = str(cluster.location).rsplit("-", 1)[0] if is_zone(cluster.location) else str(cluster.location)
    found = _region(google, project=str(cluster.project), region=region).get("quotas", [])
    quota = next((q for q in found if q.get("metric") == metric), None)
    if quota is None:
        return skip(
            "quota", f"regions.get lists no {metric} quota for {region}: see the console's Quotas page"
        )
    limit, usage = float(quota["limit"]), float(quota["usage"])
    return _covers(metric, region, limit=limit, usage=usage, own=_pool_gpus(context), largest=largest)


def _pool_gpus(context: Context) -> int | None:
    """The GPUs the pool's own nodes hold now (None: Kubernetes not reached). They count as in use, but a
    resize counts the pool at its new size, so they are the launch's too."""
    from batchpilot.cluster.readiness import PoolNodes

    api = context.found.get("kubernetes")
    if api is None:
        return None
    cluster = context.config.cluster
    nodes = PoolNodes(api_client=api, node_pool=str(cluster.node_pool), gpus_per_node=0).states()
    return len(nodes) * cluster.devices_per_node


def _covers(
    metric: str, region: str, *, limit: float, usage: float, own: int | None, largest: Largest
) -> Check:
    """Whether `limit - usage`, plus the GPUs the pool already holds (`own`), covers the largest launch."""
    available = limit - usage + (own or 0)
    held = (
        "none of them counted as the pool's: Kubernetes not reached"
        if own is None
        else f"{own} of them the pool's"
    )
    state = f"{metric} in {region}: limit {limit:g}, {usage:g} in use ({held}), {available:g} for the launch"
    if available < largest.num_devices:
        return fail(
            "quota",
            f"{state}; the largest launch needs {largest.num_devices} ({nodes_text(largest)})",
            f"request a {metric} quota of at least {limit + largest.num_devices - available:g} in {region}, free "
            "GPUs elsewhere, or lower cluster.max_nodes",
        )
    return ok("quota", f"{state}; the largest launch needs {largest.num_devices}")


def _region(google: Google, *, project: str, region: str) -> dict[str, Any]:
    """regions.get (Compute Engine API v1); an emulator endpoint serves it too."""
    import requests

    base = google.emulator or COMPUTE_API
    url = f"{base}/compute/v1/projects/{project}/regions/{region}"
    if google.emulator:
        session: Any = requests.Session()
    else:
        from google.auth.transport.requests import AuthorizedSession

        session = AuthorizedSession(google.credentials, refresh_timeout=CALL_TIMEOUT_S)
    try:
        response = session.get(url, timeout=CALL_TIMEOUT_S)
    except requests.RequestException as error:
        raise BatchpilotError(
            "cluster.location", f"cannot reach {base} to read the region's quotas: {one_line(str(error))}"
        ) from None
    if response.status_code == 200:
        return dict(response.json())
    message = one_line(response.text)
    with contextlib.suppress(ValueError, KeyError, TypeError):  # not Google's error JSON: the text as it is
        message = str(response.json()["error"]["message"])
    fix = {
        403: "grant compute.regions.get (e.g. roles/compute.viewer) to the credentials, or read the quota in the console",
        404: "check cluster.project and cluster.location",
    }.get(response.status_code, "try again; see the message")
    raise BatchpilotError(
        "cluster.location", f"regions.get {project}/{region} answered {response.status_code}: {message}", fix
    )
