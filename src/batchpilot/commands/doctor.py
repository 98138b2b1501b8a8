"""`batchpilot doctor`: one line per check of the cluster, storage and KFP a config's run will use."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from batchpilot.commands.options import add_config
from batchpilot.config import load_config
from batchpilot.logs import configure_console

TOKEN_ENV = "KFP_TOKEN"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check that the cluster, storage and KFP match what the config and its plan assume",
        description="Checks, in order, what a run of --config needs: credentials, the node pool (machine and "
        "accelerator type, GPU driver), the GPU quota for the plan's largest launch, the Kubernetes API, the "
        "RBAC a run uses, the JobSet CRD, the pool's GPU nodes, the data manifest, a write to the checkpoint "
        "prefix, (with --host) the KFP API, and how the cluster's Argo retries the tasks. One line per check: passed, FAILED with the fix, or skipped "
        "with why. Exit 0 only when nothing failed.",
    )
    add_config(parser)
    parser.add_argument(
        "--host", help="KFP API endpoint with scheme, as for `batchpilot submit` (none: not checked)"
    )
    parser.add_argument(
        "--kfp-namespace",
        default="kubeflow",
        help="namespace KFP (and its Argo workflow controller) is installed in, where the argo retries check "
        "reads workflow-controller-configmap (default: kubeflow)",
    )
    parser.add_argument(
        "--token",
        help=f"bearer token for the KFP API (default: ${TOKEN_ENV}, else the file KF_PIPELINES_SA_TOKEN_PATH names)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.doctor import run_checks
    from batchpilot.kfp.submit import SA_TOKEN_PATH_ENV, read_token_file

    config = load_config(args.config)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and args.host and os.environ.get(SA_TOKEN_PATH_ENV):
        token = read_token_file(os.environ[SA_TOKEN_PATH_ENV])
    # The lines below are the output: library progress and client-library warnings (google-auth's
    # metadata-server probe, urllib3's retries) would interleave with them.
    configure_console(level=logging.WARNING)
    for name in ("google.auth", "urllib3", "kubernetes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    counts = {"passed": 0, "FAILED": 0, "skipped": 0}
    for check in run_checks(config, kfp_host=args.host, kfp_token=token, kfp_namespace=args.kfp_namespace):
        print(check.line(), flush=True)
        counts[check.status] += 1
    print(f"doctor: {counts['passed']} passed, {counts['FAILED']} FAILED, {counts['skipped']} skipped")
    return 1 if counts["FAILED"] else 0
