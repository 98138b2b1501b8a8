"""The XLA runtime's tests run in .venv-xla (scripts/setup_xla.sh: torch and torch_xla 2.9.0), on CPU:
`PJRT_DEVICE=CPU` with `CPU_NUM_DEVICES` virtual devices in one process standing in for every host of a
stage (multi-process XLA collectives do not work on CPU).

The main venv (torch 2.13, no torch_xla) does not collect them; scripts/test.sh runs them in .venv-xla,
where a missing torch_xla is an error, not a skip (`test_torch_xla_is_installed`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HAVE_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
IN_XLA_VENV = Path(sys.prefix).name == ".venv-xla"

if not HAVE_TORCH_XLA and not IN_XLA_VENV:
    collect_ignore_glob = ["test_*.py"]
