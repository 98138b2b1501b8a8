"""Layers stay clean: every import of every module under src/batchpilot follows one table of rules.

A module's package is the first name after `batchpilot.` (`batchpilot.train.step` -> `train`); a top-level
module is its own package (`planner`, `workflow`, `files`, ...). Imports are read with `ast` at any depth,
so function-local imports (the lazy ones) and `TYPE_CHECKING` imports count too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "batchpilot"
ROOT = "batchpilot"
"""The package's own `__init__` (only `__version__`), a package of its own."""

EVERYONE = frozenset({ROOT, "threads", "ports"})
"""Standard library only (+ errors): any module may import these."""

ALLOWED: dict[str, frozenset[str]] = {
    ROOT: frozenset(),
    "errors": frozenset(),
    "files": frozenset({"errors"}),
    "logs": frozenset({"errors"}),
    "exitcodes": frozenset({"errors"}),
    "threads": frozenset({"errors"}),
    "credentials": frozenset(
        {"errors"}
    ),  # Google credentials, for storage (data) and the Container API (cluster)
    "ports": frozenset(),
    "images": frozenset({"errors"}),
    "planning": frozenset({"planning", "errors"}),
    "config": frozenset({"config", "planning", "errors"}),
    "models": frozenset({"models", "errors"}),
    # storage: file:// and gs:// behind one protocol; credentials for GCS.
    "storage": frozenset({"storage", "errors", "credentials"}),
    # runstate: what sits beside the checkpoints (layout, metrics, records), torch-free.
    "runstate": frozenset({"runstate", "storage", "planning", "errors", "files"}),
    "data": frozenset({"data", "storage", "planning", "errors", "files", "logs", "credentials"}),
    "train": frozenset(
        {
            "train",
            "data",
            "storage",
            "runstate",
            "models",
            "planning",
            "config",
            "errors",
            "exitcodes",
            "files",
            "logs",
        }
    ),
    "explore": frozenset(
        {
            "explore",
            "train",
            "data",
            "storage",
            "models",
            "planning",
            "plan",
            "config",
            "errors",
            "files",
            "logs",
            "htmlpage",
        }
    ),
    "cluster": frozenset(
        {"cluster", "runstate", "config", "planning", "errors", "exitcodes", "files", "logs", "credentials"}
    ),
    # plan: checked config -> run document. models: only its torch-free modules (hf, llama_config), for
    # train.init_from's config.json check; data and storage: a local shard set, a gs:// checkpoint folder.
    "plan": frozenset({"plan", "config", "planning", "errors", "files", "data", "storage", "models"}),
    # `batchpilot export`: a run's checkpoint (train) of its model (models) as a Hugging Face folder.
    "export": frozenset(
        {"export", "runstate", "data", "storage", "models", "train", "plan", "errors", "files", "logs"}
    ),
    "report": frozenset({"report", "htmlpage", "explore", "planning", "plan", "files", "logs", "errors"}),
    "htmlpage": frozenset(),  # the look of report.html and explore.html: standard library only
    # `batchpilot doctor`: reads the cluster, storage and KFP the way a run does, so it uses their code.
    "doctor": frozenset(
        {
            "doctor",
            "cluster",
            "data",
            "storage",
            "train",
            "kfp",
            "plan",
            "config",
            "planning",
            "errors",
            "credentials",
        }
    ),
}
"""Package -> the batchpilot packages it may import (besides EVERYONE)."""

FORBIDDEN: dict[str, frozenset[str]] = {
    # `batchpilot rehearse` drives a whole run on a cluster through KFP: it uses the cluster code, the
    # pipeline's compile and submit, and doctor's check lines, as a command does.
    "rehearse": frozenset({"commands", "cli"}),
    "workflow": frozenset({"kfp", "commands", "cli"}),
    "kfp": frozenset({"commands", "cli"}),
    "commands": frozenset(),
    "cli": frozenset(),
    "__main__": frozenset(),
}
"""The top layers: package -> the batchpilot packages it must not import (anything else goes)."""

IMPORTED_ONLY_BY: dict[str, frozenset[str]] = {
    # `python -m batchpilot` is the CLI's other entry point.
    "cli": frozenset({"cli", "commands", "__main__"}),
    "commands": frozenset({"cli", "commands"}),
    "kfp": frozenset({"kfp", "doctor", "rehearse", "commands", "cli"}),
    "workflow": frozenset({"workflow", "kfp", "commands", "cli"}),
    "doctor": frozenset({"doctor", "rehearse", "commands", "cli"}),
    "rehearse": frozenset({"rehearse", "commands", "cli"}),
}
"""Package -> the only packages that may import it (nothing below it does)."""

STANDARD_LIBRARY_ONLY = frozenset(
    {ROOT, "errors", "files", "logs", "exitcodes", "threads", "ports", "images", "planning", "htmlpage"}
)
"""Packages whose third-party imports must all be standard library."""

THIRD_PARTY_FORBIDDEN: dict[str, frozenset[str]] = {
    "report": frozenset({"torch"}),
}

EXCEPTIONS: dict[tuple[str, str], str] = {}
"""(module, imported batchpilot module) pairs allowed despite the table, each with its reason. An entry
that no longer matches an import fails the test, so the list only shrinks."""

HEAVY = ("torch", "kfp", "google.cloud", "kubernetes", "pydantic")


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, e.g. `batchpilot.train.trainer`."""
    name: str
    """The imported module, resolved: `from batchpilot import workflow` -> `batchpilot.workflow`."""
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """`batchpilot.train.step` -> `train`, `batchpilot.plan.planner` -> `plan`, `batchpilot` -> ROOT."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def is_module(name: str) -> bool:
    """Whether a dotted batchpilot name is a module or package under src (not an attribute)."""
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(), module=module_name(path), is_package=path.name == "__init__.py")


def imports_in(source: str, *, module: str, is_package: bool = False) -> list[Import]:
    """Every import statement of a module's `source`, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                name = submodule if base.startswith(ROOT) and is_module(submodule) else base
                found.append(Import(module, name, node.lineno))
    return found


def all_imports() -> list[Import]:
    return [found for path in sorted(SRC.rglob("*.py")) for found in imports_of(path)]


def violation(found: Import) -> str | None:
    """The rule `found` breaks, in words, or None."""
    source = package_of(found.module)
    top = found.name.split(".")[0]
    if top != ROOT:
        if source in STANDARD_LIBRARY_ONLY and top not in sys.stdlib_module_names and top != "__future__":
            return f"{source} imports the standard library only"
        if top in THIRD_PARTY_FORBIDDEN.get(source, ()):
            return f"{source} must not import {top}"
        return None
    target = package_of(found.name)
    if source != target and source not in IMPORTED_ONLY_BY.get(target, {source}):
        return f"only {sorted(IMPORTED_ONLY_BY[target])} may import {target}"
    if source in ALLOWED:
        if target not in ALLOWED[source] | EVERYONE:
            return f"{source} may import only {sorted(ALLOWED[source] | EVERYONE)}"
    elif source in FORBIDDEN:
        if target in FORBIDDEN[source]:
            return f"{source} must not import {sorted(FORBIDDEN[source])}"
    else:
        return f"no rule for package {source!r}: add it to ALLOWED or FORBIDDEN in {Path(__file__).name}"
    return None


def test_every_import_follows_the_layer_rules():
    imports = all_imports()
    broken = [
        f"{found.module} (line {found.line}) imports {found.name}: {rule}"
        for found in imports
        if (rule := violation(found)) is not None and (found.module, found.name) not in EXCEPTIONS
    ]
    assert not broken, "\n".join(broken)


def test_every_exception_is_still_needed():
    needed = {(found.module, found.name) for found in all_imports() if violation(found) is not None}
    stale = [f"{module} -> {name}" for module, name in EXCEPTIONS if (module, name) not in needed]
    assert not stale, f"remove these entries from EXCEPTIONS, they no longer apply: {stale}"


def test_the_rules_catch_what_they_should():
    # The table itself, on imports that would break it: each must name its rule.
    cases = {
        Import("batchpilot.train.trainer", "batchpilot.plan.planner", 1): "train may import only",
        Import("batchpilot.explore.runner", "batchpilot.cluster.launch", 1): "explore may import only",
        Import("batchpilot.cluster.launch", "batchpilot.train.checkpoint", 1): "cluster may import only",
        Import("batchpilot.planning.stages", "numpy", 1): "planning imports the standard library only",
        Import("batchpilot.report", "torch", 1): "report must not import torch",
        Import(
            "batchpilot.workflow.plan", "batchpilot.kfp.compile", 1
        ): "['cli', 'commands', 'doctor', 'kfp', 'rehearse']",
        Import("batchpilot.doctor", "batchpilot.commands.run", 1): "only ['cli', 'commands']",
        Import("batchpilot.doctor", "batchpilot.report", 1): "doctor may import only",
        Import(
            "batchpilot.plan.planner", "batchpilot.doctor", 1
        ): "only ['cli', 'commands', 'doctor', 'rehearse']",
        Import(
            "batchpilot.workflow.stage", "batchpilot.rehearse.steps", 1
        ): "only ['cli', 'commands', 'rehearse']",
        Import("batchpilot.rehearse.steps", "batchpilot.commands.run", 1): "only ['cli', 'commands']",
        Import("batchpilot.kfp.compile", "batchpilot.commands.run", 1): "only ['cli', 'commands']",
        Import("batchpilot.report", "batchpilot.workflow", 1): "only ['cli', 'commands', 'kfp', 'workflow']",
        Import(
            "batchpilot.workflow.stage", "batchpilot.kfp.shape", 1
        ): "only ['cli', 'commands', 'doctor', 'kfp', 'rehearse'] may import kfp",
        Import("batchpilot.newthing", "batchpilot.errors", 1): "no rule for package 'newthing'",
    }
    for found, rule in cases.items():
        assert rule in (violation(found) or ""), found
    assert violation(Import("batchpilot.train.checkpoint", "batchpilot.threads", 1)) is None
    assert violation(Import("batchpilot.kfp.pipeline", "batchpilot.workflow", 1)) is None


def test_imports_are_found_at_any_depth_and_resolved_to_modules():
    source = """
from typing import TYPE_CHECKING
from batchpilot import __version__, workflow
from . import checkpoint
from .parallel import wrap_model
if TYPE_CHECKING:
    from batchpilot.planning import Plan
def lazy():
    import torch.distributed
    from ..data import shards
"""
    names = sorted(found.name for found in imports_in(source, module="batchpilot.train.trainer"))
    assert names == sorted(
        [
            "typing",
            "batchpilot",
            "batchpilot.workflow",
            "batchpilot.train.checkpoint",
            "batchpilot.train.parallel",
            "batchpilot.planning",
            "torch.distributed",
            "batchpilot.data.shards",
        ]
    )
    package = imports_in("from . import parallel", module="batchpilot.train", is_package=True)
    assert [found.name for found in package] == ["batchpilot.train.parallel"]
    assert package_of("batchpilot") == ROOT and package_of("batchpilot.train.step") == "train"


def test_importing_planning_loads_no_heavy_module():
    assert_loads_none_of(HEAVY, "batchpilot.planning")


TORCH_FREE_MODELS = frozenset({"batchpilot.models.hf", "batchpilot.models.llama_config"})
"""The modules of `models` that the plan-time checks may import: no torch at import time."""


def test_the_checks_import_only_the_torch_free_model_modules():
    found = {
        imp.name
        for imp in all_imports()
        if package_of(imp.module) == "plan" and package_of(imp.name) == "models"
    }
    assert found and found <= TORCH_FREE_MODELS, found
    assert_loads_none_of(
        ("torch", "safetensors", "transformers"), *sorted(TORCH_FREE_MODELS), "batchpilot.plan.checks"
    )


def test_metrics_readers_and_the_report_load_no_torch():
    # Workflow code reads metrics and renders the report without torch installed in its image.
    assert_loads_none_of(("torch",), "batchpilot.runstate", "batchpilot.report")


def assert_loads_none_of(heavy: tuple[str, ...], *modules: str) -> None:
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {list(modules)!r}]; "
        f"print([m for m in {list(heavy)!r} if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The module cycles of an import graph (its strongly connected components of two or more modules),
    each sorted, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Importing module -> the batchpilot modules it imports (at any depth: function-level imports count)."""
    edges: dict[str, set[str]] = {}
    for found in imports:
        if found.name.startswith(ROOT) and is_module(found.name) and found.name != found.module:
            edges.setdefault(found.module, set()).add(found.name)
    return edges


def test_no_module_imports_itself_back_through_others():
    cycles = import_cycles(module_graph(all_imports()))
    assert cycles == [], "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_a_cycle_through_a_function_level_import_is_found():
    # The shape of the six cycles this check was written against (train.trainer <-> xla_loop was one).
    one = imports_in("from batchpilot.train import step\n", module="batchpilot.train.loop")
    back = imports_in("def later():\n    from batchpilot.train import loop\n", module="batchpilot.train.step")
    assert import_cycles(module_graph(one + back)) == [["batchpilot.train.loop", "batchpilot.train.step"]]
    assert import_cycles(module_graph(one)) == []


ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


def test_every_module_is_in_the_architecture_document():
    text = ARCHITECTURE.read_text()
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if path.name == "__init__.py":
            continue  # a package is named by its folder
        if f"`{relative}`" not in text:
            missing.append(relative)
    assert missing == [], f"docs/architecture.md does not name: {', '.join(missing)}"
