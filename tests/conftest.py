"""Session fixtures shared by the trainer, explore and pipeline tests (helpers live in helpers.py)."""

from __future__ import annotations

import logging

import pytest

from helpers import run_batchpilot


@pytest.fixture(autouse=True)
def _restore_batchpilot_logging():
    """`batchpilot.cli.main` configures the `batchpilot` logger for a console (handlers, no propagation);
    tests that call it in-process must not leave that behind for the next test's caplog."""
    logger = logging.getLogger("batchpilot")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def batchpilot_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """caplog for the batchpilot loggers, also after a CLI call configured the console (which stops their
    records from reaching the root logger)."""
    logger = logging.getLogger("batchpilot")
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "handlers", [])
    caplog.set_level(logging.INFO, logger="batchpilot")
    return caplog


@pytest.fixture(scope="session")
def demo_data_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real token shard set built by `batchpilot data prepare --demo` (the stdlib's own sources)."""
    folder = tmp_path_factory.mktemp("demo-data") / "shards"
    result = run_batchpilot("data", "prepare", "--demo", "--out", f"file://{folder}")
    assert result.returncode == 0, result.stderr
    return f"file://{folder}"
