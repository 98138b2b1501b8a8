"""`batchpilot doctor`: is the cluster in front of the user the one the config and its plan assume?

Each check is a small function of what the checks before it found (`Context.found`) that returns one
`Check`: passed, FAILED with the fix, or skipped with why. A check whose prerequisite did not pass is
skipped, not run (no credentials: no Container API call). Every network call has a short timeout
(`CALL_TIMEOUT_S`) and no long retry, and each check runs under its own bound (`CHECK_TIMEOUT_S`), so an
unreachable endpoint costs seconds, not minutes.

Order on gke: plan, credentials, node pool, quota, kubernetes, rbac, jobset crd, gpu driver, gpu nodes,
data, checkpoint, kfp. On local: plan, cloud (skipped), cpus, (credentials when a URI is gs://), data,
checkpoint, kfp. The Kubernetes checks run as whoever the kubeconfig (or the pod's service account) is:
the KFP run's own account may hold other grants (docs/cluster.md, "Identity").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError

CALL_TIMEOUT_S = 5.0
"""The most one network call may take (connect and read)."""
CHECK_TIMEOUT_S = 20.0
"""The most one check may take, whatever its calls do (a backstop for retries inside client libraries)."""
MIN_KFP_BACKEND = (2, 5, 0)
"""Task retries on the Argo backend need KFP 2.5.0 (docs/cluster.md, "KFP version")."""
COMPUTE_API = "https://compute.googleapis.com"
DRIVER_DAEMONSET = ("kube-system", "nvidia-driver-installer")
"""The DaemonSet GKE's manual driver installation applies (GoogleCloudPlatform/container-engine-
accelerators, nvidia-driver-installer/cos/daemonset-preloaded.yaml: that name, in kube-system)."""
DRIVER_MANIFEST = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/"
    "nvidia-driver-installer/cos/daemonset-preloaded.yaml"
)

# GKE accelerator type -> the Compute Engine regional quota metric its GPUs count against (regions.get
# `quotas[].metric`); Spot and preemptible VMs count against the same name prefixed PREEMPTIBLE_.
# Sources: the Compute Engine v1 API's Quota.Metric enum (NVIDIA_A100_GPUS, NVIDIA_A100_80GB_GPUS,
# NVIDIA_H100_GPUS, NVIDIA_L4_GPUS, NVIDIA_T4_GPUS, NVIDIA_V100_GPUS, NVIDIA_P100_GPUS, NVIDIA_P4_GPUS,
# NVIDIA_K80_GPUS and their COMMITTED_ forms) and the quota names Compute Engine lists for A3 Mega, A3
# Ultra and A4 VMs (NVIDIA_H100_MEGA_GPUS, NVIDIA_H200_GPUS, NVIDIA_B200_GPUS). regions.get may not list the
# newer families at all (their quota lives only in the Cloud Quotas API); a metric it does not list is
# reported as not checked, never as zero.
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

Status = Literal["passed", "FAILED", "skipped"]


@dataclass(frozen=True)
class Check:
    """The outcome of one check: what `line()` prints, and what later checks may use (`found`)."""

    name: str
    status: Status
    message: str
    fix: str | None = None
    found: Any = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        text = f"{self.name}: {self.status}: {self.message}"
        return f"{text} (fix: {self.fix})" if self.fix else text


def ok(name: str, message: str, *, found: Any = True) -> Check:
    return Check(name, "passed", message, found=found)


def fail(name: str, message: str, fix: str) -> Check:
    return Check(name, "FAILED", message, fix)


def skip(name: str, why: str) -> Check:
    return Check(name, "skipped", why)


@dataclass
class Context:
    """The config, the command's options, and what each passed check found, by check name."""

    config: Config
    kfp_host: str | None = None
    kfp_token: str | None = None
    found: dict[str, Any] = field(default_factory=dict)


Step = tuple[str, Callable[[Context], Check]]


def run_checks(
    config: Config, *, kfp_host: str | None = None, kfp_token: str | None = None
) -> Iterator[Check]:
    """Every check for `config`, in order, each as soon as it is done."""
    context = Context(config=config, kfp_host=kfp_host, kfp_token=kfp_token)
    for name, step in steps(config):
        check = bounded(name, step, context)
        if check.status == "passed":
            context.found[name] = check.found
        yield check


def steps(config: Config) -> list[Step]:
    storage = [("data", check_data), ("checkpoint", check_checkpoint), ("kfp", check_kfp)]
    if config.cluster.backend == "local":
        uris = (config.data.uri, config.train.checkpoint_uri)
        google = [("credentials", check_credentials)] if any(u.startswith("gs://") for u in uris) else []
        return [("plan", check_plan), ("cloud", skip_cloud), ("cpus", check_cpus), *google, *storage]
    return [
        ("plan", check_plan),
        ("credentials", check_credentials),
        ("node pool", check_node_pool),
        ("quota", check_quota),
        ("kubernetes", check_kubernetes),
        ("rbac", check_rbac),
        ("jobset crd", check_jobset_crd),
        ("gpu driver", check_gpu_driver),
        ("gpu nodes", check_gpu_nodes),
        *storage,
    ]


def bounded(name: str, step: Callable[[Context], Check], context: Context) -> Check:
    """Runs one check in a thread for at most CHECK_TIMEOUT_S; an error becomes its FAILED line."""
    result: list[Check] = []

    def work() -> None:
        try:
            result.append(step(context))
        except BatchpilotError as error:
            result.append(fail(name, one_line(f"{error.field}: {error.problem}"), error.fix or "see above"))
        except Exception as error:  # a doctor prints lines, never a traceback
            problem = f"unexpected {type(error).__name__}: {one_line(str(error))}"
            result.append(fail(name, problem, "report it as a batchpilot bug, with this line"))

    thread = threading.Thread(target=work, name=f"doctor-{name}", daemon=True)
    thread.start()
    thread.join(CHECK_TIMEOUT_S)
    if not result:
        return fail(
            name, f"did not finish within {CHECK_TIMEOUT_S:.0f}s", "check that its endpoint is reachable"
        )
    return result[0]


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# --- the plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Largest:
    """The plan's largest launch: `num_nodes` nodes of `devices_per_node` devices."""

    num_nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


def check_plan(context: Context) -> Check:
    """The largest launch, from the planner without exploring (cluster.max_nodes when the micro batch or
    the target is decided at run time)."""
    from batchpilot.planner import build_plan
    from batchpilot.planning.launches import launches

    config = context.config
    devices = config.cluster.devices_per_node
    undecided = [
        f"batch.{name} is {value}"
        for name, value in (
            ("micro_batch_size", config.batch.micro_batch_size),
            ("global_batch_size", config.batch.global_batch_size),
        )
        if value in ("explore", "auto")
    ]
    if undecided:
        largest = Largest(config.cluster.max_nodes, devices)
        how = f"{' and '.join(undecided)}: taken at cluster.max_nodes, the most the config allows"
        return ok("plan", f"largest launch {_nodes(largest)} ({how})", found=largest)
    micro = config.batch.micro_batch_size
    assert isinstance(micro, int)
    biggest = max(launches(build_plan(config, micro_batch_size=micro)), key=lambda launch: launch.num_nodes)
    largest = Largest(biggest.num_nodes, devices)
    return ok(
        "plan", f"largest launch {biggest.name}: {_nodes(largest)} (micro batch {micro})", found=largest
    )


def _nodes(largest: Largest) -> str:
    return f"{largest.num_nodes} node(s) x {largest.devices_per_node} device(s) = {largest.num_devices}"


def skip_cloud(context: Context) -> Check:
    return skip(
        "cloud", "backend local: credentials, Container API, quota, Kubernetes and GPU checks do not apply"
    )


def check_cpus(context: Context) -> Check:
    """A local node is devices_per_node processes, one CPU each (batchpilot.cluster.nodepool)."""
    from batchpilot.cluster.nodepool import available_cpus

    largest = context.found.get("plan")
    if largest is None:
        return skip("cpus", "no plan")
    cpus = available_cpus()
    if largest.num_devices > cpus:
        return fail(
            "cpus",
            f"the largest launch needs {largest.num_devices} local process(es), this machine has {cpus} CPU(s)",
            f"lower cluster.max_nodes or cluster.devices_per_node to fit {cpus} CPU(s), or run on more CPUs",
        )
    return ok("cpus", f"{largest.num_devices} process(es) for the largest launch, {cpus} CPU(s) here")


# --- Google credentials and the Container API ---------------------------------------------------------


@dataclass(frozen=True)
class Google:
    """The credentials doctor uses (None: anonymous, for an emulator)."""

    credentials: Any
    emulator: str | None = None


def _bounded_request() -> Any:
    """A google-auth request whose every call waits at most CALL_TIMEOUT_S (the metadata-server probe asks
    for 3 s and retries; a token refresh asks for 120 s)."""
    import google.auth.transport.requests

    class Bounded(google.auth.transport.requests.Request):
        def __call__(self, url: str, method: str = "GET", body: Any = None, headers: Any = None,
                     timeout: float | None = None, **kwargs: Any) -> Any:  # fmt: skip
            return super().__call__(
                url, method, body, headers, timeout=min(timeout or 1e9, CALL_TIMEOUT_S), **kwargs
            )

    return Bounded()


def check_credentials(context: Context) -> Check:
    """Application Default Credentials and whose they are; none with an http:// emulator endpoint."""
    import google.auth
    from google.auth import exceptions

    endpoint = context.config.cluster.container_api_endpoint
    if endpoint and endpoint.startswith("http://"):
        message = (
            f"none needed: cluster.container_api_endpoint {endpoint} is an emulator (anonymous credentials)"
        )
        return ok("credentials", message, found=Google(None, emulator=endpoint))
    request = _bounded_request()
    fix = "run `gcloud auth application-default login`, or run inside the cluster with Workload Identity"
    try:
        credentials, _ = google.auth.default(
            scopes=["https://www.googleapis.com/auth/cloud-platform"], request=request
        )
    except exceptions.DefaultCredentialsError as error:
        return fail(
            "credentials", f"no Application Default Credentials ({one_line(str(error).splitlines()[0])})", fix
        )
    try:
        credentials.refresh(request)
    except exceptions.GoogleAuthError as error:
        return fail(
            "credentials", f"found credentials but could not get a token: {one_line(str(error))}", fix
        )
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
    client = container_client(api_endpoint=cluster.container_api_endpoint)
    pools = {
        p.name: p
        for p in client.list_node_pools(parent=ref.parent, retry=None, timeout=CALL_TIMEOUT_S).node_pools
    }
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
        return skip(
            "quota",
            f"no quota metric known for {cluster.accelerator_type} (known: {', '.join(GPU_QUOTA_METRICS)})",
        )
    pool = context.found.get("node pool")
    if pool is not None and (pool.config.spot or pool.config.preemptible):
        metric = f"PREEMPTIBLE_{metric}"
    region = str(cluster.location).rsplit("-", 1)[0] if is_zone(cluster.location) else str(cluster.location)
    quotas = {
        q.get("metric"): q
        for q in _region(google, project=str(cluster.project), region=region).get("quotas", [])
    }
    if metric not in quotas:
        return skip(
            "quota",
            f"regions.get lists no {metric} quota for {region}: check it in the console's Quotas page",
        )
    limit, usage = float(quotas[metric].get("limit", 0)), float(quotas[metric].get("usage", 0))
    free = limit - usage
    if free < largest.num_devices:
        return fail(
            "quota",
            f"{metric} in {region}: limit {limit:g}, {usage:g} in use, {free:g} free; the largest launch needs "
            f"{largest.num_devices} ({_nodes(largest)})",
            f"request a {metric} quota of at least {usage + largest.num_devices:g} in {region}, free GPUs, or lower "
            "cluster.max_nodes",
        )
    return ok(
        "quota",
        f"{metric} in {region}: {free:g} of {limit:g} free, the largest launch needs {largest.num_devices}",
    )


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


# --- Kubernetes ------------------------------------------------------------------------------------


def _kube_client() -> Any:
    """The launchers' own client (in-cluster, else KUBECONFIG) with one try per call: doctor's calls carry
    their own timeouts."""
    from kubernetes import client

    from batchpilot.cluster.readiness import kube_api_client

    configuration = kube_api_client().configuration
    configuration.retries = False
    return client.ApiClient(configuration)


def check_kubernetes(context: Context) -> Check:
    from kubernetes import client
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    api = _kube_client()
    host = api.configuration.host
    fix = _get_credentials_fix(context.config)
    try:
        version = client.VersionApi(api).get_code(_request_timeout=CALL_TIMEOUT_S)
    except HTTPError as error:
        return fail("kubernetes", f"cannot reach the Kubernetes API at {host}: {one_line(str(error))}", fix)
    except ApiException as error:
        return fail("kubernetes", f"the Kubernetes API at {host} answered {error.status} {error.reason}", fix)
    return ok("kubernetes", f"{host} serves Kubernetes {version.git_version}", found=api)


def _get_credentials_fix(config: Config) -> str:
    cluster = config.cluster
    return (
        f"point KUBECONFIG at the cluster: gcloud container clusters get-credentials {cluster.cluster_name or 'CLUSTER'} "
        f"--location {cluster.location or 'LOCATION'} --project {cluster.project or 'PROJECT'}"
    )


def _kube(context: Context, name: str) -> Any:
    api = context.found.get("kubernetes")
    return api if api is not None else skip(name, "the Kubernetes API was not reached")


@dataclass(frozen=True)
class Access:
    """One permission a run uses: `verb` on `resource` (in cluster.namespace unless `cluster_wide`)."""

    verb: str
    resource: str
    group: str = ""
    subresource: str = ""
    cluster_wide: bool = False
    name: str = ""

    def describe(self, namespace: str) -> str:
        what = f"{self.resource}.{self.group}" if self.group else self.resource
        what += f"/{self.subresource}" if self.subresource else ""
        where = "cluster-wide" if self.cluster_wide else f"in {namespace}"
        return f"{self.verb} {what}{f' {self.name}' if self.name else ''} {where}"


def run_access(launcher: str) -> list[Access]:
    """What batchpilot.cluster calls during a run, call by call (the Volcano launcher's own calls are
    torchx's and not listed)."""
    from batchpilot.cluster.crds import JOBSET_CRD

    jobsets = [
        # jobset.py: schedule (create), describe (get), list, cancel (delete); lifecycle.py and
        # ownership.py list and delete them too.
        *(Access(verb, "jobsets", "jobset.x-k8s.io") for verb in ("create", "get", "list", "delete")),
        # crds.py check_jobset_crd
        Access(
            "get", "customresourcedefinitions", "apiextensions.k8s.io", cluster_wide=True, name=JOBSET_CRD
        ),
    ]
    return [
        *(jobsets if launcher == "jobset" else []),
        Access("list", "pods"),  # jobset.py _find_pod, pending.py PendingWatch
        Access("get", "pods", subresource="log"),  # jobset.py log_iter (and following it)
        Access("list", "events"),  # pending.py: a Pending pod's FailedScheduling reason
        Access("list", "nodes", cluster_wide=True),  # readiness.py PoolNodes
        Access("list", "pods", cluster_wide=True),  # readiness.py: DaemonSet pods on a node, every namespace
        # ownership.py renew_lease, run_alive, delete_lease
        *(Access(verb, "leases", "coordination.k8s.io") for verb in ("get", "create", "update", "delete")),
    ]


def check_rbac(context: Context) -> Check:
    """SelfSubjectAccessReview (authorization.k8s.io/v1) of every permission in `run_access`."""
    from kubernetes import client

    api = _kube(context, "rbac")
    if isinstance(api, Check):
        return api
    cluster = context.config.cluster
    authorization = client.AuthorizationV1Api(api)
    denied = []
    needed = run_access(cluster.launcher)
    for access in needed:
        attributes = client.V1ResourceAttributes(
            namespace=None if access.cluster_wide else cluster.namespace, verb=access.verb, group=access.group,
            resource=access.resource, subresource=access.subresource or None, name=access.name or None,
        )  # fmt: skip
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
        )
        answer = authorization.create_self_subject_access_review(review, _request_timeout=CALL_TIMEOUT_S)
        if not answer.status.allowed:
            denied.append(access.describe(cluster.namespace))
    if denied:
        return fail(
            "rbac",
            f"the caller may not {'; '.join(denied)}",
            f"grant them (the chart's Role in {cluster.namespace} and its ClusterRole do: docs/cluster.md, "
            '"Installing on GKE"); check with `kubectl auth can-i VERB RESOURCE -n NAMESPACE`',
        )
    return ok(
        "rbac",
        f"the caller may do all {len(needed)} things a run does (as this kubeconfig's user; KFP runs use their own account)",
    )


def check_jobset_crd(context: Context) -> Check:
    from batchpilot.cluster import crds

    api = _kube(context, "jobset crd")
    if isinstance(api, Check):
        return api
    if context.config.cluster.launcher != "jobset":
        return skip("jobset crd", f"cluster.launcher is {context.config.cluster.launcher}")
    crds.check_jobset_crd(api)  # raises one line naming the problem and the upgrade
    return ok(
        "jobset crd",
        f"{crds.JOBSET_CRD} serves {crds.JOBSET_VERSION} with failurePolicy.rules ({crds.MIN_JOBSET_RELEASE} or later)",
    )


def check_gpu_driver(context: Context) -> Check:
    """GKE installs the NVIDIA driver when the pool asks it to (DEFAULT, LATEST); otherwise the driver
    DaemonSet must run in kube-system (GKE's GPUDriverInstallationConfig: unset installs no driver,
    INSTALLATION_DISABLED needs a manual installation)."""
    pool = context.found.get("node pool")
    if pool is None:
        return skip("gpu driver", "the node pool was not read")
    accelerators = [
        a for a in pool.config.accelerators if a.accelerator_type == context.config.cluster.accelerator_type
    ]
    if not accelerators:
        return skip("gpu driver", "the pool has no GPUs")
    setting = accelerators[0].gpu_driver_installation_config.gpu_driver_version
    version = getattr(setting, "name", str(setting))
    if version in ("DEFAULT", "LATEST"):
        return ok(
            "gpu driver", f"GKE installs the driver on {pool.name}'s nodes (gpu_driver_version {version})"
        )
    api = _kube(context, "gpu driver")
    if isinstance(api, Check):
        return skip(
            "gpu driver",
            f"gpu_driver_version is {version}: the driver DaemonSet must run, and the Kubernetes API was not reached",
        )
    return _driver_daemonset(api, pool=pool.name, version=version)


def _driver_daemonset(api: Any, *, pool: str, version: str) -> Check:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    namespace, name = DRIVER_DAEMONSET
    try:
        daemonset = client.AppsV1Api(api).read_namespaced_daemon_set(
            name, namespace, _request_timeout=CALL_TIMEOUT_S
        )
    except ApiException as error:
        if error.status == 404:
            return fail(
                "gpu driver",
                f"node pool {pool} has gpu_driver_version {version} (GKE installs no driver) and no DaemonSet "
                f"{namespace}/{name} runs",
                f"kubectl apply -f {DRIVER_MANIFEST} (COS nodes; ubuntu/ for Ubuntu), or recreate the pool with "
                "--accelerator type=...,count=...,gpu-driver-version=default",
            )
        if error.status in (401, 403):
            return skip(
                "gpu driver",
                f"gpu_driver_version is {version} and the caller may not read DaemonSet {namespace}/{name}: check the driver yourself",
            )
        raise
    status = daemonset.status
    ready = f"{status.number_ready or 0} of {status.desired_number_scheduled or 0} pod(s) ready"
    return ok(
        "gpu driver", f"gpu_driver_version {version}: DaemonSet {namespace}/{name} installs it ({ready})"
    )


def check_gpu_nodes(context: Context) -> Check:
    """The pool's nodes, when it has any, advertise devices_per_node allocatable nvidia.com/gpu."""
    from batchpilot.cluster.readiness import GPU_RESOURCE, PoolNodes
    from batchpilot.planning.tpu import is_tpu

    cluster = context.config.cluster
    api = _kube(context, "gpu nodes")
    if isinstance(api, Check):
        return api
    if not cluster.accelerator_type or is_tpu(cluster.accelerator_type):
        return skip("gpu nodes", "no GPU cluster.accelerator_type")
    nodes = PoolNodes(
        api_client=api, node_pool=str(cluster.node_pool), gpus_per_node=cluster.devices_per_node
    )
    states = nodes.states()
    if not states:
        return skip(
            "gpu nodes", f"node pool {cluster.node_pool} has no nodes now (a launch's resize adds them)"
        )
    problems = [p for node in states if (p := node.problem(gpus_per_node=cluster.devices_per_node))]
    if problems:
        return fail(
            "gpu nodes",
            f"{len(problems)} of {len(states)} node(s) of {cluster.node_pool} cannot take a trainer: {'; '.join(problems)}",
            f"a Ready node without its {GPU_RESOURCE} has no driver or device plugin yet: see the gpu driver line and "
            "`kubectl describe node NAME`",
        )
    return ok(
        "gpu nodes",
        f"{len(states)} node(s) of {cluster.node_pool}, each with {cluster.devices_per_node} {GPU_RESOURCE}",
    )


# --- storage ---------------------------------------------------------------------------------------


def _storage(uri: str) -> Any:
    """The project's storage for `uri`; gs:// with a short retry and per-call timeout."""
    from batchpilot.data.storage import open_storage

    if not uri.startswith("gs://"):
        return open_storage(uri)
    from batchpilot.data.gcs import GCSStorage, transient_retry

    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    if not bucket:
        return open_storage(uri)  # its one-line refusal
    retry = transient_retry(max_delay_s=1.0, deadline_s=2 * CALL_TIMEOUT_S)
    return GCSStorage(bucket=bucket, prefix=prefix.strip("/"), retry=retry, timeout_s=CALL_TIMEOUT_S)


def _unreachable_storage(context: Context, name: str, uri: str) -> Check | None:
    """The skip line when `uri` is gs:// and there are no credentials for it (an emulator needs none)."""
    if not uri.startswith("gs://") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    google = context.found.get("credentials")
    if google is None:
        return skip(name, "no credentials")
    if google.credentials is None:
        return skip(
            name,
            "no credentials (the Container API endpoint is an emulator; set STORAGE_EMULATOR_HOST for a GCS one)",
        )
    return None


def check_data(context: Context) -> Check:
    """The shard set's manifest is readable, has the split, at least one sample, and a vocabulary the
    model embeds."""
    from batchpilot.data.sampling import num_samples
    from batchpilot.data.shards import read_manifest

    data, config = context.config.data, context.config
    if skipped := _unreachable_storage(context, "data", data.uri):
        return skipped
    try:
        manifest = read_manifest(_storage(data.uri))
    except BatchpilotError as error:
        return fail(
            "data",
            f"data.uri: {error.field}: {one_line(error.problem)}",
            error.fix or "fix data.uri or its permissions",
        )
    tokens = manifest.num_tokens(data.split)
    samples = num_samples(num_tokens=tokens, seq_len=data.seq_len)
    if not manifest.splits.get(data.split) or samples == 0:
        return fail(
            "data",
            f"{data.uri} has {tokens} {data.split} token(s): less than one sample of data.seq_len + 1 = {data.seq_len + 1}",
            "prepare more data (batchpilot data prepare), or lower data.seq_len",
        )
    from batchpilot.train.shape import model_shape  # torch: only once the data is there

    vocab = model_shape(factory=config.model.factory, args=config.model.args).vocab_size
    if vocab < manifest.vocab_size:
        return fail(
            "data",
            f"the model embeds {vocab} token ids but {data.uri}'s vocabulary has {manifest.vocab_size}",
            f"set model.args.vocab_size to at least {manifest.vocab_size}",
        )
    epochs = config.total_samples / samples
    return ok(
        "data",
        f"{data.uri}: {data.split} split of {tokens:,} tokens = {samples:,} samples of {data.seq_len} "
        f"(training reads it {epochs:.3g} time(s)); vocabulary {manifest.vocab_size} within the model's {vocab}",
    )


def check_checkpoint(context: Context) -> Check:
    """A small object written under train.checkpoint_uri reads back and deletes (the trainer does all
    three: checkpoints, `latest`, and dropping old checkpoints)."""
    uri = context.config.train.checkpoint_uri
    if skipped := _unreachable_storage(context, "checkpoint", uri):
        return skipped
    name = f"batchpilot-doctor-{uuid.uuid4().hex[:12]}"
    payload = f"written by batchpilot doctor ({name})\n".encode()
    fix = "point train.checkpoint_uri at a folder or bucket the run may write, read and delete in"
    try:
        storage = _storage(uri)
        storage.write(name, payload)
        try:
            back = storage.read(name)
        finally:
            storage.delete(name)
    except BatchpilotError as error:
        return fail(
            "checkpoint", f"train.checkpoint_uri: {error.field}: {one_line(error.problem)}", error.fix or fix
        )
    except OSError as error:
        return fail(
            "checkpoint", f"train.checkpoint_uri: cannot write {uri}/{name}: {error.strerror or error}", fix
        )
    if back != payload:
        return fail(
            "checkpoint",
            f"train.checkpoint_uri: {uri}/{name} read back {len(back)} bytes, not the {len(payload)} written",
            fix,
        )
    return ok("checkpoint", f"{uri}: wrote, read back and deleted a {len(payload)}-byte object")


# --- KFP -------------------------------------------------------------------------------------------


def check_kfp(context: Context) -> Check:
    """The KFP API answers its health check, and its backend is recent enough for the pipeline."""
    import kfp_server_api

    from batchpilot.kfp.submit import _talking_to, check_host

    if not context.kfp_host:
        return skip("kfp", "no --host (the KFP API endpoint, as for batchpilot submit)")
    host = check_host(context.kfp_host)
    configuration = kfp_server_api.Configuration(host=host)
    configuration.retries = False
    if context.kfp_token:
        configuration.api_key["authorization"] = context.kfp_token
        configuration.api_key_prefix["authorization"] = "Bearer"
    api = kfp_server_api.HealthzServiceApi(kfp_server_api.ApiClient(configuration))
    with _talking_to(host, "check the API (GET /apis/v2beta1/healthz)"):  # submit's one-line errors
        response = api.healthz_service_get_healthz(_request_timeout=CALL_TIMEOUT_S, _preload_content=False)
    tag = str(json.loads(response.data).get("tag_name") or "unknown")
    numbers = tuple(int(n) for n in re.findall(r"\d+", tag)[:3])
    minimum = ".".join(map(str, MIN_KFP_BACKEND))
    if len(numbers) < 2:
        return ok(
            "kfp",
            f"{host} answers; its backend does not say its version (tag_name {tag!r}): batchpilot needs {minimum} or later",
        )
    if numbers < MIN_KFP_BACKEND:
        return fail(
            "kfp",
            f"{host} runs KFP {tag}, older than {minimum}: the Argo backend would never retry a failed resize or stage",
            f'upgrade the KFP backend to {minimum} or later (docs/cluster.md, "KFP version")',
        )
    return ok("kfp", f"{host} answers; backend {tag} ({minimum} or later)")
