"""A local server speaking the KFP v2beta1 REST routes that `kfp.Client` 2.17 calls to submit a run.

Routes (kfp_server_api 2.17's paths):
- `GET /apis/v2beta1/healthz` (kfp.Client() calls it on construction),
- experiments: `POST /apis/v2beta1/experiments`, `GET /apis/v2beta1/experiments[?filter=&namespace=]`,
  `GET /apis/v2beta1/experiments/{id}`,
- pipelines: `POST /apis/v2beta1/pipelines`, `GET /apis/v2beta1/pipelines[?filter=]`,
  `GET /apis/v2beta1/pipelines/{id}`, `GET .../pipelines/{id}/versions[?filter=]`,
  `GET .../pipelines/{id}/versions/{version_id}`, and the multipart uploads
  `POST /apis/v2beta1/pipelines/upload` and `POST /apis/v2beta1/pipelines/upload_version`,
- runs: `POST /apis/v2beta1/runs`, `GET /apis/v2beta1/runs/{id}`, and `POST /apis/v2beta1/runs/{id}:terminate`
  (backend/api/v2beta1/run.proto TerminateRun: an empty answer; the run goes CANCELING, then its backend
  ends it CANCELED).

Runs execute only when a backend is attached (`KfpState.on_run`, `on_terminate`, e.g. kfp_backend_sim.py,
which also moves `state` through PENDING, RUNNING and an end); without one a run stays PENDING.

The rules are the real API server's, read from kubeflow/pipelines at tag 2.17.0 (the backend release of
kfp 2.17); each is marked with its source file. Errors carry the real HTTP status and body: the gRPC
gateway's google.rpc.Status JSON (`code`, `message`, `details`) for gRPC routes, and
`{"error_message", "error_details"}` for the two upload routes. The server runs single-user (namespaces
are dropped, as ReplaceNamespace does); `accepted_tokens`, when set, makes the gRPC routes demand one of
those bearer tokens, a simplified form of the multi-user token-review authenticator.

Filters: only `EQUALS` predicates on `display_name` (what kfp.Client's name look-ups send); any other
filter is answered 400 naming this stand-in, never silently ignored.

Every request is recorded (method, path, query, headers, JSON or multipart body) so tests can check what
the real client sent; created objects are kept as the API returns them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.parser import BytesParser
from email.policy import HTTP
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2
from loopback_http import QuietHandler, serving

API = "/apis/v2beta1"
SOURCE = "kubeflow/pipelines@2.17.0"

# google.golang.org/grpc/codes, and grpc-gateway's runtime.HTTPStatusFromCode for each.
INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, INTERNAL, UNAUTHENTICATED = 3, 5, 6, 13, 16
HTTP_STATUS = {
    INVALID_ARGUMENT: 400,
    NOT_FOUND: 404,
    ALREADY_EXISTS: 409,
    INTERNAL: 500,
    UNAUTHENTICATED: 401,
}

# Message fields from backend/api/v2beta1/{run,experiment,pipeline,runtime_config}.proto. The gateway
# unmarshals with DiscardUnknown false (backend/src/apiserver/common/utils.go CustomMarshaler), so any
# other field is a 400.
RUN_FIELDS = {
    "experiment_id", "run_id", "display_name", "storage_state", "description", "pipeline_version_id",
    "pipeline_spec", "pipeline_version_reference", "runtime_config", "service_account", "created_at",
    "scheduled_at", "finished_at", "state", "error", "run_details", "recurring_run_id", "state_history",
    "plugins_input", "plugins_output",
}  # fmt: skip
PIPELINE_SOURCE = ("pipeline_version_id", "pipeline_spec", "pipeline_version_reference")  # oneof
RUNTIME_CONFIG_FIELDS = {"parameters", "pipeline_root"}
VERSION_REFERENCE_FIELDS = {"pipeline_id", "pipeline_version_id"}
EXPERIMENT_FIELDS = {
    "experiment_id", "display_name", "description", "created_at", "namespace", "storage_state",
    "last_run_created_at",
}  # fmt: skip
PIPELINE_FIELDS = {
    "pipeline_id",
    "display_name",
    "name",
    "description",
    "created_at",
    "namespace",
    "error",
    "tags",
}

# backend/src/apiserver/common/utils.go: pipelineNamePattern, checked on the spec's pipelineInfo.name.
PIPELINE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,127}$")
# backend/src/apiserver/template/v2_template.go: the (unanchored) MatchString on pipelineInfo.name.
SPEC_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# backend/src/apiserver/validation/length.go: LengthSpecs.
MAX_EXPERIMENT_NAME, MAX_PIPELINE_NAME, MAX_VERSION_NAME = 128, 128, 127
# server/experiment_server.go CreateExperiment's wrap of a conversion error.
EXPERIMENT_CONVERSION = "[ExperimentServer]: Failed to create a experiment due to conversion error"


class ApiError(Exception):
    """An error the way the API server's UserError reaches the wire (common/util/error.go GRPCStatus)."""

    def __init__(self, code: int, message: str, external: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.external = external or message

    def body(self) -> dict[str, Any]:
        detail = {
            "@type": "type.googleapis.com/google.rpc.Status",
            "code": self.code,
            "message": self.external,
        }
        return {"code": self.code, "message": self.message, "details": [detail]}


def internal(cause: ApiError | str, context: str, *, outer: str) -> ApiError:
    """util.NewInternalServerError(cause, context, outer="Failed to create a new run") wrapped in `outer`: code 13, and the external message
    'Internal Server Error' (common/util/error.go)."""
    text = cause.message if isinstance(cause, ApiError) else cause
    return ApiError(INTERNAL, f"{outer}: InternalServerError: {context}: {text}", "Internal Server Error")


def invalid(message: str) -> ApiError:
    return ApiError(INVALID_ARGUMENT, f"Invalid input error: {message}", message)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case
    body: Any  # parsed JSON, or {"fields": {...}, "files": {name: (filename, bytes)}} for multipart


@dataclass
class KfpState:
    """The fake backend: stored objects as the API returns them, and every request received."""

    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)
    pipelines: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    accepted_tokens: set[str] = field(default_factory=set)
    tag_name: str = "unknown"  # healthz's tag_name: the backend's release (a build that sets none: unknown)
    requests: list[Request] = field(default_factory=list)
    clock: Iterator[int] = field(default_factory=lambda: itertools.count(1_780_000_000))
    lock: threading.RLock = field(default_factory=threading.RLock)
    on_run: Callable[[dict[str, Any]], None] | None = None  # a backend that executes each created run
    on_terminate: Callable[[str], None] | None = None

    def now(self) -> str:
        return datetime.fromtimestamp(next(self.clock), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- request bodies ----------------------------------------------------------------------------------


def _snake(name: str) -> str:
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def message(body: Any, fields: set[str], type_name: str) -> dict[str, Any]:
    """A JSON object as protojson reads it into `type_name`: proto or JSON (camelCase) names, null = unset."""
    if not isinstance(body, dict):
        raise ApiError(INVALID_ARGUMENT, f"proto: syntax error: {type_name} is not a JSON object")
    result = {}
    for key, value in body.items():
        name = _snake(key)
        if name not in fields:
            raise ApiError(INVALID_ARGUMENT, f'proto: (line 1:2): unknown field "{key}"')
        if value is not None:
            result[name] = value
    return result


def parse_run(body: Any) -> dict[str, Any]:
    run = message(body, RUN_FIELDS, "v2beta1.Run")
    # run.proto: pipeline_source is a oneof; protojson refuses a second member.
    present = [name for name in PIPELINE_SOURCE if name in run]
    if len(present) > 1:
        raise ApiError(
            INVALID_ARGUMENT,
            f'proto: (line 1:2): error parsing "{present[1]}", oneof v2beta1.Run.pipeline_source is already set',
        )
    if "runtime_config" in run:
        run["runtime_config"] = message(run["runtime_config"], RUNTIME_CONFIG_FIELDS, "v2beta1.RuntimeConfig")
    if "pipeline_version_reference" in run:
        run["pipeline_version_reference"] = message(
            run["pipeline_version_reference"], VERSION_REFERENCE_FIELDS, "v2beta1.PipelineVersionReference"
        )
    return run


def parse_multipart(content_type: str, data: bytes) -> dict[str, Any]:
    parsed = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + data
    )
    fields: dict[str, str] = {}
    files: dict[str, tuple[str, bytes]] = {}
    if parsed.is_multipart():
        for part in parsed.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            payload = payload if isinstance(payload, bytes) else b""
            if part.get_filename() is not None:
                files[str(name)] = (str(part.get_filename()), payload)
            else:
                fields[str(name)] = payload.decode()
    return {"fields": fields, "files": files}


# --- pipeline specs ----------------------------------------------------------------------------------


def _is_pipeline_spec(doc: Any) -> bool:
    """backend/src/apiserver/template/template.go isPipelineSpec: parses, has a name and a root."""
    try:
        spec = json_format.ParseDict(doc, pipeline_spec_pb2.PipelineSpec())
    except (json_format.ParseError, TypeError, AttributeError):
        return False
    return bool(spec.pipeline_info.name) and spec.HasField("root")


def load_template(docs: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pipeline spec, platform spec) of a manifest's YAML documents, or the InvalidArgument error that
    backend/src/apiserver/template/v2_template.go NewV2SpecTemplate gives."""
    spec: dict[str, Any] | None = None
    platform: dict[str, Any] = {}
    for doc in docs:
        if not doc:
            continue
        if _is_pipeline_spec(doc):
            if spec is not None:
                raise invalid("multiple pipeline specs provided")
            spec = doc
        elif isinstance(doc, dict) and "platforms" in doc:
            platform = doc
    if spec is None:  # template.go inferTemplateFormat: empty, or no document is a v2 pipeline spec
        raise invalid("unknown template format")
    if spec.get("schemaVersion") != "2.1.0":
        raise invalid(
            f"KFP only supports schema version 2.1.0, but the pipeline spec has version {spec.get('schemaVersion', '')}"
        )
    if not SPEC_NAME.search(spec["pipelineInfo"]["name"]):
        raise invalid("invalid v2 pipeline spec: name should consist of lower case alphanumeric characters")
    return spec, platform


def load_yaml_template(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise invalid(f"unable to decode yaml document: {error}") from None
    return load_template(docs)


def spec_struct(spec: dict[str, Any], platform: dict[str, Any]) -> dict[str, Any]:
    """backend/src/apiserver/server/api_util.go YamlStringToPipelineSpecStruct: the spec alone, or both
    under pipeline_spec / platform_spec when there is a platform spec."""
    return {"pipeline_spec": spec, "platform_spec": platform} if platform else spec


def check_parameters(spec: dict[str, Any], parameters: dict[str, Any]) -> None:
    """backend/src/apiserver/template/v2_template.go validatePipelineJobInputs (InvalidArgument)."""
    definitions = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    kinds = {
        "NUMBER_INTEGER": (int, float),
        "NUMBER_DOUBLE": (int, float),
        "STRING": (str,),
        "BOOLEAN": (bool,),
        "LIST": (list,),
        "STRUCT": (dict,),
    }
    for name, definition in definitions.items():
        if name not in parameters:
            if not definition.get("isOptional") and "defaultValue" not in definition:
                raise invalid(
                    f"parameter {name} is not optional, yet has neither default value nor user provided value"
                )
            continue
        value, kind = parameters[name], definition.get("parameterType", "")
        wrong_bool = isinstance(value, bool) and kind != "BOOLEAN"
        if kind not in kinds or wrong_bool or not isinstance(value, kinds[kind]):
            raise invalid(
                f"input parameter {name} requires type {kind}, but the parameter value is not of that type"
            )
    extra = [name for name in parameters if name not in definitions]
    if extra:
        raise invalid(f"parameter(s) provided are not required by pipeline: {', '.join(extra)}")


# --- filters -----------------------------------------------------------------------------------------


def name_filter(query: dict[str, list[str]]) -> str | None:
    """The display name an EQUALS filter asks for (filter.proto), None without a filter."""
    raw = query.get("filter", [""])[0]
    if not raw:
        return None
    try:
        predicates = json.loads(raw).get("predicates", [])
    except (ValueError, AttributeError):
        raise ApiError(INVALID_ARGUMENT, f"Failed to create list options: invalid filter {raw!r}") from None
    names = [
        p.get("stringValue", p.get("string_value"))
        for p in predicates
        if p.get("key") == "display_name" and p.get("operation") in (1, "EQUALS")
    ]
    if len(names) != 1 or len(predicates) != 1:
        raise ApiError(
            INVALID_ARGUMENT, f"kfp_api_server stand-in: only one EQUALS display_name predicate, got {raw}"
        )
    return str(names[0])


def listing(items: list[dict[str, Any]], key: str) -> dict[str, Any]:
    # EmitUnpopulated is false (common/utils.go CustomMarshaler): an empty list sends no fields at all.
    return {key: items, "total_size": len(items)} if items else {}


def populated(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields protojson writes with EmitUnpopulated false: empty strings and maps left out."""
    return {key: value for key, value in obj.items() if value not in ("", {}, None)}


# --- the handler -------------------------------------------------------------------------------------


class _Handler(QuietHandler):
    """Replies JSON, or plain text for a str payload (what Go's http.Error writes)."""

    state: KfpState

    def _record(self) -> Request:
        parts = urlsplit(self.path)
        data = self.read_body()
        content_type = self.headers.get("Content-Type", "")
        body: Any
        if content_type.startswith("multipart/form-data"):
            body = parse_multipart(content_type, data)
        else:
            try:
                body = json.loads(data) if data else None
            except ValueError:
                body = data.decode(errors="replace")
        request = Request(
            self.command,
            parts.path,
            parse_qs(parts.query),
            {k.lower(): v for k, v in self.headers.items()},
            body,
        )
        with self.state.lock:
            self.state.requests.append(request)
        return request

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        request = self._record()
        path = request.path
        if path == f"{API}/healthz":
            # backend/src/apiserver/main.go newHealthzResponse (served outside the gRPC gateway).
            return self.reply(
                200,
                {
                    "commit_sha": "unknown",
                    "tag_name": self.state.tag_name,
                    "multi_user": False,
                    "pipeline_store": "database",
                },
            )
        if (
            path in (f"{API}/pipelines/upload", f"{API}/pipelines/upload_version")
            and request.method == "POST"
        ):
            # Plain HTTP handlers, not the gateway: errors are {"error_message", "error_details"}
            # (backend/src/apiserver/server/pipeline_upload_server.go writeErrorToResponse).
            with self.state.lock:
                upload = _upload_pipeline if path.endswith("/upload") else _upload_version
                code, payload = upload(self.state, request)
            return self.reply(code, payload)
        try:
            self._check_token(request)
            with self.state.lock:
                code, payload = _route(self.state, request)
        except ApiError as error:
            return self.reply(HTTP_STATUS[error.code], error.body())
        self.reply(code, payload)

    def _check_token(self, request: Request) -> None:
        """A simplified backend/src/apiserver/auth/authenticator_token_review.go: Unauthenticated (401)."""
        if not self.state.accepted_tokens:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme != "Bearer" or token not in self.state.accepted_tokens:
            raise ApiError(
                UNAUTHENTICATED,
                "Authentication failure: Review.Status.Authenticated is false",
                "Review.Status.Authenticated is false",
            )


def _route(state: KfpState, request: Request) -> tuple[int, Any]:
    method, parts = request.method, request.path.removeprefix(API).strip("/").split("/")
    if method == "POST" and parts == ["experiments"]:
        return 200, _create_experiment(state, request.body)
    if method == "GET" and parts == ["experiments"]:
        wanted = name_filter(request.query)
        found = [e for e in state.experiments.values() if wanted is None or e["display_name"] == wanted]
        return 200, listing(found, "experiments")
    if method == "GET" and len(parts) == 2 and parts[0] == "experiments":
        return 200, _get(state.experiments, parts[1], "Experiment")
    if method == "POST" and parts == ["pipelines"]:
        return 200, _create_pipeline(state, request.body)
    if method == "GET" and parts == ["pipelines"]:
        wanted = name_filter(request.query)
        found = [p for p in state.pipelines.values() if wanted is None or p["display_name"] == wanted]
        return 200, listing(found, "pipelines")
    if method == "GET" and len(parts) == 2 and parts[0] == "pipelines":
        return 200, _get(state.pipelines, parts[1], "Pipeline")
    if method == "GET" and len(parts) == 3 and parts[0] == "pipelines" and parts[2] == "versions":
        _get(state.pipelines, parts[1], "Pipeline")
        wanted = name_filter(request.query)
        found = [
            v
            for v in state.versions.values()
            if v["pipeline_id"] == parts[1] and (wanted is None or v["display_name"] == wanted)
        ]
        return 200, listing(found, "pipeline_versions")
    if method == "GET" and len(parts) == 4 and parts[0] == "pipelines" and parts[2] == "versions":
        return 200, _get(state.versions, parts[3], "PipelineVersion")
    if method == "POST" and parts == ["runs"]:
        created = _create_run(state, request.body)
        if state.on_run is not None:
            state.on_run(created)
        return 200, created
    if method == "POST" and len(parts) == 2 and parts[0] == "runs" and parts[1].endswith(":terminate"):
        run = _get(state.runs, parts[1].removesuffix(":terminate"), "Run")
        if run["state"] not in ("SUCCEEDED", "FAILED", "CANCELED"):
            run["state"] = "CANCELING"
            if state.on_terminate is not None:
                state.on_terminate(run["run_id"])
        return 200, {}
    if method == "GET" and len(parts) == 2 and parts[0] == "runs":
        return 200, _get(state.runs, parts[1], "Run")
    raise ApiError(NOT_FOUND, "Not Found")  # the gateway's answer to an unknown route


def _get(store: dict[str, dict[str, Any]], key: str, kind: str) -> dict[str, Any]:
    """backend/src/common/util/error.go NewResourceNotFoundError: 404 '<Kind> <id> not found'."""
    if key not in store:
        raise ApiError(NOT_FOUND, f"ResourceNotFoundError: {kind} {key} not found", f"{kind} {key} not found")
    return store[key]


def _create_experiment(state: KfpState, body: Any) -> dict[str, Any]:
    experiment = message(body, EXPERIMENT_FIELDS, "v2beta1.Experiment")
    name = experiment.get("display_name", "")
    # backend/src/apiserver/server/api_converter.go toModelExperiment: an empty name is an Internal error.
    if not name:
        raise internal(
            invalid("Experiment must have a non-empty name"),
            "Failed to convert API experiment to model experiment",
            outer=EXPERIMENT_CONVERSION,
        )
    if len(name) > MAX_EXPERIMENT_NAME:  # validation/length.go, through ValidateModel (Internal)
        raise internal(
            invalid(f"Experiment.Name length cannot exceed {MAX_EXPERIMENT_NAME}"),
            "Failed to convert API experiment to model experiment",
            outer=EXPERIMENT_CONVERSION,
        )
    # backend/src/apiserver/storage/experiment_store.go: unique (Name, Namespace) -> AlreadyExists;
    # single-user mode drops the namespace (resource/resource_manager.go ReplaceNamespace).
    if any(e["display_name"] == name for e in state.experiments.values()):
        raise ApiError(
            ALREADY_EXISTS,
            f"Failed to create a experiment: Already exist error: Failed to create a new experiment. The name {name} already exists. Please specify a new name",
            f"Failed to create a new experiment. The name {name} already exists. Please specify a new name",
        )
    created = {
        "experiment_id": str(uuid.uuid4()),
        "display_name": name,
        "description": experiment.get("description", ""),
        "created_at": state.now(),
        "storage_state": "AVAILABLE",
    }
    created = populated(created)
    state.experiments[created["experiment_id"]] = created
    return created


def _default_experiment_id(state: KfpState) -> str:
    """resource_manager.go GetValidExperimentNamespacePair: no experiment id -> the default experiment."""
    for experiment in state.experiments.values():
        if experiment["display_name"] == "Default":
            return str(experiment["experiment_id"])
    return str(_create_experiment(state, {"display_name": "Default"})["experiment_id"])


def _create_pipeline(state: KfpState, body: Any) -> dict[str, Any]:
    pipeline = message(body, PIPELINE_FIELDS, "v2beta1.Pipeline")
    # api_converter.go toModelPipeline: name falls back to display_name and the other way round.
    name = pipeline.get("name") or pipeline.get("display_name", "")
    if not name:  # pipeline_server.go createPipeline
        raise invalid("name is required")
    if len(name) > MAX_PIPELINE_NAME:
        raise internal(
            invalid(f"Pipeline.Name length cannot exceed {MAX_PIPELINE_NAME}"),
            "Failed to convert API pipeline to model pipeline",
            outer="Failed to create a pipeline as pipeline conversion failed",
        )
    _check_pipeline_name_free(state, name)
    return _store_pipeline(
        state,
        name=name,
        display_name=pipeline.get("display_name") or name,
        description=pipeline.get("description", ""),
    )


def _check_pipeline_name_free(state: KfpState, name: str) -> None:
    # backend/src/apiserver/storage/pipeline_store.go: unique (Namespace, Name) -> AlreadyExists.
    if any(p["name"] == name for p in state.pipelines.values()):
        raise ApiError(
            ALREADY_EXISTS,
            f"Already exist error: Failed to create a new pipeline. The name {name} already exist. Please specify a new name",
            f"Failed to create a new pipeline. The name {name} already exist. Please specify a new name",
        )


def _store_pipeline(state: KfpState, *, name: str, display_name: str, description: str) -> dict[str, Any]:
    created = {
        "pipeline_id": str(uuid.uuid4()),
        "name": name,
        "display_name": display_name,
        "description": description,
        "created_at": state.now(),
    }
    created = populated(created)
    state.pipelines[created["pipeline_id"]] = created
    return created


def _upload_error(code: int, text: str) -> tuple[int, Any]:
    return code, {"error_message": text, "error_details": text}


def _read_upload(request: Request) -> tuple[str, bytes] | None:
    """The `uploadfile` part (pipeline_upload_server.go FormFileKey), None if missing or unreadable.

    server/util.go ReadPipelineFile also takes .zip and .tar.gz packages; this stand-in reads YAML and
    JSON only (kfp.Client uploads the file it is given as is).
    """
    files = request.body.get("files", {}) if isinstance(request.body, dict) else {}
    if "uploadfile" not in files or not files["uploadfile"][0].endswith((".yaml", ".yml", ".json")):
        return None
    return files["uploadfile"]


def _template_of_upload(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """resource_manager.go CreatePipelineVersion / CreatePipelineAndPipelineVersion: the template, and
    common/utils.go ValidatePipelineName on its pipelineInfo.name; all InvalidArgument."""
    template = load_yaml_template(data.decode(errors="replace"))
    if not PIPELINE_NAME.match(template[0]["pipelineInfo"]["name"]):
        raise invalid(
            "pipeline's name must contain only lowercase alphanumeric characters or '-' and must start with alphanumeric characters"
        )
    return template


def _query(request: Request) -> dict[str, str]:
    return {key: values[0] for key, values in request.query.items()}


def _upload_pipeline(state: KfpState, request: Request) -> tuple[int, Any]:
    """pipeline_upload_server.go uploadPipeline: a pipeline and a first version, both named `name`."""
    upload, query = _read_upload(request), _query(request)
    if upload is None:
        return _upload_error(400, "Failed to read a pipeline spec file")
    # pipeline_server.go buildPipelineName: name, else display_name, else the file name.
    name = query.get("name") or query.get("display_name") or upload[0]
    if len(name) > MAX_PIPELINE_NAME:  # validation.ValidateFieldLength, written with http.Error
        return 400, f"Invalid input error: Pipeline.Name length cannot exceed {MAX_PIPELINE_NAME}"
    try:
        spec, platform = _template_of_upload(upload[1])
        _check_pipeline_name_free(state, name)
    except ApiError as error:
        if error.code == ALREADY_EXISTS:
            return _upload_error(409, "Failed to create a pipeline and a pipeline version")
        return _upload_error(400, error.external)
    display = query.get("display_name") or name
    pipeline = _store_pipeline(
        state, name=name, display_name=display, description=query.get("description", "")
    )
    _store_version(
        state,
        pipeline_id=pipeline["pipeline_id"],
        name=name,
        display_name=display,
        spec=spec,
        platform=platform,
    )
    return 200, pipeline


def _upload_version(state: KfpState, request: Request) -> tuple[int, Any]:
    """pipeline_upload_server.go uploadPipelineVersion, checks in its order."""
    upload, query = _read_upload(request), _query(request)
    if upload is None:
        return _upload_error(400, "Failed to create a pipeline version")
    pipeline_id = query.get("pipelineid", "")
    if not pipeline_id:
        return _upload_error(400, "Failed to create a pipeline version")
    name = query.get("name") or query.get("display_name") or upload[0]
    if len(name) > MAX_VERSION_NAME:  # validation.ValidateFieldLength, written with http.Error
        return 400, f"Invalid input error: PipelineVersion.Name length cannot exceed {MAX_VERSION_NAME}"
    if pipeline_id not in state.pipelines:  # FetchNamespaceFromPipelineId fails: a 400, not a 404
        return _upload_error(400, "Failed to create a pipeline version")
    try:
        spec, platform = _template_of_upload(upload[1])
    except ApiError as error:  # InvalidArgument: 400 with the external message
        return _upload_error(400, error.external)
    # model/pipeline_version.go: unique (PipelineId, Name) -> storage AlreadyExists -> 409.
    if any(v["pipeline_id"] == pipeline_id and v["name"] == name for v in state.versions.values()):
        return _upload_error(409, "Failed to create a pipeline version")
    version = _store_version(
        state,
        pipeline_id=pipeline_id,
        name=name,
        display_name=query.get("display_name") or name,
        spec=spec,
        platform=platform,
        description=query.get("description", ""),
    )
    return 200, version


def _store_version(
    state: KfpState,
    *,
    pipeline_id: str,
    name: str,
    display_name: str,
    spec: dict[str, Any],
    platform: dict[str, Any],
    description: str = "",
) -> dict[str, Any]:
    created: dict[str, Any] = {
        "pipeline_id": pipeline_id,
        "pipeline_version_id": str(uuid.uuid4()),
        "name": name,
        "display_name": display_name,
        "description": description,
        "created_at": state.now(),
        "pipeline_spec": spec_struct(spec, platform),
    }
    created = populated(created)
    state.versions[created["pipeline_version_id"]] = created
    return created


def _run_template(state: KfpState, run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(pipeline spec, resolved version reference): resource_manager.go fetchTemplateFromPipelineSpec.

    CreateRun wraps every error here in NewInternalServerError, so all of them are 500s.
    """
    context = "Failed to create a run due to error fetching manifest"
    reference = run.get("pipeline_version_reference")
    if reference:
        version_id, pipeline_id = reference.get("pipeline_version_id", ""), reference.get("pipeline_id", "")
        if version_id:
            if version_id not in state.versions:
                raise internal(
                    f"ResourceNotFoundError: PipelineVersion {version_id} not found",
                    context,
                    outer="Failed to create a new run",
                )
            version = state.versions[version_id]
            if pipeline_id and version["pipeline_id"] != pipeline_id:
                raise internal(
                    invalid(
                        f"Pipeline version {version_id} belongs to pipeline {version['pipeline_id']} (not {pipeline_id})"
                    ),
                    context,
                    outer="Failed to create a new run",
                )
        else:
            latest = [v for v in state.versions.values() if v["pipeline_id"] == pipeline_id]
            if not latest:
                raise internal(
                    f"ResourceNotFoundError: PipelineVersion for pipeline {pipeline_id} not found",
                    context,
                    outer="Failed to create a new run",
                )
            version = latest[-1]
        stored = version["pipeline_spec"]
        docs = [stored["pipeline_spec"], stored["platform_spec"]] if "pipeline_spec" in stored else [stored]
        resolved = {
            "pipeline_id": version["pipeline_id"],
            "pipeline_version_id": version["pipeline_version_id"],
        }
        return load_template(docs)[0], resolved
    # toModelRun reads only pipeline_spec and pipeline_version_reference (the deprecated
    # pipeline_version_id is ignored in v2beta1), so anything else is an empty manifest.
    struct = run.get("pipeline_spec")
    if not struct:
        raise internal(
            invalid("Failed to fetch a template with an empty pipeline spec manifest"),
            context,
            outer="Failed to create a new run",
        )
    # api_util.go pipelineSpecStructToYamlString: the spec, or pipeline_spec + platform_spec.
    docs = [struct["pipeline_spec"], struct.get("platform_spec")] if "pipeline_spec" in struct else [struct]
    try:
        return load_template(docs)[0], None
    except ApiError as error:
        raise internal(error, context, outer="Failed to create a new run") from None


def _create_run(state: KfpState, body: Any) -> dict[str, Any]:
    run = parse_run(body)
    # api_converter.go toModelRun: an empty display_name is an Internal error (500), before anything else.
    if not run.get("display_name"):
        raise internal(
            invalid("Run name cannot be empty"),
            "Failed to convert a API run detail to its internal representation",
            outer="CreateJob(job.ToV2())Failed to create a run due to conversion error",
        )
    experiment_id = run.get("experiment_id") or _default_experiment_id(state)
    if experiment_id not in state.experiments:  # GetValidExperimentNamespacePair -> NotFound
        raise ApiError(
            NOT_FOUND,
            f"Failed to create a new run: Failed to create a run due to invalid experimentId and namespace combination: ResourceNotFoundError: Experiment {experiment_id} not found",
            f"Experiment {experiment_id} not found",
        )
    spec, resolved = _run_template(state, run)
    parameters = run.get("runtime_config", {}).get("parameters", {})
    try:
        check_parameters(spec, parameters)  # template RunWorkflow: util.Wrap keeps InvalidArgument
    except ApiError as error:
        raise ApiError(
            error.code,
            f"Failed to create a new run: invalid pipeline job inputs: {error.message}",
            error.external,
        ) from None
    created = {
        **{
            key: value
            for key, value in run.items()
            if key in ("display_name", "description", "service_account", "runtime_config", "pipeline_spec")
        },
        "run_id": str(uuid.uuid4()),
        "experiment_id": experiment_id,
        "storage_state": "AVAILABLE",
        "state": "PENDING",
        "created_at": state.now(),
    }
    if resolved:
        created["pipeline_version_reference"] = resolved
    state.runs[created["run_id"]] = created
    return created


# --- running it --------------------------------------------------------------------------------------


@dataclass
class KfpServer:
    server: ThreadingHTTPServer
    state: KfpState

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def requests_to(self, method: str, path: str) -> list[Request]:
        """The recorded requests with this method and path (path relative to /apis/v2beta1)."""
        with self.state.lock:
            return [r for r in self.state.requests if r.method == method and r.path == API + path]


@contextlib.contextmanager
def kfp_server_running() -> Iterator[KfpServer]:
    state = KfpState()
    with serving(_Handler, state) as server:
        yield KfpServer(server, state)
