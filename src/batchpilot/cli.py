"""The `batchpilot` command. Each subcommand lives in `batchpilot.commands.<name>` with a `register`.

User errors (`BatchpilotError`) print one line per problem to stderr and exit 2, with no traceback.
Library progress arrives through `logging` (see `batchpilot.logs`); the CLI shows it on stdout.
Options share one vocabulary (`batchpilot.commands.options`, docs/cli.md). When the reader of stdout goes
away (`batchpilot config schema | head`), the command stops quietly with 141, as a Unix tool killed by
SIGPIPE does.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from batchpilot import __version__
from batchpilot.commands.options import Parser
from batchpilot.errors import BatchpilotError
from batchpilot.logs import configure_console

# Subcommand modules, in the order `batchpilot --help` lists them. Each defines
# `register(subparsers) -> None` and sets `handler` on its parser (a function taking the parsed args).
COMMAND_MODULES = (
    "batchpilot.commands.plan",
    "batchpilot.commands.explore",
    "batchpilot.commands.config",
    "batchpilot.commands.train",
    "batchpilot.commands.trials",
    "batchpilot.commands.export",
    "batchpilot.commands.canary",
    "batchpilot.commands.run",
    "batchpilot.commands.compile",
    "batchpilot.commands.submit",
    "batchpilot.commands.data",
    "batchpilot.commands.pool",
    "batchpilot.commands.doctor",
    "batchpilot.commands.rehearse",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="batchpilot",
        description="The right batch size for language-model training on Kubernetes: explore the fastest "
        "micro batch, plan a staged ramp-up with node scheduling, and train it as one Kubeflow Pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"batchpilot {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the process exit code."""
    try:
        return _run(argv)
    except BrokenPipeError:
        # Whatever is still buffered for the closed pipe would fail again when Python flushes stdout at
        # exit: point stdout at /dev/null first.
        with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout without a file descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 128 + signal.SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_console()
    try:
        result = args.handler(args)
    except BatchpilotError as error:
        for line in str(error).splitlines():
            print(f"batchpilot: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("batchpilot: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
