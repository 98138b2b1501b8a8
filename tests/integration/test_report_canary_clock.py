"""The canary records when it ran (canary.json's `started_at` and `finished_at`, unix seconds), so the run report's
wall time starts at the canary: a real 2-node x 1-process torchx local_cwd canary, as the local pipeline runs it
(slow: two torchrun agents start, 6-8 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchpilot.config import parse_config
from batchpilot.report.clock import run_clock
from batchpilot.workflow.canary import canary, read_canary
from helpers import tiny_config

pytestmark = pytest.mark.slow


def test_canary_json_records_when_the_canary_ran(tmp_path: Path, demo_data_uri: str) -> None:
    config = tiny_config(data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["cluster"]["pool_state_path"] = str(tmp_path / "pool.json")
    checked = parse_config(config)
    before = time.time()
    canary(checked, work_dir=tmp_path / "work")
    after = time.time()
    summary = read_canary(checked)
    assert summary is not None
    assert before < summary["started_at"] < summary["finished_at"] < after
    clock = run_clock(records=[], canary=summary, explore=None)
    assert clock.started_at == summary["started_at"] and clock.ended_at == summary["finished_at"]
