"""Layers stay clean: planning/ imports no torch, kfp or cloud client; components hold no logic."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "batchpilot"
FORBIDDEN_IN_PLANNING = ("torch", "kfp", "google", "kubernetes", "torchx", "numpy", "pydantic", "yaml")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_planning_imports_only_the_standard_library_and_itself():
    for path in sorted((SRC / "planning").glob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN_IN_PLANNING, f"{path.name} imports {name}"
            if top == "batchpilot":
                assert name.startswith(("batchpilot.planning", "batchpilot.errors")), (
                    f"{path.name} imports {name}"
                )


def test_importing_planning_loads_no_heavy_module():
    code = (
        "import sys, batchpilot.planning; "
        "heavy = [m for m in ('torch', 'kfp', 'google.cloud', 'kubernetes', 'pydantic') if m in sys.modules]; "
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
