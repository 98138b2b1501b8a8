"""`batchpilot canary-rank` (internal): one rank of the canary job, under torchrun.

The pipeline's canary task (`workflow.canary`) starts it on the first launch's nodes; it is not listed in
`batchpilot --help`, as users run the canary through the pipeline, not rank by rank.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "canary-rank",
        description="One rank of the canary: checks the planned devices, the process group, the data and "
        "the checkpoint URI, times an all-reduce; rank 0 writes canary.json. Exits 1 with one line on failure.",
    )
    parser.add_argument("--spec", required=True, help="the canary's spec (JSON) that the canary task wrote")
    parser.set_defaults(handler=run_canary_rank)


def run_canary_rank(args: argparse.Namespace) -> int:
    from batchpilot.train.canary import read_spec, run_canary

    return run_canary(read_spec(args.spec))
