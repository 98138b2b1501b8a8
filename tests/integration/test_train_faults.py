"""Faults: kill -9 of a rank, SIGTERM (preemption) and out-of-memory, each resumed exactly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_FILE
from batchpilot.runstate import read_metrics
from batchpilot.train.checkpoint import DELAY_ENV, Checkpointer
from helpers import (
    launch,
    processes_with,
    run_batchpilot,
    tiny_config,
    trainer_ranks,
    wait_for_steps,
    write_plan,
)

pytestmark = pytest.mark.slow


def one_stage_config(data_uri: str, root: Path, **overrides) -> dict:
    """One stage (no ramp-up) of 128 steps at global batch 32 on 2 local nodes, checkpointing every 4 steps.

    Long enough that a fault injected after step ~100 still lands before the end of training.
    """
    return tiny_config(
        data_uri=data_uri,
        checkpoint_uri=f"file://{root}/ckpt",
        batch__global_batch_size=32,
        batch__schedule=None,
        train__total_samples=4096,
        train__checkpoint_every_steps=4,
        **overrides,
    )


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return Checkpointer(uri=f"file://{root}/ckpt").load().full_state()["model"]


@pytest.fixture(scope="module")
def reference(demo_data_uri, tmp_path_factory):
    """The uninterrupted run, to compare every interrupted one with."""
    root = tmp_path_factory.mktemp("reference")
    plan = write_plan(root, one_stage_config(demo_data_uri, root))
    result = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(root / "out"))
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def assert_identical_to(reference: Path, root: Path) -> None:
    expected, actual = final_weights(reference), final_weights(root)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    ref_metrics = read_metrics(reference / "out" / "metrics.jsonl")
    metrics = read_metrics(root / "out" / "metrics.jsonl")
    fields = ("step", "consumed_samples", "loss", "lr", "grad_norm")
    assert [[r[f] for f in fields] for r in metrics] == [[r[f] for f in fields] for r in ref_metrics]
    # The noise scale sums squared norms per DDP bucket, and DDP regroups its buckets after its first
    # iteration, so a resumed run agrees to rounding (float64), not bit for bit.
    for resumed, uninterrupted in zip(metrics, ref_metrics, strict=True):
        assert resumed["noise_scale"] == pytest.approx(uninterrupted["noise_scale"], rel=1e-9)


def test_kill_9_of_a_rank_then_resume_is_identical(reference, demo_data_uri, tmp_path, fault_rng):
    plan = write_plan(tmp_path, one_stage_config(demo_data_uri, tmp_path))
    out = tmp_path / "out"
    # From step 10 on, the step-8 save has started, and a save starts only once the one before it (step 4)
    # is committed: the kill always leaves a checkpoint to resume from.
    victim_step, victim_rank = fault_rng.randint(10, 100), fault_rng.choice([0, 1])
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", victim_step, proc)
    os.kill(trainer_ranks(str(out))[victim_rank], signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    latest = Checkpointer(uri=f"file://{tmp_path}/ckpt").latest_step()
    # a checkpoint every 4 steps, and the kill came before the end
    assert latest is not None and 4 <= latest < 128 and latest % 4 == 0, latest
    result = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {latest}" in result.stdout
    assert_identical_to(reference, tmp_path)


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(reference, demo_data_uri, tmp_path):
    """Preemption: the torchrun agents get SIGTERM (as PID 1 of a pod would) and forward it to the ranks."""
    plan = write_plan(tmp_path, one_stage_config(demo_data_uri, tmp_path))
    out = tmp_path / "out"
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", 10, proc)
    agents = [
        pid for pid, argv, _ in processes_with(str(out)) if any(a.endswith("torchrun") for a in argv[:2])
    ]
    assert agents
    for pid in agents:
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output
    assert "SIGTERM: stopping at the end of a step" in output
    checkpointed = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    # A pod's command turns this marker into exit 75 for the Job's podFailurePolicy (torchrun exits 1).
    assert (out / PREEMPTED_FILE).read_text() == f"{checkpointed.consumed_samples}\n"
    assert checkpointed.consumed_samples == checkpointed.step * 32  # a step boundary
    assert len(read_metrics(out / "metrics.jsonl")) >= checkpointed.step
    result = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {checkpointed.step}" in result.stdout
    # each save says where its process started: the rehearsal tells a restart's saves from its predecessor's
    final = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert checkpointed.meta["resumed_from_step"] is None
    assert final is not None and final.meta["resumed_from_step"] == checkpointed.step
    assert_identical_to(reference, tmp_path)


def test_checkpoints_are_also_written_by_time(demo_data_uri, tmp_path):
    """`train.checkpoint_every_s`: rank 0's clock decides between steps, every rank saves together.

    The interval is far below one step's time (two processes and an all-reduce take more than 1 ms), so
    time checkpoints come between steps on any machine; a 0.5 s interval was longer than the whole stage
    on a fast one."""
    config = tiny_config(
        data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt", batch__global_batch_size=32,
        batch__schedule=None, train__total_samples=1024, train__checkpoint_every_s=0.001,
    )  # fmt: skip
    plan = write_plan(tmp_path, config)
    result = run_batchpilot(
        "launch", "--plan", plan, "--stage", "final", "--output-dir", str(tmp_path / "out")
    )
    assert result.returncode == 0, result.stdout[-3000:]
    by_time = [
        line
        for line in result.stdout.splitlines()
        if "0.001 s since the last: train.checkpoint_every_s" in line
    ]
    assert by_time, result.stdout[-3000:]
    assert all("checkpoint step 32 " not in line for line in by_time)  # before the stage's end (step 32)


def test_out_of_memory_halves_the_micro_batch_on_every_rank(reference, demo_data_uri, tmp_path):
    plan = write_plan(tmp_path, one_stage_config(demo_data_uri, tmp_path))
    env = {**os.environ, "BATCHPILOT_INJECT_OOM_ABOVE_MICRO_BATCH": "4"}  # rank 0 only "has memory" for 4
    result = run_batchpilot(
        "launch", "--plan", plan, "--stage", "final", "--output-dir", str(tmp_path / "out"),
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "out of memory at micro_batch_size=16 (agreed by all ranks)" in result.stdout
    assert (
        "retrying the same global batch 32 with micro_batch_size=8, gradient_accumulation_steps=2"
        in result.stdout
    )
    assert "micro_batch_size=4, gradient_accumulation_steps=4" in result.stdout
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert {(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in metrics} == {(4, 4)}
    # Kept beside the checkpoints: a retry or a resume of this stage starts at 4 (test_train_fsdp.py).
    assert json.loads((tmp_path / "ckpt" / "micro_batch.json").read_text()) == {"stages": {"0": 4}}
    ref = read_metrics(reference / "out" / "metrics.jsonl")
    for a, b in zip(metrics, ref, strict=True):  # the same global batches: the same training, up to rounding
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_the_last_checkpoint_is_committed_before_the_job_ends(demo_data_uri, tmp_path):
    """Every background save waits 2 s before it writes (an upload slower than the 4 steps between
    checkpoints), so saves overlap training and the next save waits for the one in flight. Breaks when
    the job ends without waiting for its last checkpoint: `latest` would name an earlier step."""
    config = tiny_config(
        data_uri=demo_data_uri, checkpoint_uri=f"file://{tmp_path}/ckpt", batch__global_batch_size=32,
        batch__schedule=None, train__total_samples=512, train__checkpoint_every_steps=4,
    )  # fmt: skip
    plan = write_plan(tmp_path, config)
    env = {**os.environ, DELAY_ENV: "2"}
    result = run_batchpilot(
        "launch", "--plan", plan, "--stage", "final", "--output-dir", str(tmp_path / "out"), env=env
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert Checkpointer(uri=f"file://{tmp_path}/ckpt").latest_step() == 16
    committed = [line for line in result.stdout.splitlines() if "committed (" in line]
    assert [line.split("checkpoint step ")[1].split()[0] for line in committed] == ["4", "8", "12", "16"]
    # only the launch's last save (step 16) is one no step competes with: the others keep the writer process
    lasts = [line for line in result.stdout.splitlines() if "(the launch's last: " in line]
    assert len(lasts) == 1 and "checkpoint step 16 " in lasts[0]
    # it saves before its end: each rank's writer process starts at the start-up, before the first step
    output = result.stdout
    assert output.count("the checkpoint writer process starts now") == 2
    assert output.index("the checkpoint writer process starts now") < output.index("step 1 ")


def test_sigterm_while_a_checkpoint_is_in_flight_commits_it_then_the_stop_step(
    reference, demo_data_uri, tmp_path
):
    """Preemption while the checkpoint of step 8 is still being written (each background save waits 3 s
    first): the stop waits for it, then writes and commits the checkpoint of the step it stopped at, and
    the run resumes exactly. Breaks when the preemption checkpoint is not waited for (the job would end
    with `latest` on step 8 or earlier)."""
    plan = write_plan(tmp_path, one_stage_config(demo_data_uri, tmp_path))
    out = tmp_path / "out"
    proc = launch(plan, out, env={**os.environ, DELAY_ENV: "3"})
    wait_for_steps(out / "metrics.jsonl", 9, proc)
    for pid, argv, _ in processes_with(str(out)):
        if any(a.endswith("torchrun") for a in argv[:2]):
            os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert (out / PREEMPTED_FILE).read_text() == f"{stopped.consumed_samples}\n"
    assert stopped.step > 8 and f"checkpoint step {stopped.step} committed" in output
    result = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {stopped.step}" in result.stdout
    assert_identical_to(reference, tmp_path)
