"""The image's extras hold every package batchpilot imports: a fresh venv with exactly the Dockerfile's extras
imports every batchpilot module and every module those import, lazily inside functions included (the KFP
components and the workflow functions they call import most of what they need that way).

The venv is built from scratch each run (no pip cache, no system site-packages), so nothing left over from
an earlier run can hide a missing package.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "src" / "batchpilot"
COMPONENTS = PACKAGE / "kfp" / "components.py"
# Extras the default image leaves out, with the one module each package may be imported from.
OPTIONAL_EXTRAS = {
    "transformers": "src/batchpilot/models/hf.py",  # hf: train.init_from, export
    "safetensors": "src/batchpilot/models/hf.py",
    "pyarrow": "src/batchpilot/data/corpora.py",  # corpora: data prepare on a developer's machine
    "zstandard": "src/batchpilot/data/corpora.py",
}
TORCH = "torch==2.13.0"  # the CPU build, from a local file here; the image's default TORCH_REQUIREMENT


def dockerfile_extras() -> str:
    """The image's default extras: the `ARG EXTRAS=...` that its `pip install ... "${wheel}[${EXTRAS}]"` line
    installs."""
    dockerfile = (REPO / "Dockerfile").read_text()
    assert '"${wheel}[${EXTRAS}]"' in dockerfile
    (extras,) = re.findall(r"^ARG EXTRAS=([a-z,]+)$", dockerfile, flags=re.MULTILINE)
    return extras


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> set[tuple[str, tuple[str, ...]]]:
    """(module, names imported from it) for every absolute import in `path`, at any depth (function bodies
    too), and every `importlib.import_module("literal")`; `if TYPE_CHECKING:` blocks are left out."""
    found: set[tuple[str, tuple[str, ...]]] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module, tuple(alias.name for alias in node.names if alias.name != "*")))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add((node.args[0].value, ()))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def component_imports() -> set[str]:
    """Modules the KFP component functions import in their bodies (what runs in a pipeline task pod)."""
    tree = ast.parse(COMPONENTS.read_text())
    modules: set[str] = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module)
                    modules.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    modules.update(alias.name for alias in node.names)
    return modules


# Runs inside the fresh venv: imports every batchpilot module, then every (module, names) import found in
# the source, and prints the failures as JSON.
CHECK = """
import importlib, json, pkgutil, sys, traceback
import batchpilot
wanted = json.load(open(sys.argv[1]))
failures, tried = [], set()
def attempt(module, origin):
    if (module, origin) in tried:
        return sys.modules.get(module)
    tried.add((module, origin))
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        failures.append({"module": module, "missing": error.name, "imported_by": origin})
    except Exception as error:
        failures.append({"module": module, "error": repr(error), "imported_by": origin})
assert batchpilot.__file__.startswith(sys.prefix), batchpilot.__file__  # the installed copy, not src/
for info in pkgutil.walk_packages(batchpilot.__path__, "batchpilot."):
    if not info.name.endswith(".__main__"):  # runs the CLI when imported
        attempt(info.name, "batchpilot")
for module, names, origin in wanted:
    loaded = attempt(module, origin)
    for name in names:
        if loaded is not None and not hasattr(loaded, name):
            attempt(f"{module}.{name}", origin)
print(json.dumps(failures))
"""


def run(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(arg) for arg in args], cwd=cwd, capture_output=True, text=True, check=False, timeout=600
    )


@pytest.mark.slow
def test_a_venv_with_the_image_extras_imports_everything_batchpilot_imports(tmp_path):
    extras = dockerfile_extras()
    found = [
        (module, names, str(path.relative_to(REPO)))
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, names in imports_of(path)
        if module.split(".")[0] != "batchpilot"
    ]
    # torch_xla is the TPU image's (TORCH_FLAVOR=tpu, the `tpu` extra), imported only inside the XLA
    # runtime's functions; tests/xla/test_xla_imports.py imports these in .venv-xla.
    xla = {origin for module, _, origin in found if module.split(".")[0] == "torch_xla"}
    assert xla and all(Path(origin).name.startswith("xla") for origin in xla), xla
    # The `hf` and `corpora` extras, which the default image leaves out (the Dockerfile's EXTRAS adds them):
    # each package only from its one module, which names the extra when the package is missing.
    optional = {
        (module.split(".")[0], origin)
        for module, _, origin in found
        if module.split(".")[0] in OPTIONAL_EXTRAS
    }
    assert optional <= set(OPTIONAL_EXTRAS.items()), optional
    wanted = sorted(item for item in found if item[0].split(".")[0] not in {"torch_xla", *OPTIONAL_EXTRAS})
    assert {"matplotlib", "kfp", "torchx.components.dist"} <= {module for module, _, _ in wanted}
    assert {"batchpilot.workflow.stage", "batchpilot.logs"} <= component_imports()

    # The build context the Dockerfile sees (.dockerignore), copied so that building the wheel writes
    # nothing into the working tree.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))

    venv = tmp_path / "venv"
    created = run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    pip = (python, "-m", "pip", "install", "--no-cache-dir", "--quiet")
    torch = run(*pip, TORCH, cwd=tmp_path)
    assert torch.returncode == 0, torch.stderr
    project = run(*pip, "-c", REPO / "constraints.txt", f"{source}[{extras}]", cwd=tmp_path)
    assert project.returncode == 0, project.stderr

    (tmp_path / "wanted.json").write_text(json.dumps(wanted))
    checked = run(python, "-c", CHECK, tmp_path / "wanted.json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    failures = json.loads(checked.stdout.strip().splitlines()[-1])
    assert failures == [], f"the image extras [{extras}] miss: {json.dumps(failures, indent=1)}"
