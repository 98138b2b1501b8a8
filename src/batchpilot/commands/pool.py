"""`batchpilot pool resize|scale-down|status`: the node pool of a config (local processes or GKE)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from batchpilot.config import Config, load_config
from batchpilot.errors import BatchpilotError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pool",
        help="resize, scale down or show the node pool of a config",
        description="The pool the stages run on: local (a node = devices_per_node local processes, size "
        "recorded in a file) or a GKE node pool (Container API; readiness from the Kubernetes API).",
    )
    actions = parser.add_subparsers(dest="pool_command", metavar="ACTION", required=True)
    resize = actions.add_parser(
        "resize", help="resize the pool to --nodes and wait until that many nodes are ready"
    )
    _common(resize)
    resize.add_argument("--nodes", required=True, type=int, help="node count to resize to")
    resize.add_argument(
        "--timeout-s", type=float, help="readiness wait in seconds (default: cluster.ready_timeout_s)"
    )
    resize.set_defaults(handler=run_resize)
    down = actions.add_parser("scale-down", help="resize the pool to cluster.idle_nodes")
    _common(down)
    down.set_defaults(handler=run_scale_down)
    status = actions.add_parser("status", help="print the pool's size and mode")
    _common(status)
    status.set_defaults(handler=run_status)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "--pool-state",
        help="local backend: the pool state file (default: cluster.pool_state_path or runs/<name>/pool.json)",
    )


def _pool(args: argparse.Namespace) -> tuple[Config, Any]:
    from batchpilot.cluster.nodepool import node_pool_for

    config = load_config(args.config)
    return config, node_pool_for(config, state_path=args.pool_state)


def run_resize(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    # Bad input is refused before any pool is touched (or, for GKE, any client is created).
    if args.nodes < 0 or args.nodes > config.cluster.max_nodes:
        raise BatchpilotError(
            "--nodes",
            f"{args.nodes} is outside 0..{config.cluster.max_nodes} (cluster.max_nodes)",
            "give a node count the config allows",
        )
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise BatchpilotError("--timeout-s", f"{args.timeout_s} is not positive", "give seconds > 0")
    _, pool = _pool(args)
    timeout_s = args.timeout_s if args.timeout_s is not None else config.cluster.ready_timeout_s
    before = pool.current_size()
    started = time.monotonic()
    pool.resize(args.nodes)
    print(f"resized: {before} -> {args.nodes} node(s)", flush=True)
    pool.wait_ready(args.nodes, timeout_s=timeout_s)
    print(f"ready: {args.nodes} node(s) after {time.monotonic() - started:.1f}s; {pool.describe()}")
    return 0


def run_scale_down(args: argparse.Namespace) -> int:
    config, pool = _pool(args)
    before = pool.current_size()
    pool.resize(config.cluster.idle_nodes)
    print(
        f"scaled down: {before} -> {config.cluster.idle_nodes} node(s) (cluster.idle_nodes); {pool.describe()}"
    )
    return 0


def run_status(args: argparse.Namespace) -> int:
    _, pool = _pool(args)
    print(pool.describe())
    return 0
