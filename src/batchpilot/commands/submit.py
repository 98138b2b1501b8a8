"""`batchpilot submit`: compile the pipeline for a config and create a run of it on a KFP backend.

With `--upload-only` it uploads the compiled pipeline as a new version of a named pipeline and creates no
run: what the Helm chart's upload Job runs on every install and upgrade.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from batchpilot.commands.options import add_config, add_dry_run
from batchpilot.errors import BatchpilotError
from batchpilot.kfp.submit import SA_TOKEN_PATH_ENV

TOKEN_ENV = "KFP_TOKEN"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "submit",
        help="compile the pipeline for a config and create a run on a Kubeflow Pipelines backend",
        description="Compiles the pipeline for --config and creates a run of it through kfp.Client: in "
        "--experiment (created if missing), either from the compiled spec or from a pipeline version "
        "uploaded as --pipeline-name/--pipeline-version. Prints the run id and its UI link. With "
        "--upload-only, only uploads the version (the pipeline is created if missing) and prints its link. "
        "A config with cluster.backend: local is refused (it runs with `batchpilot run --local`).",
    )
    add_config(parser)
    parser.add_argument(
        "--host", required=True, help="KFP API endpoint with scheme, e.g. http://localhost:8080"
    )
    parser.add_argument("--experiment", help="experiment name, created if missing (default: Default)")
    parser.add_argument("--run-name", help="run name (default: <config name>-<UTC yyyymmdd-HHMMSS>)")
    parser.add_argument(
        "--service-account",
        help="Kubernetes service account the run's pods run as (default: the server's, pipeline-runner in "
        "single-user KFP, default-editor in a profile namespace); it needs the chart's RBAC and Workload Identity",
    )
    parser.add_argument("--namespace", help="KFP namespace, for multi-user deployments")
    parser.add_argument(
        "--pipeline-name",
        help="upload the spec as a version of this pipeline (created if missing) and run that version",
    )
    parser.add_argument(
        "--pipeline-version",
        help="version name for --pipeline-name; an existing version is reused only if its spec is identical",
    )
    parser.add_argument("--image", help="container image of the pipeline's steps (default: the pinned one)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run-time parameter of the pipeline, e.g. micro_batch_size=16; repeatable (an unknown name lists the valid ones)",
    )
    parser.add_argument(
        "--upload-only",
        action="store_true",
        help="upload --pipeline-name/--pipeline-version and create no run (no run options allowed)",
    )
    parser.add_argument(
        "--token",
        help=f"bearer token for the API (default: ${TOKEN_ENV}, else the file ${SA_TOKEN_PATH_ENV} names, "
        "e.g. a projected service-account token for multi-user KFP); never printed",
    )
    add_dry_run(parser, help="print the request and send nothing (no connection at all)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.kfp.submit import prepare_request, read_token_file, submit, upload

    _refuse_local_backend(args.config)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    token_path = os.environ.get(SA_TOKEN_PATH_ENV)
    if token is None and token_path:
        token = read_token_file(token_path)
    request = prepare_request(
        config_path=args.config,
        host=args.host,
        experiment=args.experiment,
        run_name=args.run_name,
        service_account=args.service_account,
        namespace=args.namespace,
        pipeline_name=args.pipeline_name,
        pipeline_version=args.pipeline_version,
        image=args.image,
        param_pairs=args.param,
        uses_token=token is not None,
        upload_only=args.upload_only,
    )
    if args.dry_run:
        print(f"dry run: nothing sent\n{request.render()}")
        return 0
    if request.upload_only:
        uploaded = upload(request, token=token)
        how = "reused (identical spec)" if uploaded.version_reused else "uploaded"
        print(f"pipeline version: {request.pipeline_version} of {request.pipeline_name} {how}")
        print(f"version url: {uploaded.version_url}")
        return 0
    result = submit(request, token=token)
    if result.pipeline_version_id:
        how = "reused (identical spec)" if result.version_reused else "uploaded"
        print(f"pipeline version: {request.pipeline_version} of {request.pipeline_name} {how}")
    print(f"run id: {result.run_id}")
    print(f"run url: {result.run_url}")
    return 0


def _refuse_local_backend(config_path: str) -> None:
    """A local backend's pool, data and checkpoints are this machine's: the pods a cluster's KFP starts would
    share none of them, so neither a submission nor its dry run makes sense."""
    from batchpilot.config import load_config

    if load_config(config_path).cluster.backend == "local":
        raise BatchpilotError(
            "cluster.backend",
            "is 'local': a local backend runs on this machine with `batchpilot run --local`, not through KFP",
            f"batchpilot run --local --config {config_path} --out DIR, or set cluster.backend: gke to submit",
        )
