"""Session fixtures shared by the trainer, explore and pipeline tests (helpers live in helpers.py)."""

from __future__ import annotations

import pytest

from helpers import run_batchpilot


@pytest.fixture(scope="session")
def demo_data_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real token shard set built by `batchpilot data prepare --demo` (the stdlib's own sources)."""
    folder = tmp_path_factory.mktemp("demo-data") / "shards"
    result = run_batchpilot("data", "prepare", "--demo", "--out", f"file://{folder}")
    assert result.returncode == 0, result.stderr
    return f"file://{folder}"
