"""Issue #38, in the spirit of Megatron-Bridge#2609 (warmup and decay mis-timed under a batch ramp-up): a
trainer that ramps its batch 16 -> 32 -> 64 steps at the LR a constant batch of 64 would have at the same
consumed sample, through the warmup, the stable phase and a warmup-stable-decay cooldown that starts inside
the ramp. The LR is a function of consumed samples, never of steps."""

from __future__ import annotations

import copy
import math

import pytest

from batchpilot.plan.rundoc import read_run_document
from batchpilot.runstate import read_metrics
from helpers import run_batchpilot, tiny_config, write_plan

pytestmark = pytest.mark.slow


def test_the_lr_at_each_consumed_sample_is_the_constant_batchs(demo_data_uri, tmp_path):
    # warmup 0..128, stable until 2048 - 0.5 x 1920 = 1088, then 1-sqrt to 0.1 x peak at 2048; the ramp's 64
    # starts at 960, so the cooldown starts in the final stage and the warmup spans the first.
    ramped = tiny_config(
        data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ramped/ckpt", train__lr_decay="wsd",
        train__wsd_decay_fraction=0.5, batch__schedule="0:16 320:32 1024:64",
    )  # fmt: skip
    constant = copy.deepcopy(ramped)
    del constant["batch"]["schedule"]  # 64 throughout
    plan = write_plan(tmp_path / "ramped", ramped)
    result = run_batchpilot("train", "--plan", plan, "--stage", "all", "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    reference = read_run_document(write_plan(tmp_path / "constant", constant)).plan.lr_schedule
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert {r["global_batch_size"] for r in records} == {16, 32, 64}
    starts = [r["consumed_samples"] - r["global_batch_size"] for r in records]
    assert starts[0] == 0 and starts[-1] == 2048 - 64
    for start, record in zip(starts, records, strict=True):
        expected = reference.at(consumed_samples=start, global_batch_size=64)
        assert math.isclose(record["lr"], expected, rel_tol=1e-9), (start, record["lr"], expected)
    # the phases are where the samples put them: warmup, the stable peak, the cooldown's first step
    by_start = dict(zip(starts, (r["lr"] for r in records), strict=True))
    assert by_start[0] < by_start[112] < 1e-3 == by_start[128] == by_start[1024]
    assert by_start[1088] == 1e-3 > by_start[1152] and math.isclose(
        by_start[2048 - 64], 1e-3 * (0.1 + 0.9 * (1 - (896 / 960) ** 0.5))
    )
