"""Every torch_xla module and name the XLA runtime imports (inside its functions) exists in the
torch/torch_xla pair of the `tpu` extra: the counterpart, for the TPU image, of
tests/integration/test_image_extras.py (which leaves torch_xla to this test)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "batchpilot"


def torch_xla_imports() -> set[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update((alias.name, None) for alias in node.names if alias.name.startswith("torch_xla"))
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("torch_xla")
            ):
                found.update((node.module, alias.name) for alias in node.names)
    return found


def test_every_torch_xla_import_of_the_runtime_resolves():
    imports = torch_xla_imports()
    assert len(imports) >= 5, imports
    missing = []
    for module, name in sorted(imports, key=str):
        loaded = importlib.import_module(module)
        if name is not None and not hasattr(loaded, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert missing == []
