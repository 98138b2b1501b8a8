"""`batchpilot submit` as a user runs it: the real CLI and the real kfp.Client against a KFP API stand-in.

The stand-in (kfp_api_server.py) enforces the real API server's rules; the last tests call it with raw
HTTP to show those rules bite.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp_api_server import KfpServer, kfp_server_running

from batchpilot.cli import main
from batchpilot.config import load_config
from batchpilot.kfp.compile import compile_pipeline
from batchpilot.kfp.submit import split_pipeline_yaml
from helpers import REPO, run_batchpilot


def _gke_demo() -> str:
    """The demo config on a GKE pool of a3-highgpu-8g nodes, data and checkpoints in GCS: what `submit`
    sends to a cluster's KFP (a local backend is refused: its pool, data and checkpoints are this machine's)."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="gpu",
        image="us-docker.pkg.dev/proj/repo/batchpilot:0.1.0", machine_type="a3-highgpu-8g", accelerator_type="nvidia-h100-80gb",
        devices_per_node=8,
    )  # fmt: skip
    config["data"]["uri"] = "gs://bucket/data"
    config["train"]["checkpoint_uri"] = "gs://bucket/ckpt"
    path = Path(tempfile.mkdtemp(prefix="submit-")) / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


DEMO = _gke_demo()


def sent_spec(text: str) -> dict[str, Any]:
    """The spec of compiled YAML as the API takes it: the pipeline spec and the GKE config's platform spec
    (its Kubernetes settings) under `pipeline_spec` and `platform_spec`."""
    spec, platform = split_pipeline_yaml(text)
    assert platform, "a GKE pipeline has a platform spec"
    return {"pipeline_spec": spec, "platform_spec": platform}


LOCAL_DEMO = str(REPO / "configs" / "demo.yaml")
NEMO = str(REPO / "configs" / "nemo_gpt3_5b.yaml")  # a gke config: a dry run of a local one is refused


@pytest.fixture
def kfp_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KfpServer]:
    """A fresh stand-in per test; kfp.Client's context file (~/.config/kfp) kept out of the test."""
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.delenv("KFP_TOKEN", raising=False)
    with kfp_server_running() as server:
        yield server


@pytest.fixture(scope="module")
def demo_yaml() -> str:
    return compile_pipeline(load_config(DEMO))


def submit(server_or_host: KfpServer | str, *args: str) -> int:
    host = server_or_host if isinstance(server_or_host, str) else server_or_host.endpoint
    return main(["submit", "--config", DEMO, "--host", host, *args])


def printed_run(out: str, server: KfpServer) -> dict[str, Any]:
    """The run the last two printed lines name, as the stand-in stored it."""
    id_line, url_line = out.strip().splitlines()[-2:]
    run_id = id_line.removeprefix("run id: ")
    assert url_line == f"run url: {server.endpoint}/#/runs/details/{run_id}"
    return server.state.runs[run_id]


def test_submit_creates_an_experiment_and_a_run_of_the_compiled_spec(
    kfp_server: KfpServer, demo_yaml: str, tmp_path: Path
) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "KFP_TOKEN": "t0ken-from-env"}
    result = run_batchpilot(
        "submit", "--config", DEMO, "--host", kfp_server.endpoint, "--experiment", "ramp-ups",
        "--run-name", "demo-first", "--service-account", "batchpilot-runner",
        "--param", "micro_batch_size=2", "--param", "run_dir=/tmp/r",
        env=env,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 2, result.stdout
    run = printed_run(result.stdout, kfp_server)
    (experiment,) = kfp_server.state.experiments.values()
    assert experiment["display_name"] == "ramp-ups"
    assert run["experiment_id"] == experiment["experiment_id"]
    assert run["display_name"] == "demo-first"
    assert run["service_account"] == "batchpilot-runner"
    assert run["runtime_config"]["parameters"] == {"micro_batch_size": 2, "run_dir": "/tmp/r"}
    assert run["pipeline_spec"] == sent_spec(demo_yaml)
    assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "batchpilot-demo"
    # The body went out in the REST API's field names, with the token as a bearer header.
    (create,) = kfp_server.requests_to("POST", "/runs")
    assert set(create.body) >= {"display_name", "experiment_id", "pipeline_spec", "runtime_config"}
    assert create.headers["authorization"] == "Bearer t0ken-from-env"
    assert "t0ken-from-env" not in result.stdout + result.stderr


def test_second_submit_reuses_the_experiment(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit(kfp_server, "--experiment", "ramp-ups") == 0
    first = printed_run(capsys.readouterr().out, kfp_server)
    assert submit(kfp_server, "--experiment", "ramp-ups", "--run-name", "again") == 0
    second = printed_run(capsys.readouterr().out, kfp_server)

    assert len(kfp_server.state.experiments) == 1
    assert len(kfp_server.requests_to("POST", "/experiments")) == 1
    assert first["experiment_id"] == second["experiment_id"]
    assert first["display_name"].startswith("demo-")  # default: <config name>-<UTC timestamp>
    assert second["display_name"] == "again"


def test_pipeline_version_is_uploaded_and_run(
    kfp_server: KfpServer, demo_yaml: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit(kfp_server, "--pipeline-name", "batchpilot", "--pipeline-version", "v1") == 0
    out = capsys.readouterr().out
    run = printed_run(out, kfp_server)

    assert "pipeline version: v1 of batchpilot uploaded" in out
    (pipeline,) = kfp_server.state.pipelines.values()
    (version,) = kfp_server.state.versions.values()
    assert pipeline["display_name"] == "batchpilot"
    assert (version["name"], version["pipeline_id"]) == ("v1", pipeline["pipeline_id"])
    assert version["pipeline_spec"] == sent_spec(demo_yaml)
    assert "pipeline_spec" not in run
    assert run["pipeline_version_reference"] == {
        "pipeline_id": pipeline["pipeline_id"],
        "pipeline_version_id": version["pipeline_version_id"],
    }

    # A new version goes into the same pipeline.
    assert submit(kfp_server, "--pipeline-name", "batchpilot", "--pipeline-version", "v2") == 0
    assert len(kfp_server.state.pipelines) == 1
    assert sorted(v["name"] for v in kfp_server.state.versions.values()) == ["v1", "v2"]


def test_existing_version_is_reused_if_identical_and_refused_if_not(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit(kfp_server, "--pipeline-name", "batchpilot", "--pipeline-version", "v1") == 0
    capsys.readouterr()
    assert submit(kfp_server, "--pipeline-name", "batchpilot", "--pipeline-version", "v1") == 0
    out = capsys.readouterr().out
    assert "v1 of batchpilot reused (identical spec)" in out
    assert len(kfp_server.requests_to("POST", "/pipelines/upload_version")) == 1
    assert len(kfp_server.state.runs) == 2

    # Another image compiles another spec: same version name refused, nothing run.
    code = submit(
        kfp_server,
        "--pipeline-name",
        "batchpilot",
        "--pipeline-version",
        "v1",
        "--image",
        "us-docker.pkg.dev/proj/repo/other:2",
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert "--pipeline-version: version 'v1' of pipeline 'batchpilot' already exists" in err
    assert len(kfp_server.state.runs) == 2


def test_dry_run_prints_the_request_and_sends_nothing(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    nemo_yaml = compile_pipeline(load_config(NEMO))
    code = main([
        "submit", "--config", NEMO, "--host", kfp_server.endpoint,
        "--experiment", "ramp-ups", "--run-name", "r1", "--service-account", "sa",
        "--namespace", "team-a", "--pipeline-name", "batchpilot", "--pipeline-version", "v3",
        "--param", "total_samples=20000000", "--token", "s3cret-t0ken", "--dry-run",
    ])  # fmt: skip

    out = capsys.readouterr().out
    assert code == 0
    assert kfp_server.state.requests == []
    for expected in (
        f"host: {kfp_server.endpoint}",
        "experiment: ramp-ups",
        "run name: r1",
        "service account: sa",
        "namespace: team-a",
        "version 'v3' of pipeline 'batchpilot'",
        "parameters: total_samples=20000000",
        f"pipeline: batchpilot-gpt3-5b, 8 stage(s), spec {len(nemo_yaml.encode()):,} bytes",
        "auth: bearer token (not shown)",
    ):
        assert expected in out, out
    assert "s3cret-t0ken" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--param", "batch_size=16"],
            "--param: 'batch_size' is not a parameter of the pipeline (fix: use one of: config_yaml,",
        ),
        (["--param", "micro_batch_size=sixteen"], "--param: micro_batch_size='sixteen' is not an integer"),
        (["--param", "total_samples=1.5"], "--param: total_samples='1.5' is not an integer"),
        (["--param", "micro_batch_size"], "--param: 'micro_batch_size' is not KEY=VALUE"),
        (
            ["--param", "total_samples=1", "--param", "total_samples=2"],
            "--param: 'total_samples' is given twice",
        ),
        (["--pipeline-name", "batchpilot"], "--pipeline-name: is given without --pipeline-version"),
        (["--run-name", " "], "--run-name: is empty"),
    ],
)
def test_bad_options_exit_2_with_one_line_and_send_nothing(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert submit(kfp_server, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"batchpilot: error: {message}")
    assert kfp_server.state.requests == []


# --- --upload-only: what the Helm chart's upload Job runs on every install and upgrade -------------------


def upload_only(server: KfpServer, version: str, *args: str) -> int:
    return submit(
        server, "--upload-only", "--pipeline-name", "batchpilot", "--pipeline-version", version, *args
    )


def test_upload_only_adds_a_version_per_upgrade_to_one_pipeline_and_creates_no_run(
    kfp_server: KfpServer, demo_yaml: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # helm install (revision 1), then helm upgrade (revision 2) with a new image: two versions, one pipeline.
    assert upload_only(kfp_server, "0.1.0-r1") == 0
    out = capsys.readouterr().out
    (pipeline,) = kfp_server.state.pipelines.values()
    (first,) = kfp_server.state.versions.values()
    assert out.splitlines() == [
        "pipeline version: 0.1.0-r1 of batchpilot uploaded",
        f"version url: {kfp_server.endpoint}/#/pipelines/details/{pipeline['pipeline_id']}"
        f"/version/{first['pipeline_version_id']}",
    ]
    assert first["pipeline_spec"] == sent_spec(demo_yaml)
    assert upload_only(kfp_server, "0.1.0-r2", "--image", "registry.example/batchpilot:0.1.1") == 0
    assert "0.1.0-r2 of batchpilot uploaded" in capsys.readouterr().out

    assert list(kfp_server.state.pipelines) == [pipeline["pipeline_id"]]
    assert len(kfp_server.requests_to("POST", "/pipelines")) == 1  # created once, found the second time
    versions = sorted(kfp_server.state.versions.values(), key=lambda v: v["name"])
    assert [(v["name"], v["pipeline_id"]) for v in versions] == [
        ("0.1.0-r1", pipeline["pipeline_id"]),
        ("0.1.0-r2", pipeline["pipeline_id"]),
    ]
    stored = versions[1]["pipeline_spec"]
    executors = stored.get("pipeline_spec", stored)["deploymentSpec"]["executors"].values()
    assert {e["container"]["image"] for e in executors} == {"registry.example/batchpilot:0.1.1"}
    assert kfp_server.state.experiments == {} and kfp_server.state.runs == {}

    # A retried upload Job (same revision, same spec) reuses its version.
    assert upload_only(kfp_server, "0.1.0-r1") == 0
    assert "0.1.0-r1 of batchpilot reused (identical spec)" in capsys.readouterr().out
    assert len(kfp_server.requests_to("POST", "/pipelines/upload_version")) == 2


def test_the_chart_upload_job_adds_a_version_per_helm_upgrade(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The Helm chart's upload Job, rendered at install (revision 1) and upgrade (revision 2), run as is
    against the stand-in (only its config path points at the ConfigMap's text written here)."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev requirement) renders the chart")
    chart = helm.Chart.load(REPO / "charts" / "batchpilot")
    values = {"kfpUpload": {"enabled": True, "host": kfp_server.endpoint}}
    for revision in (1, 2):
        rendered = chart.render(
            values, name="batchpilot", namespace="ml", revision=revision, is_upgrade=revision > 1
        )
        objects = {
            doc["kind"]: doc
            for path, text in rendered.items()
            if not path.endswith("/NOTES.txt")
            for doc in yaml.safe_load_all(text)
            if doc
        }
        config = tmp_path / "config.yaml"
        config.write_text(objects["ConfigMap"]["data"]["config.yaml"])
        (container,) = objects["Job"]["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["batchpilot"]
        args = [f"--config={config}" if a.startswith("--config=") else a for a in container["args"]]
        assert main(args) == 0
        assert f"0.1.0-r{revision} of batchpilot uploaded" in capsys.readouterr().out

    (pipeline,) = kfp_server.state.pipelines.values()
    versions = sorted(kfp_server.state.versions.values(), key=lambda v: v["name"])
    assert [(v["name"], v["pipeline_id"]) for v in versions] == [
        ("0.1.0-r1", pipeline["pipeline_id"]),
        ("0.1.0-r2", pipeline["pipeline_id"]),
    ]
    stored = versions[0]["pipeline_spec"]
    executors = stored.get("pipeline_spec", stored)["deploymentSpec"]["executors"].values()
    assert {e["container"]["image"] for e in executors} == {"registry.example/batchpilot:0.1.0"}
    assert kfp_server.state.runs == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--experiment", "e"], "--experiment: sets the run, and --upload-only creates no run"),
        (["--run-name", "r"], "--run-name: sets the run, and --upload-only creates no run"),
        (["--service-account", "sa"], "--service-account: sets the run, and --upload-only creates no run"),
        (["--param", "micro_batch_size=8"], "--param: sets the run, and --upload-only creates no run"),
    ],
)
def test_upload_only_refuses_run_options(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert upload_only(kfp_server, "v1", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"batchpilot: error: {message}")
    assert kfp_server.state.requests == []
    assert submit(kfp_server, "--upload-only") == 2
    assert "--upload-only: needs --pipeline-name and --pipeline-version" in capsys.readouterr().err


def test_upload_only_authenticates_with_the_projected_service_account_token(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Multi-user KFP: the chart's Job mounts a token with audience pipelines.kubeflow.org and names it in
    KF_PIPELINES_SA_TOKEN_PATH; the upload sends it as the bearer token, in the profile namespace."""
    kfp_server.state.accepted_tokens = {"projected-sa-token"}
    token_file = tmp_path / "token"
    token_file.write_text("projected-sa-token\n")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))

    assert upload_only(kfp_server, "0.1.0-r1", "--namespace", "team-a") == 0
    assert "0.1.0-r1 of batchpilot uploaded" in capsys.readouterr().out
    (listing, *_) = kfp_server.requests_to("GET", "/pipelines")
    assert listing.headers["authorization"] == "Bearer projected-sa-token"
    assert listing.query["namespace"] == ["team-a"]
    (create,) = kfp_server.requests_to("POST", "/pipelines")
    assert create.body["namespace"] == "team-a"

    token_file.unlink()
    assert upload_only(kfp_server, "0.1.0-r2") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"batchpilot: error: KF_PIPELINES_SA_TOKEN_PATH: cannot read the token file {token_file}"
    )
    assert err.count("\n") == 1


def test_upload_only_dry_run_says_no_run_is_created(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # The last --config wins: the gke config replaces the demo's.
    assert upload_only(kfp_server, "0.1.0-r3", "--dry-run", "--config", NEMO) == 0
    out = capsys.readouterr().out
    assert (
        "pipeline version: upload as version '0.1.0-r3' of pipeline 'batchpilot', no run (--upload-only)"
        in out
    )
    assert "run name: (none: --upload-only)" in out
    assert kfp_server.state.requests == []


def test_host_without_scheme_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert submit("localhost:8080") == 2
    assert capsys.readouterr().err == (
        "batchpilot: error: --host: 'localhost:8080' has no scheme "
        "(fix: write it as http://HOST:PORT or https://HOST)\n"
    )


def test_unreachable_host_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has nothing listening
        sock.bind(("127.0.0.1", 0))
        host = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert submit(host) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"batchpilot: error: --host: cannot reach {host} ")
    assert "Connection refused" in err


def test_error_status_is_one_line_with_host_and_status(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    kfp_server.state.accepted_tokens = {"good-token"}
    assert submit(kfp_server, "--token", "wrong-token") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        f"{kfp_server.endpoint} answered HTTP 401 Unauthorized to get or create experiment 'Default'" in err
    )
    assert "(fix: pass a valid --token" in err
    assert "wrong-token" not in err
    assert kfp_server.state.runs == {}

    monkeypatch.setenv("KFP_TOKEN", "good-token")
    assert submit(kfp_server) == 0
    assert len(kfp_server.state.runs) == 1


def test_a_host_that_is_not_the_kfp_api_fails_at_the_health_check(
    kfp_server: KfpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit(f"{kfp_server.endpoint}/not-kfp") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "answered HTTP 404 Not Found to check the API (GET /apis/v2beta1/healthz)" in err


# --- the stand-in's rules, called with raw HTTP ------------------------------------------------------


def call(server: KfpServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.endpoint}/apis/v2beta1{path}", data=data, method=method,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, text


def upload_version(server: KfpServer, *, pipeline_id: str, name: str, text: str) -> tuple[int, Any]:
    boundary = "b0undary"
    payload = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="uploadfile"; filename="pipeline.yaml"\r\n'
        f"Content-Type: application/x-yaml\r\n\r\n{text}\r\n--{boundary}--\r\n"
    ).encode()
    request = urllib.request.Request(
        f"{server.endpoint}/apis/v2beta1/pipelines/upload_version?name={name}&pipelineid={pipeline_id}",
        data=payload, method="POST", headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def experiment_id(kfp_server: KfpServer) -> str:
    status, experiment = call(kfp_server, "POST", "/experiments", {"display_name": "e"})
    assert status == 200
    return str(experiment["experiment_id"])


def test_stand_in_creates_a_valid_run(kfp_server: KfpServer, demo_yaml: str, experiment_id: str) -> None:
    body = {
        "display_name": "r",
        "experiment_id": experiment_id,
        "pipeline_spec": sent_spec(demo_yaml),
        "runtime_config": {"parameters": {"micro_batch_size": 8}},
    }
    status, run = call(kfp_server, "POST", "/runs", body)
    assert status == 200
    assert call(kfp_server, "GET", f"/runs/{run['run_id']}") == (200, run)


@pytest.mark.parametrize(
    ("change", "status", "text"),
    [
        ({"display_name": ""}, 500, "Run name cannot be empty"),
        ({"pipeline_spec": None}, 500, "empty pipeline spec manifest"),
        ({"pipeline_version_reference": {"pipeline_id": "p", "pipeline_version_id": "v"}}, 400, "oneof"),
        ({"experiment_id": "no-such-experiment"}, 404, "Experiment no-such-experiment not found"),
        ({"runtime_config": {"parameters": {"batch_size": 8}}}, 400, "not required by pipeline: batch_size"),
        ({"runtime_config": {"parameters": {"micro_batch_size": "8"}}}, 400, "requires type NUMBER_INTEGER"),
        ({"runName": "r"}, 400, 'unknown field "runName"'),
    ],
)
def test_stand_in_rejects_runs_the_real_server_rejects(
    kfp_server: KfpServer, demo_yaml: str, experiment_id: str, change: dict[str, Any], status: int, text: str
) -> None:
    body = {"display_name": "r", "experiment_id": experiment_id, "pipeline_spec": sent_spec(demo_yaml)}
    body.update(change)
    got, error = call(kfp_server, "POST", "/runs", {k: v for k, v in body.items() if v is not None})
    assert got == status
    assert text in error["message"]
    assert error["code"] == {400: 3, 404: 5, 500: 13}[status]
    assert kfp_server.state.runs == {}


def test_stand_in_rejects_duplicate_and_nameless_experiments(
    kfp_server: KfpServer, experiment_id: str
) -> None:
    status, error = call(kfp_server, "POST", "/experiments", {"display_name": "e"})
    assert (status, error["code"]) == (409, 6)
    assert "already exists" in error["message"]
    status, error = call(kfp_server, "POST", "/experiments", {"description": "no name"})
    assert status == 500
    assert "Experiment must have a non-empty name" in error["message"]
    assert len(kfp_server.state.experiments) == 1


def test_stand_in_rules_for_pipeline_versions(kfp_server: KfpServer, demo_yaml: str) -> None:
    status, pipeline = call(kfp_server, "POST", "/pipelines", {"display_name": "p"})
    assert status == 200
    pipeline_id = pipeline["pipeline_id"]

    assert upload_version(kfp_server, pipeline_id="no-such-pipeline", name="v1", text=demo_yaml) == (
        400,
        {
            "error_message": "Failed to create a pipeline version",
            "error_details": "Failed to create a pipeline version",
        },
    )
    status, error = upload_version(kfp_server, pipeline_id=pipeline_id, name="v1", text="")
    assert (status, error["error_message"]) == (400, "unknown template format")
    old_schema = demo_yaml.replace("schemaVersion: 2.1.0", "schemaVersion: 2.0.0")
    status, error = upload_version(kfp_server, pipeline_id=pipeline_id, name="v1", text=old_schema)
    assert (status, error["error_message"]) == (
        400,
        "KFP only supports schema version 2.1.0, but the pipeline spec has version 2.0.0",
    )
    assert upload_version(kfp_server, pipeline_id=pipeline_id, name="v1", text=demo_yaml)[0] == 200
    status, error = upload_version(kfp_server, pipeline_id=pipeline_id, name="v1", text=demo_yaml)
    assert status == 409
    assert len(kfp_server.state.versions) == 1

    status, error = call(kfp_server, "GET", f"/pipelines/{pipeline_id}/versions/no-such-version")
    assert (status, error["code"]) == (404, 5)
    status, error = call(kfp_server, "POST", "/pipelines", {"name": "p"})
    assert status == 409
