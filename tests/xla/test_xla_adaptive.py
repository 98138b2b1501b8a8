"""The adaptive ramp-up on XLA (issue #23): stage 0 at batch 4 = micro 2 x 2 devices x 1 pass; every step
runs as two halves per device to measure the noise scale (planning/noise.py), the rule ends stage 0 at
run time with the shared loop's decision path (train/loop.py), and the next stage's batch is recorded.
`confidence: 0` as in tests/integration/test_adaptive_fsdp.py (2 samples against 4: too noisy for k=2
on a run this short)."""

from __future__ import annotations

import json
from pathlib import Path

from xla_helpers import metrics, run_xla, write_plan, xla_config


def test_an_adaptive_stage_measures_at_accumulation_1_and_ends_on_the_rule(demo_data_uri, tmp_path):
    config = xla_config(demo_data_uri, tmp_path)
    config["batch"] = {
        "global_batch_size": 16,
        "micro_batch_size": 2,
        "rampup": {
            "adaptive": {
                "start": 4, "samples": 4096, "patience_samples": 128, "smoothing": 0.9, "max_growth": 2.0,
                "max_stages": 4, "confidence": 0.0,
            }
        },
    }  # fmt: skip
    config["train"].update(total_samples=6144, measure_noise_every_steps=1, eval_samples=0, seed=0)
    plan = write_plan(tmp_path, config)
    stage0 = json.loads(Path(plan).read_text())["stages"][0]
    assert (stage0["global_batch_size"], stage0["world_size"], stage0["gradient_accumulation_steps"]) == (
        4,
        2,
        1,
    )
    log = run_xla(plan, "0", tmp_path / "out", num_devices=2)
    assert "stage-0 ends (adaptive ramp-up)" in log, log[-3000:]
    records = metrics(tmp_path / "out")
    assert all(r["noise_g2"] is not None for r in records)
    decisions = json.loads((tmp_path / "ckpt" / "adaptive.json").read_text())["decisions"]
    assert len(decisions) == 1 and decisions[0]["next_batch"] > 4
    assert (
        decisions[0]["reason"] == "noise_scale"
        and decisions[0]["end_sample"] == records[-1]["consumed_samples"]
    )
