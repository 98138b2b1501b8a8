"""FSDP2 on 2 local processes (gloo): the same training as DDP, exact resume after kill -9 and SIGTERM
(with a loading host), out of memory.

Stage changes between node counts under FSDP (resharding) are in test_train_stages.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from batchpilot.exitcodes import EXIT_PREEMPTED
from batchpilot.runstate import read_metrics
from batchpilot.train.checkpoint import Checkpointer
from batchpilot.train.shape import model_shape
from helpers import (
    launch,
    processes_with,
    run_batchpilot,
    tiny_config,
    trainer_ranks,
    wait_for_checkpoint,
    wait_for_steps,
    write_plan,
)

pytestmark = pytest.mark.slow

STEPS = 48
MODEL_ARGS = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}  # tiny_config's


def two_rank_config(data_uri: str, root: Path, parallelism: str, **overrides) -> dict:
    """One stage of 48 steps at global batch 32 on 2 local nodes, micro batch 8 (accumulation 2, so the
    noise scale is measured under FSDP too), checkpointing every 4 steps."""
    return tiny_config(
        data_uri=data_uri,
        checkpoint_uri=f"file://{root}/ckpt",
        batch__global_batch_size=32,
        batch__micro_batch_size=8,
        batch__schedule=None,
        train__total_samples=32 * STEPS,
        train__checkpoint_every_steps=4,
        train__parallelism=parallelism,
        train__measure_coherence=True,
        cluster__device_peak_flops=1e12,  # gives MFU on CPU too
        **overrides,
    )


def train_final(plan: str, out: Path, **kwargs):
    return run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out), **kwargs)


def weights(root: Path) -> dict[str, torch.Tensor]:
    return Checkpointer(uri=f"file://{root}/ckpt").load().full_state()["model"]


@pytest.fixture(scope="module")
def runs(demo_data_uri, tmp_path_factory):
    """The uninterrupted runs under DDP and under FSDP."""
    roots = {}
    for parallelism in ("ddp", "fsdp"):
        root = tmp_path_factory.mktemp(parallelism)
        plan = write_plan(root, two_rank_config(demo_data_uri, root, parallelism))
        result = train_final(plan, root / "out")
        assert result.returncode == 0, result.stdout[-3000:]
        assert json.loads(Path(plan).read_text())["parallelism"] == parallelism
        roots[parallelism] = root
    return roots


def test_fsdp_trains_as_ddp_does(runs):
    ddp = read_metrics(runs["ddp"] / "out" / "metrics.jsonl")
    fsdp = read_metrics(runs["fsdp"] / "out" / "metrics.jsonl")
    assert len(ddp) == len(fsdp) == STEPS
    for a, b in zip(ddp, fsdp, strict=True):
        assert a["consumed_samples"] == b["consumed_samples"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), a["step"]
        assert b["lr"] == a["lr"]
    # FSDP measures the noise scale from each rank's own passes (see train/step.py): an estimate on
    # most steps (the moving average is undefined while its noise term is not positive), and coherence.
    assert sum(r["noise_scale"] is not None for r in fsdp) > STEPS // 2
    assert all(-1 <= r["gradient_coherence"] <= 1 for r in fsdp)
    assert fsdp[-1]["loss"] < fsdp[0]["loss"] - 0.5
    # MFU per device: the model's FLOPs per token (6N + attention) at the measured tokens/s, over 2 devices;
    # N as torchtitan counts it: the GPT's position embedding is a lookup, its tied token embedding the head.
    shape = model_shape(factory="batchpilot.models.gpt:build", args=MODEL_ARGS)
    multiplying = shape.num_params - MODEL_ARGS["block_size"] * MODEL_ARGS["n_embd"]
    per_token = 6 * multiplying + 12 * shape.num_layers * shape.hidden_size * 32
    for record in fsdp:
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * per_token / 2e12)
    expected, actual = weights(runs["ddp"]), weights(runs["fsdp"])
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.allclose(actual[name], expected[name], rtol=1e-3, atol=1e-5), name


def test_kill_9_under_fsdp_then_resume_is_identical(runs, demo_data_uri, tmp_path, fault_rng):
    plan = write_plan(tmp_path, two_rank_config(demo_data_uri, tmp_path, "fsdp"))
    out = tmp_path / "out"
    victim_step, victim_rank = fault_rng.randint(5, STEPS - 6), fault_rng.choice([0, 1])
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", victim_step, proc)
    wait_for_checkpoint(f"file://{tmp_path}/ckpt", proc)  # the resume below must have one to start from
    os.kill(trainer_ranks(str(out))[victim_rank], signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    assert Checkpointer(uri=f"file://{tmp_path}/ckpt").latest_step() < STEPS
    result = train_final(plan, out)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resumed from step" in result.stdout and "under fsdp" in result.stdout
    expected, actual = weights(runs["fsdp"]), weights(tmp_path)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    reference = read_metrics(runs["fsdp"] / "out" / "metrics.jsonl")
    metrics = read_metrics(out / "metrics.jsonl")
    fields = ("step", "consumed_samples", "loss", "lr", "grad_norm", "noise_scale")
    assert [[r[f] for f in fields] for r in metrics] == [[r[f] for f in fields] for r in reference]


def test_out_of_memory_under_fsdp_ends_the_job_and_the_retry_trains_with_half(runs, demo_data_uri, tmp_path):
    """Inside FSDP's collectives the ranks cannot agree on an OOM: the job ends, recording the halved size,
    and the next attempt (a pipeline retry) resumes from the last checkpoint with it."""
    plan = write_plan(tmp_path, two_rank_config(demo_data_uri, tmp_path, "fsdp"))
    env = {**os.environ, "BATCHPILOT_INJECT_OOM_ABOVE_MICRO_BATCH": "4"}  # rank 0 only "has memory" for 4
    first = train_final(plan, tmp_path / "out", env=env)
    assert first.returncode != 0
    assert "ran out of memory at micro_batch_size=8 in final under fsdp" in first.stdout + first.stderr
    recorded = json.loads((tmp_path / "ckpt" / "micro_batch.json").read_text())
    assert recorded == {"stages": {"0": 4}}
    second = train_final(plan, tmp_path / "out", env=env)
    assert second.returncode == 0, second.stdout[-3000:]
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert {(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in metrics} == {(4, 4)}
    reference = read_metrics(runs["fsdp"] / "out" / "metrics.jsonl")
    for a, b in zip(metrics, reference, strict=True):  # the same global batches, split finer
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_sigterm_under_fsdp_with_a_loading_host_resumes_exactly(runs, demo_data_uri, tmp_path, fault_rng):
    """Preemption under FSDP while one loading host reads for both nodes (data.expansion_factor_real_data
    2): the ranks agree between passes, every rank writes its shards, and the resumed run ends with the
    same parameters as the uninterrupted one (which read on both hosts: the data order is the same)."""
    config = two_rank_config(demo_data_uri, tmp_path, "fsdp", data__expansion_factor_real_data=2.0)
    plan = write_plan(tmp_path, config)
    out = tmp_path / "out"
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", fault_rng.randint(5, STEPS - 10), proc)
    agents = [
        pid for pid, argv, _ in processes_with(str(out)) if any(a.endswith("torchrun") for a in argv[:2])
    ]
    for pid in agents:
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    checkpoint = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert checkpoint.meta["parallelism"] == "fsdp" and checkpoint.step < STEPS
    result = train_final(plan, out)
    assert result.returncode == 0, result.stdout[-3000:]
    expected, actual = weights(runs["fsdp"]), weights(tmp_path)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_fsdp_checkpoints_on_gcs_stop_and_resume_exactly(
    runs, demo_data_uri, tmp_path, gcs_bucket, fault_rng
):
    """Sharded checkpoints of 2 FSDP ranks on gs:// (fake-gcs-server through the real client; the ranks
    inherit STORAGE_EMULATOR_HOST): each rank writes its own shard objects, a SIGTERM mid-run stops on a
    checkpoint in the bucket, and the resumed run reads it back to the same parameters as the run on
    local files."""
    uri = f"gs://{gcs_bucket}/ckpt"
    config = two_rank_config(demo_data_uri, tmp_path, "fsdp")
    config["train"]["checkpoint_uri"] = uri
    plan = write_plan(tmp_path, config)
    out = tmp_path / "out"
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", fault_rng.randint(5, STEPS - 10), proc)
    for pid, argv, _ in processes_with(str(out)):
        if any(a.endswith("torchrun") for a in argv[:2]):
            os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = Checkpointer(uri=uri).load()
    assert stopped.meta["parallelism"] == "fsdp" and stopped.step < STEPS
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng.pt"} <= set(stopped.meta["files"])
    result = train_final(plan, out)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {stopped.step}" in result.stdout
    expected, actual = weights(runs["fsdp"]), Checkpointer(uri=uri).load().full_state()["model"]
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
