"""`batchpilot explore` as a user runs it: real probe processes on the real demo shard set."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import yaml

from batchpilot.logs import PREFIX
from helpers import run_batchpilot, tiny_config

CONTRACT_PROBE_KEYS = {
    "micro_batch_size",
    "activation_checkpointing",
    "compile",
    "fits",
    "peak_memory_bytes",
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    "repeats",
    "error",
}
CONTRACT_RECOMMENDATION_KEYS = {
    "micro_batch_size",
    "activation_checkpointing",
    "compile",
    "estimated_speedup",
    "confidence",
    "samples_per_s",
    "tokens_per_s",
    "base_micro_batch_size",
    "reasoning",
    "plan_notes",
}


def explore_config(
    tmp_path: Path,
    data_uri: str,
    *,
    factory: str | None = None,
    sections: dict[str, object] | None = None,
    **explore,
) -> str:
    """The tiny config with an explore section; `sections` overrides other keys (`cluster__devices_per_node`)."""
    config = tiny_config(data_uri=data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt", **(sections or {}))
    config["batch"]["micro_batch_size"] = "explore"
    config["explore"] = {
        "max_probes": 5,
        "timed_steps": 2,
        "min_timed_s": 0.05,
        "accumulation_multipliers": [2, 4],
        "study_train_steps": 2,
        "study_measure_batches": 1,
        **explore,
    }
    if factory:
        config["model"] = {"factory": factory, "args": {}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def explore(config_path: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    return run_batchpilot(
        "explore", "--config", config_path, "--output-dir", str(tmp_path / "out"), *args, env=env, timeout=600
    )


@pytest.mark.slow
def test_explore_writes_the_contract_files_and_prints_interim_recommendations(tmp_path, demo_data_uri):
    result = explore(explore_config(tmp_path, demo_data_uri), tmp_path)
    assert result.returncode == 0, result.stderr
    interim = [
        line for line in result.stdout.splitlines() if line.startswith(f"{PREFIX}current recommendation: ")
    ]
    assert "estimated" in interim[0] and "/100" in interim[0]
    document = json.loads((tmp_path / "out" / "explore.json").read_text())
    # The search adapts to measured speeds: on a loaded machine it can converge before the fifth probe (CI saw
    # 4). Whatever the count, every probe prints the recommendation as it stands, and a short search says why.
    probes = len(document["probes"])
    assert len(interim) == probes and 3 <= probes <= 5
    assert document["stopped_because"] == ("max_probes" if probes == 5 else "converged")
    assert all(set(probe) >= CONTRACT_PROBE_KEYS for probe in document["probes"])
    assert [p["micro_batch_size"] for p in document["probes"][:3]] == [1, 2, 4]
    # Every probe after the base (micro batch 1) timed the base's passes beside its own.
    base, *others = document["probes"]
    assert base["pair_ratios"] == [] and base["relative_throughput"] is None
    for probe in (p for p in others if p["fits"]):
        assert len(probe["pair_ratios"]) == probe["repeats"] and probe["relative_throughput"] > 0
    recommendation = document["recommendation"]
    assert set(recommendation) >= CONTRACT_RECOMMENDATION_KEYS
    assert 0 <= recommendation["confidence"] <= 99
    fitting = {
        (p["micro_batch_size"], p["activation_checkpointing"]) for p in document["probes"] if p["fits"]
    }
    assert (recommendation["micro_batch_size"], recommendation["activation_checkpointing"]) in fitting
    noise = document["noise_scale"]
    assert [row["multiplier"] for row in noise["per_multiplier"]] == [2, 4]
    assert {"critical_batch_size", "recommended_global_batch_size", "lr_scaling", "reasoning"} <= set(noise)
    metrics = json.loads((tmp_path / "out" / "explore_metrics.json").read_text())
    assert metrics["recommended_micro_batch_size"] == recommendation["micro_batch_size"]
    assert metrics["num_probes"] == probes and all(isinstance(v, float) for v in metrics.values())
    page = (tmp_path / "out" / "explore.html").read_text()
    assert page.count("src='data:image/png;base64,") == 2 and "http" not in page.split("<body>")[1]
    assert "critical batch size" in result.stdout and "LR scaling" in result.stdout


@pytest.mark.slow
def test_the_plan_reads_the_exploration(tmp_path, demo_data_uri):
    config_path = explore_config(tmp_path, demo_data_uri, max_probes=2)
    assert explore(config_path, tmp_path, "--no-study").returncode == 0
    document = json.loads((tmp_path / "out" / "explore.json").read_text())
    assert document["noise_scale"] is None
    result = run_batchpilot(
        "plan", "--config", config_path, "--explore", str(tmp_path / "out" / "explore.json")
    )
    assert result.returncode == 0, result.stderr
    assert f"micro_batch_size {document['recommendation']['micro_batch_size']}" in result.stdout


def test_a_missing_dataset_is_one_line_before_any_probe(tmp_path):
    result = explore(explore_config(tmp_path, f"file://{tmp_path}/no-data"), tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"batchpilot: error: data.uri: file://{tmp_path}/no-data holds no shard set (no manifest.json), and "
        f"explore measures on real data (fix: run: batchpilot data prepare ... --out file://{tmp_path}/no-data "
        "(or --demo for the demo set))"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_impossible_budget_is_one_line(tmp_path, demo_data_uri):
    result = explore(explore_config(tmp_path, demo_data_uri), tmp_path, "--memory-budget-bytes", "20MiB")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "batchpilot: error: explore.memory_budget_bytes: no setting fits even micro_batch_size=1"
    )


BROKEN_MODELS = """
import torch
from torch import nn

from batchpilot.models.gpt import GPT, GPTConfig


def raises(**args):
    raise RuntimeError("weights file missing")


class Fragile(GPT):
    def forward(self, idx):
        if idx.shape[0] > 2:
            raise RuntimeError(f"cannot take a batch of {idx.shape[0]}")
        return super().forward(idx)


def fragile(**args):
    return Fragile(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=257))
"""


@pytest.fixture
def broken_models_env(tmp_path):
    (tmp_path / "broken_models.py").write_text(textwrap.dedent(BROKEN_MODELS))
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


@pytest.mark.slow
def test_a_broken_model_factory_is_one_line_not_a_hang(tmp_path, demo_data_uri, broken_models_env):
    config_path = explore_config(tmp_path, demo_data_uri, factory="broken_models:raises")
    result = explore(config_path, tmp_path, env=broken_models_env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "batchpilot: error: model.factory: broken_models:raises raised RuntimeError: weights file missing"
    ]


@pytest.mark.slow
def test_a_probe_that_crashes_does_not_fit_and_the_search_goes_on(tmp_path, demo_data_uri, broken_models_env):
    config_path = explore_config(
        tmp_path, demo_data_uri, factory="broken_models:fragile", activation_checkpointing=[False]
    )
    result = explore(config_path, tmp_path, "--no-study", env=broken_models_env)
    assert result.returncode == 0, result.stderr
    probes = json.loads((tmp_path / "out" / "explore.json").read_text())["probes"]
    # grow 1, 2, 4 (crashes), bisect to 3 (crashes); then at most a repeat of the best size
    assert [(p["micro_batch_size"], p["fits"]) for p in probes[:4]] == [
        (1, True),
        (2, True),
        (4, False),
        (3, False),
    ]
    assert all(p["micro_batch_size"] <= 2 for p in probes[4:])
    assert probes[2]["error"] == "RuntimeError: cannot take a batch of 4"
    assert "recommendation: micro_batch_size=" in result.stdout
