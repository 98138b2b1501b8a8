"""Issue #23: the adaptive ramp-up under fsdp at gradient accumulation 1, the layout the node walk gives
the large models' stages (configs/llama_5b.yaml: stage-0 at 128 on 8 nodes, accumulation 1). A Llama of
the same kind (GQA, SwiGLU, rotary, untied head), scaled down, on 2 processes: stage 0 at batch 4 = micro
2 x 2 ranks x 1 pass. Every step measures the noise scale from each rank's own gradient, read from
fsdp's reduce-scatter input (planning/noise.py: no step is split in halves, though
`measure_noise_every_steps` asks for them), and the rule decides stage 0's end at run time.

The rule runs with `confidence: 0` (the estimate itself against the threshold): with 2 samples against 4
the single-step estimates are so noisy that the lower bound at the default k=2 stays below the threshold
until the ramp's end (measured: estimate 5.8 +- 22.4 at sample 6,144). What k does is tested on
synthetic traces (tests/unit/test_adaptive_evidence.py); this test is about measuring at accumulation 1
under fsdp and deciding in the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.planning.noise import NoiseMeasurement, noise_measurement
from batchpilot.runstate import read_metrics
from helpers import run_batchpilot, write_plan

pytestmark = pytest.mark.slow

EVERY = 2


def llama_fsdp_config(data_uri: str, checkpoint_uri: str) -> dict:
    return {
        "name": "llama-fsdp-adaptive",
        "model": {
            "factory": "batchpilot.models.llama:build",
            "args": {
                "n_layer": 2,
                "n_head": 4,
                "n_kv_head": 2,
                "n_embd": 64,
                "max_seq_len": 64,
                "vocab_size": 257,
            },
        },
        "data": {"uri": data_uri, "seq_len": 64},
        "cluster": {"backend": "local", "devices_per_node": 2, "max_nodes": 2, "min_nodes": 1},
        "batch": {
            "global_batch_size": 16,
            "micro_batch_size": 2,
            "rampup": {
                "adaptive": {
                    "start": 4,
                    "samples": 6144,
                    "patience_samples": 128,
                    "smoothing": 0.9,
                    "max_growth": 2.0,
                    "max_stages": 4,
                    "confidence": 0.0,
                }
            },
        },
        "train": {
            "total_samples": 8192,
            "lr": 1.0e-3,
            "warmup_samples": 256,
            "parallelism": "fsdp",
            "measure_noise_every_steps": EVERY,
            "checkpoint_uri": checkpoint_uri,
            "eval_samples": 0,
            "seed": 0,
        },
        "explore": {"study": False},
    }


def test_fsdp_at_accumulation_1_measures_every_step_and_decides_a_stage(demo_data_uri, tmp_path):
    plan = write_plan(tmp_path, llama_fsdp_config(demo_data_uri, f"file://{tmp_path / 'ckpt'}"))
    stage0 = json.loads(Path(plan).read_text())["stages"][0]
    assert (stage0["global_batch_size"], stage0["world_size"], stage0["gradient_accumulation_steps"]) == (
        4,
        2,
        1,
    )
    assert (
        noise_measurement(
            strategy="fsdp", world_size=2, micro_batch_size=2, accumulation=1, split_every_steps=EVERY,
            shard_degree=2,
        )
        is NoiseMeasurement.LOCAL_GRADIENTS
    )  # fmt: skip
    out = tmp_path / "out"
    result = run_batchpilot("launch", "--plan", plan, "--stage", "0", "--output-dir", str(out), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stage-0 ends (adaptive ramp-up)" in result.stdout, result.stdout[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert {(r["world_size"], r["gradient_accumulation_steps"]) for r in records} == {(2, 1)}
    # Every step measured (each rank's 2 samples against the batch of 4), not only the EVERY-th that split
    # steps would measure.
    assert all(r["noise_g2"] is not None for r in records)
    decisions = json.loads((tmp_path / "ckpt" / "adaptive.json").read_text())["decisions"]
    assert len(decisions) == 1 and decisions[0]["stage"] == 0 and decisions[0]["next_batch"] > 4
    assert decisions[0]["reason"] == "noise_scale"
    assert decisions[0]["end_sample"] == records[-1]["consumed_samples"]
