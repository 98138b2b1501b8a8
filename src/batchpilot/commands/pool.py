"""`batchpilot pool resize|scale-down|status`: the node pool of a config (local processes or GKE)."""

from __future__ import annotations

import argparse
from typing import Any

from batchpilot.commands.options import add_config
from batchpilot.config import load_config


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pool",
        help="resize, scale down or show the node pool of a config",
        description="The pool the stages run on: local (a node = devices_per_node local processes, size "
        "recorded in a file) or a GKE node pool (Container API; readiness from the Kubernetes API).",
    )
    actions = parser.add_subparsers(dest="pool_command", metavar="ACTION", required=True)
    resize = actions.add_parser(
        "resize",
        help="resize the pool to --nodes and wait until that many nodes are ready",
        description="Resizes the config's node pool to --nodes and waits until that many nodes are ready "
        "(local: records the size; gke: the Container API, readiness from the Kubernetes API).",
    )
    _common(resize)
    resize.add_argument("--nodes", required=True, type=int, help="node count to resize to")
    resize.add_argument(
        "--timeout-s", type=float, help="readiness wait in seconds (default: cluster.ready_timeout_s)"
    )
    resize.set_defaults(handler=run_resize)
    down = actions.add_parser(
        "scale-down",
        help="resize the pool to cluster.idle_nodes",
        description="Resizes the config's node pool to cluster.idle_nodes, what the pipeline's exit handler "
        "does; with --orphaned, the pools whose run is gone.",
    )
    _common(down)
    down.add_argument(
        "--orphaned",
        action="store_true",
        help="gke: instead, scale down every batchpilot pool of the config's cluster whose run is gone "
        "(its Lease expired) to the idle size recorded on the pool, after deleting the JobSets and "
        "ProvisioningRequests the run left behind; one line per pool and per deleted object",
    )
    down.set_defaults(handler=run_scale_down)
    status = actions.add_parser(
        "status",
        help="print the pool's size and mode",
        description="Prints how the config's node pool describes itself (its size and mode) in one line.",
    )
    _common(status)
    status.set_defaults(handler=run_status)


def _common(parser: argparse.ArgumentParser) -> None:
    add_config(parser)
    parser.add_argument(
        "--pool-state",
        help="local backend: the pool state file (default: cluster.pool_state_path or runs/<name>/pool.json)",
    )


def run_resize(args: argparse.Namespace) -> int:
    from batchpilot.workflow.pool import prepare_pool

    prepare_pool(
        load_config(args.config), num_nodes=args.nodes, timeout_s=args.timeout_s, state_path=args.pool_state
    )
    return 0


def run_scale_down(args: argparse.Namespace) -> int:
    from batchpilot.workflow.pool import scale_down

    if args.orphaned:
        from batchpilot.cluster.ownership import scale_down_orphaned

        for line in scale_down_orphaned(load_config(args.config).cluster):
            print(line)
        return 0
    scale_down(load_config(args.config), state_path=args.pool_state)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from batchpilot.workflow.pool import pool_status

    print(pool_status(load_config(args.config), state_path=args.pool_state))
    return 0
