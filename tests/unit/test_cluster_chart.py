"""The Helm chart through the real Helm engine (helm-python-sdk), its objects through kubernetes-validate,
and manifests/ kept in sync with it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from batchpilot.config import parse_config
from helpers import REPO

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev requirement) renders the chart")
CHART = REPO / "charts" / "batchpilot"
K8S_VERSION = "1.30.0"


def render(
    values: dict | None = None, *, name: str = "batchpilot", namespace: str = "batchpilot", revision: int = 1
) -> list[dict]:
    """The objects the chart creates (NOTES.txt, which helm prints afterwards, left out)."""
    rendered = render_files(values, name=name, namespace=namespace, revision=revision)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("/NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def render_files(
    values: dict | None = None, *, name: str = "batchpilot", namespace: str = "batchpilot", revision: int = 1
) -> dict[str, str]:
    chart = helm.Chart.load(CHART)
    return chart.render(
        values, name=name, namespace=namespace, revision=revision, is_install=revision == 1,
        is_upgrade=revision > 1,
    )  # fmt: skip


def named(objects: list[dict], kind: str, suffix: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return found


def subjects(binding: dict) -> list[tuple[str, str]]:
    return [(s["namespace"], s["name"]) for s in binding["subjects"] if s["kind"] == "ServiceAccount"]


def config_of(objects: list[dict]) -> dict:
    return yaml.safe_load(by_kind(objects)["ConfigMap"]["data"]["config.yaml"])


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


def validate_k8s(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


UPLOAD = {"kfpUpload": {"enabled": True, "host": "http://ml-pipeline.kubeflow:8888"}}
MULTI_USER = {"kfp": {"multiUser": True}}
DIGEST = "sha256:" + "ab" * 32


def test_the_chart_lints_clean_in_strict_mode():
    # Default values under helm lint's own release name: the config follows the release, nothing to set.
    report = helm.lint(CHART, None, strict=True, namespace="batchpilot", kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_rendered_object_is_valid_kubernetes(tmp_path):
    objects = render(
        UPLOAD | {"serviceAccount": {"gcpServiceAccount": "trainer@proj.iam.gserviceaccount.com"}}
    )
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Job",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "ServiceAccount",
    ]
    for obj in objects:
        validate_k8s(obj)


def test_the_service_account_carries_the_workload_identity_annotation():
    account = by_kind(
        render({"serviceAccount": {"gcpServiceAccount": "trainer@proj.iam.gserviceaccount.com"}})
    )
    annotations = account["ServiceAccount"]["metadata"]["annotations"]
    assert annotations == {"iam.gke.io/gcp-service-account": "trainer@proj.iam.gserviceaccount.com"}


def test_rbac_reads_nodes_pods_and_the_jobset_crd_cluster_wide_and_runs_jobsets_in_the_namespace_only():
    objects = by_kind(render())
    assert objects["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
        # the DaemonSet pods on each node (trainer sizing), read-only
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        # the JobSet version check, of that one CRD only
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": ["jobsets.jobset.x-k8s.io"],
            "verbs": ["get"],
        },
        # cluster.kueue_queue: the ClusterQueue behind the LocalQueue and its flavors (with flex-start its
        # admission checks and their ProvisioningRequestConfigs), read-only
        {
            "apiGroups": ["kueue.x-k8s.io"],
            "resources": [
                "clusterqueues",
                "resourceflavors",
                "admissionchecks",
                "provisioningrequestconfigs",
            ],
            "verbs": ["get", "list"],
        },
        # cluster.launcher trainjob: the ClusterTrainingRuntime a launch checks, read-only
        {
            "apiGroups": ["trainer.kubeflow.org"],
            "resources": ["clustertrainingruntimes"],
            "verbs": ["get", "list"],
        },
    ]
    rules = {
        (r["apiGroups"][0], res): set(r["verbs"])
        for r in named(render(), "Role", "-launcher")["rules"]
        for res in r["resources"]
    }
    assert rules[("jobset.x-k8s.io", "jobsets")] >= {"create", "get", "delete", "watch"}
    assert rules[("trainer.kubeflow.org", "trainjobs")] == {"create", "get", "list", "watch", "delete"}
    assert rules[("", "pods/log")] == {"get"} and ("", "events") in rules
    assert not any(group == "batch.volcano.sh" for group, _ in rules)
    volcano = named(render({"rbac": {"volcano": True}}), "Role", "-launcher")["rules"]
    assert any(r["apiGroups"] == ["batch.volcano.sh"] for r in volcano)
    binding = named(render(), "RoleBinding", "-launcher")
    assert binding["subjects"][0]["name"] == objects["ServiceAccount"]["metadata"]["name"]
    # The task's own pod, in the namespace KFP runs it in: read, labelled and covered by a budget, nothing more.
    task_pod = named(render(), "Role", "-task-pod")
    assert task_pod["metadata"]["namespace"] == "kubeflow"
    assert task_pod["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["create", "delete"]},
    ]
    assert named(render(), "RoleBinding", "-task-pod")["metadata"]["namespace"] == "kubeflow"


def test_the_config_map_holds_a_valid_batchpilot_config():
    config_map = by_kind(render())["ConfigMap"]
    config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.cluster.backend == "gke" and config.cluster.service_account == "batchpilot"


def test_the_upload_job_is_a_hardened_post_install_hook_that_rolls_with_the_config():
    job = by_kind(render(UPLOAD))["Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    pod = job["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/batchpilot:0.1.0"  # the tag defaults to appVersion
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["command"] == ["batchpilot"]  # no shell: values reach the command as arguments
    assert container["args"][:2] == ["submit", "--upload-only"]
    changed = UPLOAD | {
        "config": {**yaml.safe_load((CHART / "values.yaml").read_text())["config"], "name": "other"}
    }
    rolled = by_kind(render(changed))["Job"]["spec"]["template"]["metadata"]["annotations"]
    assert rolled["checksum/config"] != pod["metadata"]["annotations"]["checksum/config"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kfpUpload": {"enabled": True}}, "kfpUpload.host is required"),
        ({"rbac": {"create": False, "volcano": True}}, "rbac.volcano needs rbac.create"),
        ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
    ],
)
def test_contradictory_values_fail_the_render(values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


def test_any_release_name_and_namespace_install_with_a_config_that_follows_them():
    objects = render(UPLOAD, name="prod", namespace="ml-team")
    for obj in objects:
        validate_k8s(obj)
    config = parse_config(config_of(objects))
    assert config.cluster.namespace == "ml-team"
    assert (
        config.cluster.service_account
        == "prod-batchpilot"
        == by_kind(objects)["ServiceAccount"]["metadata"]["name"]
    )
    assert config.cluster.image == "registry.example/batchpilot:0.1.0"  # the trainers run the chart's image
    bring_your_own = render({"serviceAccount": {"create": False, "name": "trainer"}}, namespace="ml-team")
    assert config_of(bring_your_own)["cluster"]["service_account"] == "trainer"


def with_cluster(**fields: str) -> dict:
    config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    return {"config": {**config, "cluster": {**config["cluster"], **fields}}}


def test_a_config_that_names_another_service_account_or_namespace_fails():
    with pytest.raises(helm.HelmRenderError, match=r"config.cluster.service_account \(someone\) must be"):
        render(with_cluster(service_account="someone"))
    with pytest.raises(helm.HelmRenderError, match="must be the release namespace"):
        render(with_cluster(namespace="other"))
    # Named explicitly and consistent: fine. The KFP run account counts when KFP runs in this namespace.
    assert config_of(render(with_cluster(service_account="prod-batchpilot"), name="prod"))
    multi_user = with_cluster(service_account="default-editor") | MULTI_USER
    assert config_of(render(multi_user, namespace="team-a"))["cluster"]["service_account"] == "default-editor"
    with pytest.raises(helm.HelmRenderError, match="must be the chart's service account"):
        render(with_cluster(service_account="pipeline-runner"))  # single-user: it lives in kubeflow


@pytest.mark.parametrize(
    ("values", "run_account"),
    [
        ({}, ("kubeflow", "pipeline-runner")),  # single-user KFP: DefaultPipelineRunnerServiceAccount
        (MULTI_USER, ("team-a", "default-editor")),  # multi-user: the profile namespace's default-editor
        ({"kfp": {"namespace": "kfp", "runServiceAccount": "runner"}}, ("kfp", "runner")),
    ],
)
def test_rbac_is_bound_to_the_kfp_run_account_as_well_as_the_chart_account(values, run_account):
    objects = render(values, name="prod", namespace="team-a")
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = named(objects, kind, "-nodes" if kind == "ClusterRoleBinding" else "-launcher")
        assert subjects(binding) == [("team-a", "prod-batchpilot"), run_account]
    assert named(objects, "RoleBinding", "-launcher")["metadata"]["namespace"] == "team-a"


def test_upload_job_compiles_with_the_chart_image_and_uploads_a_version_per_revision():
    (container,) = by_kind(render(UPLOAD, revision=3))["Job"]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "submit",
        "--upload-only",
        "--config=/etc/batchpilot/config.yaml",
        "--host=http://ml-pipeline.kubeflow:8888",
        "--pipeline-name=batchpilot",
        "--pipeline-version=0.1.0-r3",  # appVersion + release revision: each upgrade a new version
        "--image=registry.example/batchpilot:0.1.0",
    ]
    pinned = UPLOAD | {"image": {"repository": "us-docker.pkg.dev/p/r/batchpilot", "digest": DIGEST}}
    objects = render(pinned)
    (container,) = by_kind(objects)["Job"]["spec"]["template"]["spec"]["containers"]
    reference = f"us-docker.pkg.dev/p/r/batchpilot@{DIGEST}"
    assert container["image"] == reference and f"--image={reference}" in container["args"]
    assert config_of(objects)["cluster"]["image"] == reference


def test_multi_user_upload_sends_a_projected_token_for_the_kfp_api():
    objects = render(UPLOAD | MULTI_USER, name="prod", namespace="team-a")
    for obj in objects:
        validate_k8s(obj)
    pod = by_kind(objects)["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--namespace=team-a" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    token_path = Path(env["KF_PIPELINES_SA_TOKEN_PATH"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(token_path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "pipelines.kubeflow.org"
    assert source["serviceAccountToken"]["path"] == token_path.name
    # The upload Job's account may edit pipelines in the profile namespace (KFP's own ClusterRole).
    grant = named(objects, "RoleBinding", "-kfp-upload")
    assert grant["roleRef"]["name"] == "kubeflow-pipelines-edit"
    assert grant["metadata"]["namespace"] == "team-a"
    assert subjects(grant) == [("team-a", "prod-batchpilot")]

    (single_user,) = by_kind(render(UPLOAD))["Job"]["spec"]["template"]["spec"]["containers"]
    assert "KF_PIPELINES_SA_TOKEN_PATH" not in {e["name"] for e in single_user["env"]}
    assert not any(a.startswith("--namespace") for a in single_user["args"])


def test_notes_say_how_to_bind_workload_identity_and_check_rbac_for_the_kfp_run_account():
    values = {"serviceAccount": {"gcpServiceAccount": "trainer@proj.iam.gserviceaccount.com"}}
    notes = render_files(values | MULTI_USER, name="prod", namespace="team-a")[
        "batchpilot/templates/NOTES.txt"
    ]
    assert "--role=roles/iam.workloadIdentityUser" in notes
    assert '--member="serviceAccount:PROJECT_ID.svc.id.goog[team-a/default-editor]"' in notes
    assert '--member="serviceAccount:PROJECT_ID.svc.id.goog[team-a/prod-batchpilot]"' in notes
    assert "kubectl annotate serviceaccount default-editor --namespace team-a" in notes
    assert "iam.gke.io/gcp-service-account=trainer@proj.iam.gserviceaccount.com" in notes
    assert "--as=system:serviceaccount:team-a:default-editor" in notes
    assert "--service-account default-editor --namespace team-a" in notes


@pytest.mark.parametrize(
    "values",
    [
        {"bogus": 1},
        {"image": {"registry": "x"}},
        {"image": {"digest": "latest"}},
        {"kfpUpload": {"host": "ml-pipeline"}},
        {"kfpUpload": {"compileCommand": "sh -c 'anything'"}},  # gone: the Job's command is fixed
        {"kfpUpload": {"tokenExpirationSeconds": 60}},  # Kubernetes' minimum is 600
        {"kfp": {"multiuser": True}},
        {"kfp": {"runServiceAccount": "Not_A_Name"}},
    ],
)
def test_the_values_schema_rejects_unknown_keys_and_bad_values(values):
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(values))
    chart.validate_schema(chart.merge_values({}))


def test_every_value_is_documented_with_a_double_dash_comment():
    """A documented key is one value (its children are its data); an undocumented map is a section."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, value_indent = [], None
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_]\w*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        if value_indent is not None and indent > value_indent:
            continue  # inside a documented value such as `config:` or `resources:`
        value_indent = None
        documented = number > 0 and lines[number - 1].strip().startswith("# --")
        is_section = line.rstrip().endswith(":")
        if documented:
            value_indent = indent
        elif not is_section:
            undocumented.append(match.group(2))
    assert undocumented == []


def test_manifests_are_the_chart_rendered_with_default_values():
    spec = importlib.util.spec_from_file_location(
        "render_manifests", REPO / "scripts" / "render_manifests.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.render_manifests()
    assert Path(module.OUTPUT).read_text() == text, (
        "manifests/ drifted: run python scripts/render_manifests.py"
    )
    for obj in yaml.safe_load_all(text):
        validate_k8s(obj)


REAPER = {"orphanReaper": {"enabled": True, "schedule": "*/10 * * * *"}}


def test_the_orphan_reaper_is_an_optional_hardened_cronjob_scaling_down_orphaned_pools():
    assert not [o for o in render() if o["kind"] == "CronJob"]  # off by default
    objects = render(REAPER)
    cron = named(objects, "CronJob", "-orphan-reaper")
    validate_k8s(cron)
    assert cron["spec"]["schedule"] == "*/10 * * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["batchpilot"]
    assert container["args"] == ["pool", "scale-down", "--orphaned", "--config=/etc/batchpilot/config.yaml"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == by_kind(objects)["ServiceAccount"]["metadata"]["name"]
    # What the reaper (and the pipeline's tasks) call: Leases and JobSets in the namespace, bound to both.
    rules = {
        (r["apiGroups"][0], res): set(r["verbs"])
        for r in named(objects, "Role", "-launcher")["rules"]
        for res in r["resources"]
    }
    assert rules[("coordination.k8s.io", "leases")] == {"create", "get", "list", "update", "delete"}
    assert rules[("jobset.x-k8s.io", "jobsets")] >= {"list", "get"}
    with pytest.raises(Exception, match="orphanReaper"):
        render({"orphanReaper": {"enabled": True, "every": 5}})  # values.schema.json: no unknown keys


@pytest.mark.parametrize(
    ("launcher", "provisioning", "kueue"),
    [
        ("jobset", "resize", False), ("jobset", "flex-start", False), ("jobset", "resize", True),
        ("jobset", "flex-start", True), ("trainjob", "resize", False), ("trainjob", "resize", True),
    ],
)  # fmt: skip
def test_the_chart_grants_every_permission_a_run_calls(launcher, provisioning, kueue):
    """The chart's Role (namespace) and ClusterRole grant each call `batchpilot doctor` checks, which lists
    what cluster/ calls, call site by call site (doctor/kube.py run_access)."""
    from batchpilot.doctor.kube import run_access

    objects = render()

    def granted(which: str) -> set[tuple[str, str, str]]:
        """The grants of the ClusterRole, or of the Role whose name ends with `which`."""
        found = by_kind(objects)[which] if which == "ClusterRole" else named(objects, "Role", which)
        return {
            (group, resource, verb)
            for rule in found["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }

    role, cluster_role, task_pod = granted("-launcher"), granted("ClusterRole"), granted("-task-pod")
    for access in run_access(launcher, provisioning, kueue=kueue):
        resource = f"{access.resource}/{access.subresource}" if access.subresource else access.resource
        where = cluster_role if access.cluster_wide else task_pod if access.task_namespace else role
        assert (access.group, resource, access.verb) in where, access


def test_the_optional_training_runtime_is_the_one_a_trainjob_launch_of_the_charts_config_needs():
    """`trainingRuntime.create` installs a ClusterTrainingRuntime that Trainer's published CRD accepts and that
    batchpilot's launch check finds nothing to object to for the chart's own config (launcher trainjob)."""
    from batchpilot.cluster.jobset import JobSetOpts, app_to_jobset
    from batchpilot.cluster.launch import cluster_appdef
    from batchpilot.cluster.launch_spec import LaunchSpec
    from batchpilot.cluster.trainjob import runtime_object, runtime_problems
    from batchpilot.config import ClusterConfig
    from helpers import validate_crd

    assert "ClusterTrainingRuntime" not in by_kind(render())
    objects = render({"trainingRuntime": {"create": True, "name": "team-runtime"}})
    runtime = by_kind(objects)["ClusterTrainingRuntime"]
    validate_crd(runtime, "trainer.kubeflow.org_clustertrainingruntimes.yaml")
    assert runtime["metadata"]["name"] == "team-runtime"
    cluster = ClusterConfig.model_validate(
        {**config_of(objects)["cluster"], "launcher": "trainjob", "cpu_per_node": 200,
         "memory_per_node_bytes": "1000GiB"}
    )  # fmt: skip
    spec = LaunchSpec(name="demo-stage-0-abcdef12", num_nodes=2, processes_per_node=8, trainer_args=("--stage", "0"),
                      env={})  # fmt: skip
    jobset = app_to_jobset(cluster_appdef(spec, cluster=cluster), JobSetOpts(namespace="batchpilot"))
    assert runtime_problems(runtime, runtime_object(jobset, name="team-runtime")) == []
