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
    values: dict | None = None, *, name: str = "batchpilot", namespace: str = "batchpilot"
) -> list[dict]:
    chart = helm.Chart.load(CHART)
    rendered = chart.render(values, name=name, namespace=namespace, is_install=True)
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


def validate_k8s(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


UPLOAD = {"kfpUpload": {"enabled": True, "host": "http://ml-pipeline.kubeflow:8888"}}


def test_the_chart_lints_clean_in_strict_mode():
    values = {"config": {**yaml.safe_load((CHART / "values.yaml").read_text())["config"]}}
    values["config"]["cluster"] = {
        **values["config"]["cluster"],
        "service_account": "test-release-batchpilot",
    }
    values["config"]["cluster"]["namespace"] = "batchpilot"
    report = helm.lint(CHART, values, strict=True, namespace="batchpilot", kube_version="v1.30.0")
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


def test_rbac_reads_nodes_cluster_wide_and_runs_jobsets_in_the_namespace_only():
    objects = by_kind(render())
    assert objects["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
    ]
    rules = {
        (r["apiGroups"][0], res): set(r["verbs"]) for r in objects["Role"]["rules"] for res in r["resources"]
    }
    assert rules[("jobset.x-k8s.io", "jobsets")] >= {"create", "get", "delete", "watch"}
    assert rules[("", "pods/log")] == {"get"} and ("", "events") in rules
    assert not any(group == "batch.volcano.sh" for group, _ in rules)
    volcano = by_kind(render({"rbac": {"volcano": True}}))["Role"]["rules"]
    assert any(r["apiGroups"] == ["batch.volcano.sh"] for r in volcano)
    assert objects["RoleBinding"]["subjects"][0]["name"] == objects["ServiceAccount"]["metadata"]["name"]


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
    assert "pipeline create" in container["args"][0]
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


def test_a_config_that_names_another_service_account_or_namespace_fails():
    with pytest.raises(helm.HelmRenderError, match="must name the chart's service account"):
        render(name="prod")  # the service account becomes prod-batchpilot
    with pytest.raises(helm.HelmRenderError, match="must be the release namespace"):
        render(namespace="other")


@pytest.mark.parametrize(
    "values", [{"bogus": 1}, {"image": {"registry": "x"}}, {"kfpUpload": {"host": "ml-pipeline"}}]
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
