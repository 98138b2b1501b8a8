"""Kubeflow Trainer v2 in the simulated cluster: ClusterTrainingRuntimes, TrainJobs, their admission and the
JobSet Trainer's controller builds for each, as Trainer v2.3.0 does it (kubeflow/trainer at tag v2.3.0, commit
658725b; the files named per rule; docs/research/kueue_trainer.md sections 8-11 have more).

Rules:
- storage: objects are validated against Trainer's published CRDs (tests/fixtures/schemas); a field the API
  server would prune (absent from the schema) is refused here, so a field batchpilot sends in vain fails a test;
  the TrainJob's name must be a DNS-1035 label of at most 63 characters (CEL on the TrainJob type,
  pkg/apis/trainer/v1alpha1/trainjob_types.go);
- the runtime webhook (pkg/webhooks/clustertrainingruntime_webhook.go, trainingruntime_webhook.go
  `validateReplicatedJobs`): a replicated job labelled `trainer.kubeflow.org/trainjob-ancestor-step: trainer`
  has `replicas: 1` and a container `node`;
- the TrainJob webhook (pkg/webhooks/trainjob_webhook.go; pkg/runtime/core/clustertrainingruntime.go
  `ValidateObjects`; pkg/runtime/framework/plugins/jobset/jobset.go `Validate`; plugins/torch/torch.go
  `Validate`): the referenced ClusterTrainingRuntime must exist ("specified clusterTrainingRuntime must be created
  before the TrainJob is created"); no `PET_*` variable in `spec.trainer.env` ("must not have reserved envs");
  a runtime patch's manager is a domain-prefixed path (`IsDomainPrefixedPath`), its replicated jobs and
  containers exist in the runtime, and it sets no env on container `node`; runtime patches change only while
  the TrainJob is suspended before or after the update (`checkRuntimePatchesImmutability`);
- the JobSet (pkg/runtime/core/trainingruntime.go `newRuntimeInfo`, `mergeRuntimePatches`; plugins/jobset/
  jobset.go `Build`, builder.go; plugins/torch/torch.go): named and namespaced as the TrainJob, owned by it;
  labels and annotations from the runtime's template and each patch's; the patches merged into the runtime's
  JobSet spec in order (maps merged, lists keyed by name merged, tolerations replaced); the trainer job (the one
  labelled ancestor trainer) gets `replicas: 1`, `parallelism = completions = numNodes` (the TrainJob's, else the
  runtime's mlPolicy), its `node` container the TrainJob's image, command and args, its env upserted, its
  resources merged with `resourcesPerNode`, the torch variables PET_NNODES, PET_NPROC_PER_NODE (numProcPerNode,
  else `auto` with a GPU, else the CPU request), PET_NODE_RANK (from the completion index), PET_MASTER_ADDR
  `<name>-node-0-0.<subdomain>`, PET_MASTER_PORT 29500, and port 29500; `spec.suspend` is the TrainJob's; a
  JobSet that exists and runs, with the TrainJob running too, is not rebuilt (`Build`);
- status (pkg/controller/trainjob_controller.go, plugins/jobset/jobset.go `Status`): Suspended True/False
  (reason Suspended/Resumed), Complete and Failed copied from the JobSet's Completed and Failed conditions,
  `jobsStatus` from the JobSet's replicatedJobsStatus; deleting a TrainJob deletes its JobSet (owner reference;
  Foreground keeps the TrainJob until the JobSet is gone).
Not modelled: namespaced TrainingRuntimes, initializers, MPI/JAX/Flux policies, podGroupPolicy, the runtime
snapshot ConfigMap, activeDeadlineSeconds. Kueue's TrainJob integration is kueue_controller.py's.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any

import jobset_webhook
from workload_controllers import now

from helpers import crd_schema, validate_crd

if TYPE_CHECKING:
    from cluster_sim import ClusterSim

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
MASTER_PORT = 29500
_PATH = re.compile(
    rf"^/apis/{re.escape(GROUP)}/{VERSION}(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?$"
)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
CRDS = {"trainjobs": "trainer.kubeflow.org_trainjobs.yaml",
        "clustertrainingruntimes": "trainer.kubeflow.org_clustertrainingruntimes.yaml"}  # fmt: skip


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def pruned_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of `obj`'s fields that a structural schema does not declare (the API server drops them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key in schema["properties"]:
                found += pruned_fields(value, schema["properties"][key], f"{path}.{key}")
            elif path != "" or key not in ("apiVersion", "kind", "metadata", "status"):
                found.append(f"{path}.{key}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            found += pruned_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for index, value in enumerate(obj):
            found += pruned_fields(value, schema["items"], f"{path}[{index}]")
    return found


def check_schema(plural: str, obj: dict[str, Any]) -> str | None:
    """Why the API server would refuse (or prune part of) `obj`, else None."""
    import jsonschema

    try:
        validate_crd(obj, CRDS[plural])
    except jsonschema.ValidationError as error:
        return f"{'.'.join(str(p) for p in error.absolute_path)}: {error.message}"
    pruned = pruned_fields(obj, crd_schema(CRDS[plural]))
    return f"unknown field(s) the API server would prune: {', '.join(pruned)}" if pruned else None


def _node_job(runtime_spec: dict[str, Any]) -> dict[str, Any] | None:
    for replicated in runtime_spec["template"]["spec"]["replicatedJobs"]:
        labels = (replicated["template"].get("metadata") or {}).get("labels") or {}
        if labels.get(ANCESTOR_LABEL) == "trainer":
            return replicated  # type: ignore[no-any-return]
    return None


def _containers_of(replicated: dict[str, Any]) -> set[str]:
    pod = replicated["template"]["spec"]["template"]["spec"]
    return {c["name"] for c in [*pod.get("containers", []), *pod.get("initContainers", [])]}


def _is_domain_prefixed_path(value: str) -> bool:
    """k8s.io/apimachinery validation.IsDomainPrefixedPath: `<DNS-1123 subdomain>/<non-empty path>`."""
    host, _, rest = value.partition("/")
    return bool(rest) and bool(_SUBDOMAIN.match(host)) and len(host) <= 253


def _merge_named(target: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A strategic-merge of lists keyed by `name`: matching items merged, others appended."""
    merged = [copy.deepcopy(item) for item in target]
    for item in patch:
        found = next((m for m in merged if m.get("name") == item.get("name")), None)
        if found is None:
            merged.append(copy.deepcopy(item))
        else:
            _merge_object(found, item)
    return merged


def _merge_object(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if key == "tolerations":  # no merge key: replaced (PodSpec `tolerations` has none)
            target[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_object(target[key], value)
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            target[key] = _merge_named(target.get(key) or [], value)
        else:
            target[key] = copy.deepcopy(value)


def build_jobset(runtime: dict[str, Any], trainjob: dict[str, Any]) -> dict[str, Any]:
    """The JobSet Trainer's controller builds for `trainjob` on `runtime` (module docstring, "the JobSet")."""
    template = copy.deepcopy(runtime["spec"]["template"])
    spec = template["spec"]
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    annotations = dict((template.get("metadata") or {}).get("annotations") or {})
    for patch in trainjob["spec"].get("runtimePatches") or []:
        patched = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        labels.update((patched.get("metadata") or {}).get("labels") or {})
        annotations.update((patched.get("metadata") or {}).get("annotations") or {})
        for job_patch in (patched.get("spec") or {}).get("replicatedJobs") or []:
            replicated = next(r for r in spec["replicatedJobs"] if r["name"] == job_patch["name"])
            _merge_object(replicated, {"template": job_patch.get("template") or {}})
    trainer = trainjob["spec"].get("trainer") or {}
    name, namespace = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    node_job = _node_job(runtime["spec"])
    count = trainer.get("numNodes", runtime["spec"].get("mlPolicy", {}).get("numNodes", 1))
    for replicated in spec["replicatedJobs"]:
        if node_job is None or replicated["name"] != node_job["name"]:
            continue
        replicated["replicas"] = 1
        replicated["template"]["spec"]["parallelism"] = replicated["template"]["spec"]["completions"] = count
        for container in replicated["template"]["spec"]["template"]["spec"]["containers"]:
            if container["name"] != NODE:
                continue
            for key in ("image", "command", "args"):
                if key in trainer:
                    container[key] = copy.deepcopy(trainer[key])
            resources = container.setdefault("resources", {})
            for kind, amounts in (trainer.get("resourcesPerNode") or {}).items():
                resources[kind] = {**(resources.get(kind) or {}), **amounts}
            gpu = any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("requests", "limits"))
            cpu = (resources.get("requests") or resources.get("limits") or {}).get("cpu", "1")
            per_node = trainer.get("numProcPerNode") or ("auto" if gpu else max(1, int(_cpus(cpu))))
            torch_env = [
                {"name": "PET_NNODES", "value": str(count)},
                {"name": "PET_NPROC_PER_NODE", "value": str(per_node)},
                {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{subdomain}"},
                {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
            ]  # fmt: skip
            container["env"] = _merge_named(
                container.get("env") or [], [*(trainer.get("env") or []), *torch_env]
            )
            if not any(p.get("containerPort") == MASTER_PORT for p in container.get("ports") or []):
                container.setdefault("ports", []).append({"containerPort": MASTER_PORT})
    spec["suspend"] = bool(trainjob["spec"].get("suspend"))
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name, "namespace": namespace, "labels": labels, "annotations": annotations,
            "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "name": name,
                                 "uid": trainjob["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": spec,
    }  # fmt: skip


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if str(quantity).endswith("m") else float(quantity)


class TrainerController:
    """Trainer's objects and its TrainJob controller, driven by the simulated cluster's reconcile."""

    def __init__(self) -> None:
        self.runtimes: dict[str, dict[str, Any]] = {}
        self.trainjobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.built: list[str] = []  # TrainJob names in the order their JobSets were built (for tests)

    # -- what an administrator (or the chart) creates ------------------------------------------------
    def add_runtime(self, runtime: dict[str, Any]) -> None:
        """Creates a ClusterTrainingRuntime as `kubectl apply` would: schema, then the runtime webhook."""
        if problem := check_schema("clustertrainingruntimes", runtime):
            raise ValueError(f"ClusterTrainingRuntime refused: {problem}")
        node_job = _node_job(runtime["spec"])
        if node_job is not None and (
            node_job.get("replicas", 1) != 1 or NODE not in _containers_of(node_job)
        ):
            raise ValueError(
                "ClusterTrainingRuntime refused: the trainer job needs replicas 1 and container node"
            )
        self.runtimes[runtime["metadata"]["name"]] = copy.deepcopy(runtime)

    # -- the API -----------------------------------------------------------------------------------------
    @staticmethod
    def serves(path: str) -> bool:
        return bool(_PATH.match(path))

    def route(
        self, sim: ClusterSim, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        from k8s_rules import selector_matches

        match = _PATH.match(path)
        assert match is not None
        plural, ns, name = match["plural"], match["ns"], match["name"]
        if plural == "clustertrainingruntimes" and ns is None and method == "GET":
            if name is None:
                return 200, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterTrainingRuntimeList",
                             "metadata": {}, "items": list(self.runtimes.values())}  # fmt: skip
            if name not in self.runtimes:
                return 404, _status(404, "NotFound", f'{plural}.{GROUP} "{name}" not found')
            return 200, self.runtimes[name]
        if plural != "trainjobs" or ns is None:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        if method == "GET" and name is None:
            selector = query.get("labelSelector", [""])[0]
            items = [t for (n, _), t in sorted(self.trainjobs.items())
                     if n == ns and selector_matches(t["metadata"].get("labels") or {}, selector)]  # fmt: skip
            return 200, {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "TrainJobList",
                "metadata": {},
                "items": items,
            }
        if method == "POST" and name is None:
            return self._create(sim, ns, body)
        if name is None or (ns, name) not in self.trainjobs:
            return 404, _status(404, "NotFound", f'{plural}.{GROUP} "{name}" not found')
        trainjob = self.trainjobs[(ns, name)]
        if method == "GET":
            return 200, trainjob
        if method == "DELETE":
            policy = query.get("propagationPolicy", [None])[0] or (body or {}).get("propagationPolicy")
            if policy == "Foreground":
                trainjob["metadata"]["deletionTimestamp"] = now()
            else:
                del self.trainjobs[(ns, name)]
            sim.delete_jobset(ns, name, propagation=policy or "Background")
            return 200, trainjob
        return 405, _status(405, "MethodNotAllowed", f"{method} on trainjobs is not simulated")

    def _create(self, sim: ClusterSim, ns: str, body: dict[str, Any]) -> tuple[int, Any]:
        body = copy.deepcopy(body)
        name = body.get("metadata", {}).get("name", "")
        if sim.kueue is not None and (denied := sim.kueue.admit_trainjob(body)):  # Kueue's mutating webhook
            return 422, denied
        if problem := check_schema("trainjobs", body):
            return 422, _status(
                422, "Invalid", f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {problem}'
            )
        if len(name) > 63 or not _DNS1035.match(name):
            return 422, _status(422, "Invalid", f'TrainJob.trainer.kubeflow.org "{name}" is invalid: metadata.name: '
                                "Invalid value: must match RFC 1035 label and be at most 63 characters")  # fmt: skip
        if denied := self._validate(body):
            return 422, _status(422, "Invalid", 'admission webhook "validator.trainjob.trainer.kubeflow.org" '
                                f"denied the request: {denied}")  # fmt: skip
        if (ns, name) in self.trainjobs:
            return 409, _status(409, "AlreadyExists", f'trainjobs.{GROUP} "{name}" already exists')
        body["metadata"].update(namespace=ns, uid=f"uid-{next(sim.uids)}", creationTimestamp=now())
        body["spec"].setdefault("suspend", False)
        body["status"] = {}
        self.trainjobs[(ns, name)] = body
        return 201, body

    def _validate(self, trainjob: dict[str, Any]) -> str | None:
        spec = trainjob["spec"]
        runtime = self.runtimes.get(spec["runtimeRef"]["name"])
        if spec["runtimeRef"].get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime":
            return f"spec.runtimeRef: unsupported runtime: {spec['runtimeRef'].get('kind')}.{GROUP}"
        if runtime is None:
            return "spec.RuntimeRef: Invalid value: specified clusterTrainingRuntime must be created before the " \
                   "TrainJob is created"  # fmt: skip
        reserved = [
            e["name"] for e in (spec.get("trainer") or {}).get("env") or [] if e["name"].startswith("PET_")
        ]
        if reserved:
            return f"spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: {reserved}"
        jobs = {r["name"]: _containers_of(r) for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
        for patch in spec.get("runtimePatches") or []:
            if not _is_domain_prefixed_path(patch["manager"]):
                return f"spec.runtimePatches[].manager: Invalid value: {patch['manager']!r}: must be a domain-prefixed path"
            template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
            for job_patch in (template.get("spec") or {}).get("replicatedJobs") or []:
                if job_patch["name"] not in jobs:
                    return "spec.runtimePatches: must not have replicated job that doesn't exist in the runtime job template"
                pod = ((job_patch.get("template") or {}).get("spec") or {}).get("template", {}).get(
                    "spec"
                ) or {}
                for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
                    if container["name"] not in jobs[job_patch["name"]]:
                        return f"spec.runtimePatches: must not have container that doesn't exist in the runtime job {job_patch['name']}"
                    if container.get("env") and container["name"] == NODE:
                        return "spec.runtimePatches: must not have envs for the dataset-initializer, model-initializer, node containers"
        return None  # fmt: skip

    # -- the controller ----------------------------------------------------------------------------------
    def reconcile(self, sim: ClusterSim) -> None:
        for key, trainjob in list(self.trainjobs.items()):
            jobset = sim.jobsets.get(key)
            if trainjob["metadata"].get("deletionTimestamp"):
                if jobset is None:
                    del self.trainjobs[key]  # foreground: its JobSet is gone
                continue
            suspended = bool(trainjob["spec"].get("suspend"))
            if jobset is None or (
                jobset["spec"].get("suspend") and not suspended and not jobset["status"].get("terminalState")
            ):
                self._build(sim, key, trainjob, replacing=jobset)
            elif suspended and not jobset["spec"].get("suspend"):
                jobset["spec"]["suspend"] = True
            self._sync_status(trainjob, sim.jobsets.get(key))  # fmt: skip

    def _build(
        self,
        sim: ClusterSim,
        key: tuple[str, str],
        trainjob: dict[str, Any],
        *,
        replacing: dict[str, Any] | None,
    ) -> None:
        built = build_jobset(self.runtimes[trainjob["spec"]["runtimeRef"]["name"]], trainjob)
        if (
            replacing is not None
        ):  # server-side apply of the rebuilt spec onto the existing (suspended) JobSet
            replacing["spec"] = built["spec"]
            replacing["metadata"]["labels"] = built["metadata"]["labels"]
            return
        if denied := jobset_webhook.admit_create(built):
            sim.event(trainjob, kind="TrainJob", type_="Warning", reason="TrainJobResourcesCreationFailed",
                      message=denied["message"])  # fmt: skip
            return
        sim.create_jobset(key[0], built)
        self.built.append(key[1])

    @staticmethod
    def _sync_status(trainjob: dict[str, Any], jobset: dict[str, Any] | None) -> None:
        status = trainjob["status"]
        conditions = status.setdefault("conditions", [])

        def put(kind: str, value: str, reason: str, message: str) -> None:
            found = next((c for c in conditions if c["type"] == kind), None)
            if found is None:
                conditions.append(found := {"type": kind})
            if (found.get("status"), found.get("reason")) != (value, reason):
                found.update(status=value, reason=reason, message=message, lastTransitionTime=now())

        if trainjob["spec"].get("suspend"):
            put("Suspended", "True", "Suspended", "TrainJob is suspended")
        elif any(c["type"] == "Suspended" for c in conditions):
            put("Suspended", "False", "Resumed", "TrainJob is resumed")
        if jobset is None:
            return
        status["jobsStatus"] = [
            {k: job.get(k, 0) for k in ("name", "ready", "succeeded", "failed", "active", "suspended")}
            for job in jobset["status"].get("replicatedJobsStatus") or []
        ]
        for condition in jobset["status"].get("conditions") or []:
            if condition["type"] in ("Completed", "Failed") and condition["status"] == "True":
                kind = "Complete" if condition["type"] == "Completed" else "Failed"
                put(kind, "True", condition.get("reason", ""), condition.get("message", ""))
