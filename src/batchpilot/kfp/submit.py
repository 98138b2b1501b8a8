"""Submitting the pipeline for a config to a Kubeflow Pipelines backend: what `batchpilot submit` runs.

`prepare_request` compiles the pipeline and checks every option without touching the network;
`submit` sends that request through `kfp.Client`: it gets or creates the experiment, optionally uploads
the compiled spec as a named pipeline version, and creates the run. `upload` (`--upload-only`, what the
Helm chart's upload Job runs) only uploads the version: one pipeline per name, created if missing, and
a new version of it per upload. Every failure to reach the host or every error status the API answers
becomes one `BatchpilotError` line naming the host and the status.

A pipeline version is immutable in KFP. When `--pipeline-version` names a version that already exists,
it is reused if its stored spec is the one just compiled (a re-submit of the same config, image and
batchpilot release) and refused otherwise, so a run never silently uses a spec other than the one asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)

ParameterValue = int | float | str | bool
DEFAULT_EXPERIMENT = "Default"
"""KFP's own default experiment name (what `kfp.Client.create_run_from_pipeline_package` uses)."""
SA_TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
"""kfp.client.KF_PIPELINES_SA_TOKEN_ENV: the file holding a projected service-account token (audience
`pipelines.kubeflow.org`) that multi-user KFP accepts; kfp.Client itself reads it only when no host is
given, so batchpilot reads it when `--host` is."""
_EQUALS = 1  # filter.proto Predicate.Operation EQUALS (kfp.client.client._FILTER_OPERATIONS)


@dataclass(frozen=True)
class SubmitRequest:
    """One submission, everything decided and checked: `--dry-run` prints `render()` and sends nothing.

    Attributes:
        host: the KFP API endpoint with its scheme, no trailing slash (also the UI base for run links).
        experiment: experiment display name; created if missing.
        run_name: the run's display name.
        service_account: Kubernetes service account of the run's pods (None: the server's default).
        namespace: KFP namespace (multi-user deployments; None: the client's default).
        pipeline_name, pipeline_version: upload the spec as this version of this pipeline and run the
            version (both None: run the compiled spec directly).
        parameters: run-time arguments as (name, value) pairs, typed per the pipeline's inputs.
        spec_name: the compiled pipeline's `pipelineInfo.name`.
        num_stages: the pipeline's ramp-up stage count.
        pipeline_yaml: the compiled pipeline (KFP YAML text).
        uses_token: whether a bearer token is sent (the token itself is never stored here).
        upload_only: upload the pipeline version and create no run (no experiment either).
    """

    host: str
    experiment: str
    run_name: str
    service_account: str | None
    namespace: str | None
    pipeline_name: str | None
    pipeline_version: str | None
    parameters: tuple[tuple[str, ParameterValue], ...]
    spec_name: str
    num_stages: int
    pipeline_yaml: str = field(repr=False)
    uses_token: bool = False
    upload_only: bool = False

    @property
    def spec_bytes(self) -> int:
        return len(self.pipeline_yaml.encode())

    @property
    def arguments(self) -> dict[str, ParameterValue]:
        return dict(self.parameters)

    def render(self) -> str:
        """The request as the lines `--dry-run` prints."""
        if self.pipeline_name:
            then = "no run (--upload-only)" if self.upload_only else "run it"
            target = f"upload as version {self.pipeline_version!r} of pipeline {self.pipeline_name!r}, {then}"
        else:
            target = "none: the run carries the compiled spec"
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.parameters)
        run = {
            "experiment": self.experiment,
            "run name": self.run_name,
            "service account": self.service_account or "(the server's default)",
        }
        if self.upload_only:
            run = dict.fromkeys(run, "(none: --upload-only)")
        lines = {
            "host": self.host,
            **run,
            "namespace": self.namespace or "(the client's default)",
            "pipeline version": target,
            "parameters": arguments or "(none: the pipeline's defaults)",
            "pipeline": f"{self.spec_name}, {self.num_stages} stage(s), spec {self.spec_bytes:,} bytes",
            "auth": "bearer token (not shown)" if self.uses_token else "none",
        }
        return "\n".join(f"{key}: {value}" for key, value in lines.items())


@dataclass(frozen=True)
class SubmitResult:
    run_id: str
    run_url: str
    experiment_id: str
    pipeline_id: str | None = None
    pipeline_version_id: str | None = None
    version_reused: bool = False


@dataclass(frozen=True)
class UploadResult:
    pipeline_id: str
    pipeline_version_id: str
    version_reused: bool
    version_url: str


def prepare_request(
    *,
    config_path: str,
    host: str,
    experiment: str | None,
    run_name: str | None,
    service_account: str | None,
    namespace: str | None,
    pipeline_name: str | None,
    pipeline_version: str | None,
    image: str | None,
    param_pairs: Sequence[str],
    uses_token: bool,
    upload_only: bool = False,
    now: datetime | None = None,
) -> SubmitRequest:
    """Loads and compiles the config and checks every option; no network call."""
    from batchpilot.config import load_config
    from batchpilot.kfp.compile import compile_pipeline
    from batchpilot.kfp.shape import expected_stage_count

    host = check_host(host)
    if upload_only:
        _check_upload_only(
            pipeline_name=pipeline_name,
            run_options={
                "--experiment": experiment,
                "--run-name": run_name,
                "--service-account": service_account,
                "--param": list(param_pairs) or None,
            },
        )
    if pipeline_name is not None and pipeline_version is None:
        raise BatchpilotError(
            "--pipeline-name", "is given without --pipeline-version", "pass both, or neither"
        )
    if pipeline_version is not None and pipeline_name is None:
        raise BatchpilotError(
            "--pipeline-version", "is given without --pipeline-name", "pass both, or neither"
        )
    named = {
        "--experiment": experiment,
        "--run-name": run_name,
        "--pipeline-name": pipeline_name,
        "--pipeline-version": pipeline_version,
    }
    for option, value in named.items():
        if value is not None and not value.strip():
            raise BatchpilotError(option, "is empty", "pass a non-empty name, or leave the option out")
    config = load_config(config_path)
    pipeline_yaml = compile_pipeline(config, image=image)
    spec, _ = split_pipeline_yaml(pipeline_yaml)
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    parameters = parse_parameters(pairs=param_pairs, inputs=pipeline_inputs(spec))
    check_parameters(config, dict(parameters))
    return SubmitRequest(
        host=host,
        experiment=experiment or DEFAULT_EXPERIMENT,
        run_name=run_name or f"{config.name}-{stamp}",
        service_account=service_account,
        namespace=namespace,
        pipeline_name=pipeline_name,
        pipeline_version=pipeline_version,
        parameters=parameters,
        spec_name=spec["pipelineInfo"]["name"],
        num_stages=expected_stage_count(config),
        pipeline_yaml=pipeline_yaml,
        uses_token=uses_token,
        upload_only=upload_only,
    )


def _check_upload_only(*, pipeline_name: str | None, run_options: Mapping[str, object]) -> None:
    """--upload-only needs a pipeline name (the version is checked with it) and takes no run option."""
    if pipeline_name is None:
        raise BatchpilotError(
            "--upload-only",
            "needs --pipeline-name and --pipeline-version",
            "name the pipeline and the version to upload",
        )
    for option, value in run_options.items():
        if value is not None:
            raise BatchpilotError(
                option, "sets the run, and --upload-only creates no run", f"drop {option} or --upload-only"
            )


def read_token_file(path: str) -> str:
    """The bearer token in `path` (a projected service-account token, refreshed by the kubelet).

    Raises:
        BatchpilotError: the file cannot be read or is empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise BatchpilotError(
            SA_TOKEN_PATH_ENV,
            f"cannot read the token file {path}: {error.strerror}",
            "mount a projected service-account token there (audience pipelines.kubeflow.org) or unset it",
        ) from None
    if not token:
        raise BatchpilotError(SA_TOKEN_PATH_ENV, f"the token file {path} is empty", "check the volume")
    return token


def check_host(host: str) -> str:
    """The host without a trailing slash; it must carry its scheme (kfp.Client would assume https)."""
    if not host.startswith(("http://", "https://")):
        raise BatchpilotError(
            "--host", f"{host!r} has no scheme", "write it as http://HOST:PORT or https://HOST"
        )
    return host.rstrip("/")


def split_pipeline_yaml(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pipeline spec, platform spec) of compiled KFP YAML: the first document, then the others merged."""
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    platform: dict[str, Any] = {}
    for doc in docs[1:]:
        platform.update(doc)
    return docs[0], platform


def pipeline_inputs(spec: Mapping[str, Any]) -> dict[str, str]:
    """The pipeline's run-time parameters: name -> KFP parameter type (e.g. NUMBER_INTEGER)."""
    parameters = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    return {name: definition["parameterType"] for name, definition in parameters.items()}


def parse_parameters(
    *, pairs: Sequence[str], inputs: Mapping[str, str]
) -> tuple[tuple[str, ParameterValue], ...]:
    """`KEY=VALUE` strings as typed (name, value) pairs; unknown names, bad values and repeats are errors."""
    parsed: dict[str, ParameterValue] = {}
    known = ", ".join(sorted(inputs))
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise BatchpilotError(
                "--param", f"{pair!r} is not KEY=VALUE", "write e.g. --param micro_batch_size=16"
            )
        if name not in inputs:
            raise BatchpilotError(
                "--param", f"{name!r} is not a parameter of the pipeline", f"use one of: {known}"
            )
        if name in parsed:
            raise BatchpilotError("--param", f"{name!r} is given twice", "pass each parameter once")
        parsed[name] = _typed_value(name=name, text=text, parameter_type=inputs[name])
    return tuple(parsed.items())


def check_parameters(config: Config, values: Mapping[str, ParameterValue]) -> None:
    """The run-time parameters checked as the plan step will check them, before the run is created (on a
    cluster the plan step runs after the pool and the canary have spent accelerator time): a negative
    count, a config_yaml that is not a valid config, or a micro batch or total the plan refuses.

    Raises:
        BatchpilotError: the parameter, what the plan says, and the fix.
    """
    from batchpilot.config import config_from_text
    from batchpilot.kfp.pipeline import config_parameter
    from batchpilot.workflow.plan import preflight

    for name in ("micro_batch_size", "total_samples"):
        value = values.get(name, 0)
        if isinstance(value, int) and value < 0:
            raise BatchpilotError(
                "--param", f"{name}={value} is negative", f"give a positive {name}, or 0 for the config's own"
            )
    if not any(values.get(name) for name in ("config_yaml", "micro_batch_size", "total_samples")):
        return
    text = str(values.get("config_yaml") or config_parameter(config))
    micro, total = int(values.get("micro_batch_size") or 0), int(values.get("total_samples") or 0)
    try:
        preflight(config_from_text(text, micro_batch_size=micro, total_samples=total))
    except BatchpilotError as error:
        given = ", ".join(
            f"{name}=..." if name == "config_yaml" else f"{name}={values[name]}"
            for name in ("config_yaml", "micro_batch_size", "total_samples")
            if values.get(name)
        )
        raise BatchpilotError(
            "--param",
            f"with {given} the plan step would refuse the run: {error.field}: {error.problem}",
            error.fix or f"correct {error.field}",
        ) from None


def _typed_value(*, name: str, text: str, parameter_type: str) -> ParameterValue:
    problem = f"{name}={text!r} is not "
    if parameter_type == "NUMBER_INTEGER":
        try:
            return int(text.strip())
        except ValueError:
            raise BatchpilotError(
                "--param", problem + "an integer", f"write a whole number, e.g. --param {name}=16"
            ) from None
    if parameter_type == "NUMBER_DOUBLE":
        try:
            return float(text.strip())
        except ValueError:
            raise BatchpilotError("--param", problem + "a number", f"write e.g. --param {name}=0.5") from None
    if parameter_type == "BOOLEAN":
        if text.strip().lower() not in ("true", "false"):
            raise BatchpilotError("--param", problem + "a boolean", f"write --param {name}=true or =false")
        return text.strip().lower() == "true"
    if parameter_type == "STRING":
        return text
    raise BatchpilotError(
        "--param",
        f"{name} has KFP type {parameter_type}, which --param cannot pass",
        "leave it at its default",
    )


# --- talking to the backend --------------------------------------------------------------------------


def upload(request: SubmitRequest, *, token: str | None) -> UploadResult:
    """Uploads the compiled spec as `request.pipeline_version` of `request.pipeline_name`; no run.

    The pipeline is created only if no pipeline has that name, so every upload (every chart upgrade)
    adds a version to the same pipeline; re-uploading an existing version with the identical spec (a
    retried upload Job) reuses it.
    """
    assert request.pipeline_name and request.pipeline_version, "prepare_request checks both"
    client = _connect(request, token=token)
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pipeline.yaml"
        package.write_text(request.pipeline_yaml)
        pipeline_id, version_id, reused = _ensure_request_version(client, request, package=str(package))
    return UploadResult(
        pipeline_id=pipeline_id,
        pipeline_version_id=version_id,
        version_reused=reused,
        version_url=f"{request.host}/#/pipelines/details/{pipeline_id}/version/{version_id}",
    )


def submit(request: SubmitRequest, *, token: str | None) -> SubmitResult:
    """Creates the run `request` describes; returns its id and UI link."""
    client = _connect(request, token=token)
    with _talking_to(request.host, f"get or create experiment {request.experiment!r}"):
        try:
            experiment = client.create_experiment(name=request.experiment, namespace=request.namespace)
        except ValueError as error:  # kfp: "Multiple experiments is found with name ..."
            raise BatchpilotError("--experiment", _one_line(str(error)), "pick a unique name") from None
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pipeline.yaml"
        package.write_text(request.pipeline_yaml)
        pipeline_id = version_id = None
        reused = False
        if request.pipeline_name and request.pipeline_version:
            pipeline_id, version_id, reused = _ensure_request_version(client, request, package=str(package))
        with _talking_to(request.host, f"create run {request.run_name!r}"):
            run = client.run_pipeline(
                experiment_id=experiment.experiment_id,
                job_name=request.run_name,
                pipeline_package_path=None if version_id else str(package),
                pipeline_id=pipeline_id,
                version_id=version_id,
                params=request.arguments,
                service_account=request.service_account,
            )
    return SubmitResult(
        run_id=run.run_id,
        run_url=f"{request.host}/#/runs/details/{run.run_id}",
        experiment_id=experiment.experiment_id,
        pipeline_id=pipeline_id,
        pipeline_version_id=version_id,
        version_reused=reused,
    )


def _connect(request: SubmitRequest, *, token: str | None) -> Any:
    """A kfp.Client for the request's host and namespace, after a health check that fails fast."""
    _check_reachable(host=request.host, token=token)
    with _talking_to(request.host, "connect"):
        return _client(host=request.host, token=token, namespace=request.namespace)


def _check_reachable(*, host: str, token: str | None) -> None:
    """One GET of /apis/v2beta1/healthz through KFP's own HTTP client, before `kfp.Client` makes its own.

    `kfp.Client()` retries a failing healthz five times, 5 s apart, and then reports neither the status
    nor the reason; this probe fails at once with both (e.g. 401 for a bad token, 404 for a wrong URL).
    """
    import kfp_server_api

    configuration = kfp_server_api.Configuration(host=host)
    if token:
        configuration.api_key["authorization"] = token
        configuration.api_key_prefix["authorization"] = "Bearer"
    with _talking_to(host, "check the API (GET /apis/v2beta1/healthz)"):
        api = kfp_server_api.HealthzServiceApi(kfp_server_api.ApiClient(configuration))
        api.healthz_service_get_healthz()


def _client(*, host: str, token: str | None, namespace: str | None) -> Any:
    import kfp

    with warnings.catch_warnings(), _quiet_stdout():
        # kfp.Client warns on every construction that it needs a KFP >= 2.0.0-beta.2 backend.
        warnings.simplefilter("ignore", FutureWarning)
        if namespace:
            return kfp.Client(host=host, existing_token=token, namespace=namespace)
        return kfp.Client(host=host, existing_token=token)


def _ensure_request_version(client: Any, request: SubmitRequest, *, package: str) -> tuple[str, str, bool]:
    """`_ensure_version` for the request's pipeline, version, namespace and compiled spec."""
    assert request.pipeline_name and request.pipeline_version
    return _ensure_version(
        client,
        host=request.host,
        pipeline_name=request.pipeline_name,
        version_name=request.pipeline_version,
        namespace=request.namespace,
        package=package,
        pipeline_yaml=request.pipeline_yaml,
    )


def _ensure_version(
    client: Any,
    *,
    host: str,
    pipeline_name: str,
    version_name: str,
    namespace: str | None,
    package: str,
    pipeline_yaml: str,
) -> tuple[str, str, bool]:
    """(pipeline id, version id, reused): uploads the spec as the version unless an identical one exists."""
    import kfp_server_api

    with _talking_to(host, f"find pipeline {pipeline_name!r}"):
        pipelines = client.list_pipelines(filter=_name_filter(pipeline_name), namespace=namespace).pipelines
    if pipelines and len(pipelines) > 1:
        problem = f"{len(pipelines)} pipelines on {host} are named {pipeline_name!r}"
        raise BatchpilotError("--pipeline-name", problem, "pick a unique name")
    if pipelines:
        pipeline_id = pipelines[0].pipeline_id
        version_id = _identical_version(
            client, host=host, pipeline_id=pipeline_id, pipeline_name=pipeline_name,
            version_name=version_name, pipeline_yaml=pipeline_yaml,
        )  # fmt: skip
        if version_id:
            return pipeline_id, version_id, True
    else:
        with _talking_to(host, f"create pipeline {pipeline_name!r}"):
            # kfp.Client has no wrapper for CreatePipeline (a pipeline with no version yet); its
            # upload_pipeline would also create a first version named after the pipeline.
            body = kfp_server_api.V2beta1Pipeline(
                name=pipeline_name, display_name=pipeline_name, namespace=namespace
            )
            pipeline_id = client.pipelines.pipeline_service_create_pipeline(pipeline=body).pipeline_id
    with _talking_to(host, f"upload version {version_name!r} of pipeline {pipeline_name!r}"):
        version = client.upload_pipeline_version(
            package, pipeline_version_name=version_name, pipeline_id=pipeline_id
        )
    return pipeline_id, version.pipeline_version_id, False


def _identical_version(
    client: Any, *, host: str, pipeline_id: str, pipeline_name: str, version_name: str, pipeline_yaml: str
) -> str | None:
    """The id of the existing version `version_name` if its spec is `pipeline_yaml`; None if there is none.

    Raises:
        BatchpilotError: the version exists with another spec (versions are immutable in KFP).
    """
    with _talking_to(host, f"list versions of pipeline {pipeline_name!r}"):
        found = client.list_pipeline_versions(
            pipeline_id, filter=_name_filter(version_name)
        ).pipeline_versions
    if not found:
        return None
    version_id: str = found[0].pipeline_version_id
    with _talking_to(host, f"get version {version_name!r} of pipeline {pipeline_name!r}"):
        stored = client.get_pipeline_version(pipeline_id, version_id).pipeline_spec
    if not same_spec(stored or {}, pipeline_yaml):
        raise BatchpilotError(
            "--pipeline-version",
            f"version {version_name!r} of pipeline {pipeline_name!r} already exists on {host} "
            "with a different spec (KFP versions are immutable)",
            "pass a new --pipeline-version, or omit --pipeline-name to run the compiled spec directly",
        )
    return version_id


def same_spec(stored: Mapping[str, Any], pipeline_yaml: str) -> bool:
    """Whether a version's stored spec (as the API returns it) is the compiled YAML, compared as protos.

    The server re-serializes what it stores, and returns `{pipeline_spec, platform_spec}` when there is a
    platform spec; comparing parsed protos ignores those differences of form (KFP's api_util.go
    YamlStringToPipelineSpecStruct).
    """
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    if "pipeline_spec" in stored:
        stored_pair = (stored["pipeline_spec"], stored.get("platform_spec") or {})
    else:
        stored_pair = (dict(stored), {})

    def parsed(pipeline: Mapping[str, Any], platform: Mapping[str, Any]) -> tuple[Any, Any]:
        return (
            json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec()),
            json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec()),
        )

    try:
        return parsed(*stored_pair) == parsed(*split_pipeline_yaml(pipeline_yaml))
    except json_format.ParseError:
        return False


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [{"operation": _EQUALS, "key": "display_name", "stringValue": name}]})


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """kfp.Client prints UI links of its own (experiment, pipeline, run); keep them off our output."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        yield
    for line in captured.getvalue().splitlines():
        logger.debug("kfp: %s", line)


@contextlib.contextmanager
def _talking_to(host: str, action: str) -> Iterator[None]:
    """Turns a failure to reach `host` or an error status from it into one BatchpilotError line."""
    import kfp_server_api
    import urllib3

    try:
        with _quiet_stdout():
            yield
    except BatchpilotError:
        raise
    except kfp_server_api.ApiException as error:
        if not error.status:  # kfp_server_api's rest.py reports a TLS failure as status 0
            problem = f"cannot {action} at {host}: {_one_line(str(error.reason))}"
            raise BatchpilotError(
                "--host", problem, "check the URL's scheme and the server's certificate"
            ) from None
        problem = (
            f"{host} answered HTTP {error.status} {error.reason} to {action}: {_server_message(error.body)}"
        )
        raise BatchpilotError("--host", problem, _fix_for(error.status)) from None
    except urllib3.exceptions.HTTPError as error:
        reason = getattr(error, "reason", None) or error
        problem = f"cannot reach {host} to {action}: {_one_line(str(reason))}"
        raise BatchpilotError(
            "--host", problem, "check the URL and that the KFP API server (or its port-forward) is up"
        ) from None
    except TimeoutError as error:  # kfp.Client() gave up on its healthz retries
        raise BatchpilotError("--host", f"{host}: cannot {action}: {_one_line(str(error))}") from None


def _server_message(body: Any) -> str:
    """The API's error message: `message` (gRPC gateway status) or `error_message` (upload endpoints)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        payload = json.loads(text)
    except ValueError:
        return _one_line(text) or "(no message)"
    if isinstance(payload, dict):
        text = str(payload.get("message") or payload.get("error_message") or text)
    return _one_line(text) or "(no message)"


def _fix_for(status: int) -> str:
    if status in (401, 403):
        return "pass a valid --token (or set KFP_TOKEN) with access to this namespace"
    if status == 404:
        return "check that --host is the KFP API endpoint (it serves /apis/v2beta1/healthz)"
    if status == 409:
        return "the name is taken: choose another, or retry if another submit was creating it"
    return "see the server's message above"


def _one_line(text: str) -> str:
    return " ".join(text.split())
