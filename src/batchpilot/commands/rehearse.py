"""`batchpilot rehearse`: a tiny run of the compiled pipeline on the user's own cluster, disturbed as a long
run would be, one line per check (`batchpilot.rehearse`)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from batchpilot.commands.options import add_config
from batchpilot.config import load_config
from batchpilot.errors import BatchpilotError
from batchpilot.logs import configure_console


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "rehearse",
        help="run a tiny, paced copy of the config's pipeline on a small node pool of its cluster and check "
        "what a long run needs from the cluster's KFP, Argo, JobSet and GKE",
        description="Compiles the config's pipeline for a tiny model on --pool (same cluster, namespace, image "
        "and provisioning; stages on 1 then 2 nodes), submits it to the KFP API, then checks, one line each: the "
        "launch and its rendezvous, a checkpoint, a trainer pod deleted mid-stage (the JobSet restarts and "
        "resumes from the last checkpoint), the stage change on another node count, the train task's pod "
        "deleted (Argo's retry adopts the JobSet, or the run fails), the run terminated from KFP (JobSets and "
        "ProvisioningRequests gone, the exit handler scaled the pool back), and with flex-start a "
        "ProvisioningRequest's round trip. Its data and checkpoints go under gs://BUCKET/batchpilot-rehearsals/ID "
        "(the bucket of train.checkpoint_uri) and are deleted at the end. Exit 0 only when nothing failed.",
    )
    add_config(parser)
    parser.add_argument("--pool", required=True, help="a small, cheap node pool of the config's cluster")
    parser.add_argument(
        "--host", required=True, help="KFP API endpoint with scheme, as for `batchpilot submit`"
    )
    parser.add_argument("--token", help="bearer token for the KFP API (default: $KFP_TOKEN)")
    parser.add_argument("--namespace", help="KFP namespace (multi-user deployments)")
    parser.add_argument(
        "--kfp-namespace", default="kubeflow",
        help="namespace the KFP runs' task pods run in (default: kubeflow)",
    )  # fmt: skip
    parser.add_argument(
        "--pace-s", type=float, default=0.5,
        help="seconds each optimizer step lasts at least (train.min_step_s; default 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--step-timeout-s", type=float, default=900.0,
        help="the most each check waits for what it checks (default 900)",
    )  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="leave the rehearsal's data and checkpoints")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchpilot.rehearse.steps import Options, Rehearsal, summary

    config = load_config(args.config)
    if config.cluster.backend != "gke":
        raise BatchpilotError(
            "cluster.backend", f"is {config.cluster.backend!r}; a rehearsal runs on a GKE cluster",
            "rehearse a gke config (the local pipeline is `batchpilot run`)",
        )  # fmt: skip
    if args.pace_s <= 0 or args.step_timeout_s <= 0:
        raise BatchpilotError("--pace-s" if args.pace_s <= 0 else "--step-timeout-s", "must be positive")
    configure_console(level=logging.WARNING)
    for name in ("google.auth", "urllib3", "kubernetes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    options = Options(
        pool=args.pool, host=args.host, token=args.token or os.environ.get("KFP_TOKEN") or None,
        namespace=args.namespace, kfp_namespace=args.kfp_namespace, pace_s=args.pace_s,
        step_timeout_s=args.step_timeout_s, keep=args.keep,
    )  # fmt: skip
    rehearsal, checks = Rehearsal(config, options), []
    try:
        for check in rehearsal.run():
            print(f"rehearse: {check.line()}", flush=True)
            checks.append(check)
    except KeyboardInterrupt:  # Ctrl-C: nothing of the rehearsal may keep running or stay behind
        print("rehearse: interrupted: terminating the run and deleting its folder", flush=True)
        for check in rehearsal.wind_down():
            print(f"rehearse: {check.line()}", flush=True)
        return 130
    print(summary(checks))
    return 1 if any(c.status == "FAILED" for c in checks) else 0
