"""Compile the batchpilot pipeline: `python pipelines/compile.py [--config FILE --out FILE [--force]] [--image IMAGE]`.

A thin entry point over `batchpilot compile` (the pipeline lives in the package, `batchpilot.kfp`).
Without --config it recompiles every example config into pipelines/compiled/ (checked in; a test fails
when they drift from the source), replacing the files there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from batchpilot.cli import main as batchpilot_main
from batchpilot.kfp.compile import EXAMPLE_CONFIGS, EXAMPLES

COMPILED = Path(__file__).resolve().parent / "compiled"


def main(argv: list[str]) -> int:
    if (
        "--config" in argv
        or any(arg.startswith("--config=") for arg in argv)
        or "-h" in argv
        or "--help" in argv
    ):
        return batchpilot_main(["compile", *argv])
    for name in EXAMPLES:
        code = batchpilot_main(
            [
                "compile",
                "--config",
                str(EXAMPLE_CONFIGS / name),
                "--out",
                str(COMPILED / name),
                "--force",
                *argv,
            ]
        )
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
