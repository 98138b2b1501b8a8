"""The Kubernetes API: reachable, the RBAC a run uses, the JobSet CRD, the GPU driver and the pool's nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchpilot.config import Config
from batchpilot.doctor.core import CALL_TIMEOUT_S, Check, Context, fail, ok, one_line, skip
from batchpilot.errors import BatchpilotError

DRIVER_DAEMONSET = ("kube-system", "nvidia-driver-installer")
"""The DaemonSet GKE's manual driver installation applies (GoogleCloudPlatform/container-engine-
accelerators, nvidia-driver-installer/cos/daemonset-preloaded.yaml: that name, in kube-system)."""

DRIVER_MANIFEST = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/"
    "nvidia-driver-installer/cos/daemonset-preloaded.yaml"
)


def _kube_client() -> Any:
    """The launchers' own client (in-cluster, else KUBECONFIG) with one try per call: doctor's calls carry
    their own timeouts."""
    from kubernetes import client

    from batchpilot.cluster.readiness import kube_api_client

    configuration = kube_api_client().configuration
    configuration.retries = False
    return client.ApiClient(configuration)


def check_kubernetes(context: Context) -> Check:
    """The Kubernetes API answers (its version), through the kubeconfig or the pod's service account."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    fix = _get_credentials_fix(context.config)
    try:
        api = _kube_client()
    except BatchpilotError as error:  # no kubeconfig: the fix with this config's cluster in it
        return fail("kubernetes", one_line(error.problem), fix)
    host = api.configuration.host
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


def kube_api(context: Context, name: str) -> Any:
    """The client the kubernetes check reached the API with, or the skip line for check `name`."""
    api = context.found.get("kubernetes")
    return api if api is not None else skip(name, "the Kubernetes API was not reached")


@dataclass(frozen=True)
class Access:
    """One permission a run uses: `verb` on `resource` (in cluster.namespace unless `cluster_wide`, or
    `task_namespace`: the namespace the KFP task pods run in, where a task reads and protects its own pod)."""

    verb: str
    resource: str
    group: str = ""
    subresource: str = ""
    cluster_wide: bool = False
    name: str = ""
    task_namespace: bool = False

    def describe(self, namespace: str) -> str:
        what = f"{self.resource}.{self.group}" if self.group else self.resource
        what += f"/{self.subresource}" if self.subresource else ""
        where = "cluster-wide" if self.cluster_wide else f"in {namespace}"
        return f"{self.verb} {what}{f' {self.name}' if self.name else ''} {where}"


def run_access(launcher: str, provisioning: str = "resize", *, kueue: bool = False) -> list[Access]:
    """What batchpilot.cluster calls during a run, call by call (the Volcano launcher's own calls are
    torchx's and not listed); with flex-start, the ProvisioningRequests and their PodTemplates too; with
    `kueue` (cluster.kueue_queue), what reads the queue and the launches' Workloads."""
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
    trainjobs = [
        # trainjob.py: the scheduler creates, gets and deletes TrainJobs, lifecycle.py lists them; check_runtime
        # reads the ClusterTrainingRuntime
        *(Access(verb, "trainjobs", "trainer.kubeflow.org") for verb in ("create", "get", "list", "delete")),
        Access("get", "clustertrainingruntimes", "trainer.kubeflow.org", cluster_wide=True),
        # the JobSet Trainer builds: followed (get), its CRD checked
        Access("get", "jobsets", "jobset.x-k8s.io"),
        Access(
            "get", "customresourcedefinitions", "apiextensions.k8s.io", cluster_wide=True, name=JOBSET_CRD
        ),
    ]
    return [
        *(jobsets if launcher == "jobset" else trainjobs if launcher == "trainjob" else []),
        Access("list", "pods"),  # jobset.py _find_pod, pending.py PendingWatch
        Access("get", "pods", subresource="log"),  # jobset.py log_iter (and following it)
        Access("list", "events"),  # pending.py: a Pending pod's FailedScheduling reason
        Access("list", "nodes", cluster_wide=True),  # readiness.py PoolNodes
        # eviction.py reads the task's own pod; disruption.py labels it and puts a budget over it
        *(Access(verb, "pods", task_namespace=True) for verb in ("get", "patch")),
        *(
            Access(verb, "poddisruptionbudgets", "policy", task_namespace=True)
            for verb in ("create", "delete")
        ),
        Access("list", "pods", cluster_wide=True),  # readiness.py: DaemonSet pods on a node, every namespace
        # ownership.py renew_lease, run_alive, delete_lease
        *(Access(verb, "leases", "coordination.k8s.io") for verb in ("get", "create", "update", "delete")),
        # provisioning.py: a launch's request and the PodTemplate it names; lifecycle.py deletes leftovers. With
        # a Kueue queue Kueue writes the requests: the exit handler only looks for leftovers of the run's own.
        *(
            [
                *(
                    Access(verb, "provisioningrequests", "autoscaling.x-k8s.io")
                    for verb in ("create", "get", "list", "delete")
                ),
                *(Access(verb, "podtemplates") for verb in ("create", "delete")),
            ]
            if provisioning == "flex-start" and not kueue
            else [Access("list", "provisioningrequests", "autoscaling.x-k8s.io")]
            if provisioning == "flex-start"
            else []
        ),
        # kueue.py: wait_admitted lists the launch's Workload; queue_problem reads the queue, its
        # ClusterQueue and their flavors
        *(
            [
                Access("list", "workloads", "kueue.x-k8s.io"),
                Access("get", "localqueues", "kueue.x-k8s.io"),
                Access("get", "clusterqueues", "kueue.x-k8s.io", cluster_wide=True),
                Access("get", "resourceflavors", "kueue.x-k8s.io", cluster_wide=True),
            ]
            if kueue
            else []
        ),
        # kueue.py provisioning_check_problem: the ClusterQueue's admission checks and their configs
        *(
            [
                Access("get", "admissionchecks", "kueue.x-k8s.io", cluster_wide=True),
                Access("get", "provisioningrequestconfigs", "kueue.x-k8s.io", cluster_wide=True),
            ]
            if kueue and provisioning == "flex-start"
            else []
        ),
    ]


def check_rbac(context: Context) -> Check:
    """SelfSubjectAccessReview (authorization.k8s.io/v1) of every permission in `run_access`."""
    from kubernetes import client

    api = kube_api(context, "rbac")
    if isinstance(api, Check):
        return api
    cluster = context.config.cluster
    authorization = client.AuthorizationV1Api(api)
    denied = []
    needed = run_access(cluster.launcher, cluster.provisioning, kueue=cluster.kueue_queue is not None)
    for access in needed:
        namespace = context.kfp_namespace if access.task_namespace else cluster.namespace
        attributes = client.V1ResourceAttributes(
            namespace=None if access.cluster_wide else namespace, verb=access.verb, group=access.group,
            resource=access.resource, subresource=access.subresource or None, name=access.name or None,
        )  # fmt: skip
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
        )
        answer = authorization.create_self_subject_access_review(review, _request_timeout=CALL_TIMEOUT_S)
        if not answer.status.allowed:
            denied.append(access.describe(namespace))
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

    api = kube_api(context, "jobset crd")
    if isinstance(api, Check):
        return api
    if context.config.cluster.launcher not in ("jobset", "trainjob"):  # Trainer builds JobSets too
        return skip("jobset crd", f"cluster.launcher is {context.config.cluster.launcher}")
    crds.check_jobset_crd(api)  # raises one line naming the problem and the upgrade
    return ok(
        "jobset crd",
        f"{crds.JOBSET_CRD} serves {crds.JOBSET_VERSION} with failurePolicy.rules ({crds.MIN_JOBSET_RELEASE} or later)",
    )


def check_training_runtime(context: Context) -> Check:
    """With `cluster.launcher: trainjob`: the ClusterTrainingRuntime exists and holds what the config's launches
    need where a TrainJob cannot set it (`cluster/trainjob.py` `check_runtime`)."""
    from batchpilot.cluster.launch import trainjob_runtime
    from batchpilot.cluster.trainjob import check_runtime

    cluster = context.config.cluster
    if cluster.launcher != "trainjob":
        return skip("training runtime", f"cluster.launcher is {cluster.launcher}")
    api = kube_api(context, "training runtime")
    if isinstance(api, Check):
        return api
    expected = trainjob_runtime(cluster)
    name = expected["metadata"]["name"]
    check_runtime(api, name=name, expected=expected, namespace=cluster.namespace)  # raises one line
    return ok("training runtime", f"ClusterTrainingRuntime {name} holds what the launches need")


def check_kueue(context: Context) -> Check:
    """With `cluster.kueue_queue`: the LocalQueue exists, its ClusterQueue too, and one of its flavors can
    ever hold the plan's largest launch; with flex-start the ClusterQueue also has a ProvisioningRequest
    admission check of GKE's class (`cluster/kueue.py` `queue_problem`)."""
    from batchpilot.cluster.kueue import queue_problem

    cluster = context.config.cluster
    if cluster.kueue_queue is None:
        return skip("kueue", "no cluster.kueue_queue")
    api = kube_api(context, "kueue")
    if isinstance(api, Check):
        return api
    largest = context.found.get("plan")
    if largest is None:
        return skip("kueue", "no plan")
    problem = queue_problem(api, cluster, nodes=largest.num_nodes)
    if problem is not None:
        raise problem
    return ok(
        "kueue",
        f"LocalQueue {cluster.kueue_queue} in {cluster.namespace} can hold the largest launch ({largest.num_nodes} node(s))"
        + (
            "; its ClusterQueue asks GKE for flex-start nodes through a ProvisioningRequest admission check"
            if cluster.provisioning == "flex-start"
            else ""
        ),
    )


KUEUE_CONFIGMAP = ("kueue-system", "kueue-manager-config")
"""Kueue's configuration as its release manifests install it (kueue v0.19.2 config/default/kustomization.yaml:
namespace kueue-system, prefix kueue-; config/components/manager: ConfigMap manager-config, key
controller_manager_config.yaml)."""


def check_kueue_explore(context: Context) -> Check:
    """With `cluster.kueue_queue` and an explore task: its pod (a KFP task pod, in KFP's namespace) goes through
    the queue only when Kueue's pod integration is on and that namespace has the LocalQueue too."""
    import yaml
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from batchpilot.cluster.kueue import GROUP, VERSION
    from batchpilot.config import explores

    cluster = context.config.cluster
    if cluster.kueue_queue is None or not explores(context.config):
        return skip("kueue explore", "no explore task, or no cluster.kueue_queue")
    api = kube_api(context, "kueue explore")
    if isinstance(api, Check):
        return api
    namespace, queue = context.kfp_namespace, cluster.kueue_queue
    try:
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, "localqueues", queue, _request_timeout=CALL_TIMEOUT_S
        )
    except ApiException as error:
        if error.status != 404:
            raise
        return fail(
            "kueue explore",
            f"the explore task's pod runs in KFP's namespace {namespace}, which has no LocalQueue {queue}: Kueue "
            "would hold it until the task's timeout",
            f"create LocalQueue {queue} in {namespace} for the same ClusterQueue, or set an integer "
            "batch.micro_batch_size and explore.study: false (no explore task)",
        )
    where, name = KUEUE_CONFIGMAP
    try:
        configmap = client.CoreV1Api(api).read_namespaced_config_map(
            name, where, _request_timeout=CALL_TIMEOUT_S
        )
    except ApiException as error:
        return skip(
            "kueue explore",
            f"LocalQueue {queue} in {namespace} is there, but Kueue's configuration ConfigMap {where}/{name} could "
            f'not be read (HTTP {error.status}): make sure its pod integration ("pod" in integrations.frameworks) '
            "is on, or the explore task's pod runs outside the queue",
        )
    settings = yaml.safe_load((configmap.data or {}).get("controller_manager_config.yaml") or "") or {}
    frameworks = (settings.get("integrations") or {}).get("frameworks") or []
    if "pod" not in frameworks:
        return fail(
            "kueue explore",
            f"Kueue's pod integration is off ({where}/{name} lists {', '.join(frameworks) or 'no framework'}): "
            "the explore task's pod would take its GPU outside the queue",
            'add "pod" to integrations.frameworks of Kueue\'s configuration, or set an integer '
            "batch.micro_batch_size and explore.study: false (no explore task)",
        )
    return ok(
        "kueue explore",
        f"the explore task's pod goes through LocalQueue {queue} in {namespace} (Kueue's pod integration is on)",
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
    api = kube_api(context, "gpu driver")
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
    api = kube_api(context, "gpu nodes")
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
