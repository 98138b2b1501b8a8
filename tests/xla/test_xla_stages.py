"""A change of device count between stages on XLA (stage 0 on 1 node of 2 devices, the next on 2 nodes:
4 devices) reshards the checkpoint; every sample is trained exactly once; and checkpoints move between
the XLA and the eager trainer in both directions."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from xla_helpers import (
    errors,
    metrics,
    plan_stages,
    run_eager,
    run_xla,
    train_args,
    write_plan,
    xla_config,
    xla_env,
)

from batchpilot.train.checkpoint import Checkpointer

TOTAL_SAMPLES = 192


def two_stage_config(data_uri: str, root: Path, *, runtime: str) -> dict:
    """Stage 0: global batch 8 = micro 4 x 2 devices (1 node); final: 16 = 4 x 4 devices (2 nodes)."""
    return xla_config(
        data_uri,
        root,
        runtime=runtime,
        batch__global_batch_size=16,
        batch__micro_batch_size=4,
        batch__schedule="0:8 64:16",
        train__total_samples=TOTAL_SAMPLES,
        train__warmup_samples=32,
    )


def audited_positions(out: Path, *, num_devices: int) -> dict[int, list[int]]:
    """Position -> how many times a device trained it, from the audit files (one per logical rank)."""
    counts: dict[int, list[int]] = {}
    for device in range(num_devices):
        path = out / "audit" / f"positions-rank{device}.txt"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            _stage, world, *positions = (int(x) for x in line.split())
            for position in positions:
                counts.setdefault(position, []).append(world)
    return counts


@pytest.fixture(scope="module")
def staged(demo_data_uri, tmp_path_factory):
    """Stage 0 on 2 XLA devices, a copy of its checkpoints, then the final stage on 4 XLA devices."""
    root = tmp_path_factory.mktemp("xla-stages")
    plan = write_plan(root, two_stage_config(demo_data_uri, root, runtime="xla"))
    assert plan_stages(plan) == [(1, 0, 64), (2, 64, TOTAL_SAMPLES)]
    run_xla(plan, "0", root / "out", num_devices=2, extra=("--audit",))
    shutil.copytree(root / "ckpt", root / "ckpt-after-stage-0")
    log = run_xla(plan, "final", root / "out", num_devices=4, extra=("--audit",))
    assert "resumed from step 8 (64 samples)" in log and "saved by 2 device(s)" in log
    return root


def test_stage_change_reshards_and_trains_every_sample_once(staged):
    records = metrics(staged / "out")
    assert [r["consumed_samples"] for r in records] == list(range(8, 65, 8)) + list(
        range(80, TOTAL_SAMPLES + 1, 16)
    )
    assert [r["world_size"] for r in records] == [2] * 8 + [4] * 8
    assert {r["runtime"] for r in records} == {"xla"}
    counts = audited_positions(staged / "out", num_devices=4)
    assert sorted(counts) == list(range(TOTAL_SAMPLES))
    assert all(len(worlds) == 1 for worlds in counts.values())
    assert [counts[p][0] for p in (0, 63, 64, TOTAL_SAMPLES - 1)] == [2, 2, 4, 4]
    # The loss goes on from where stage 0 left it (no restart from a fresh model), and falls.
    losses = [r["loss"] for r in records]
    assert abs(losses[8] - losses[7]) < 0.3
    assert losses[-1] < losses[0] - 0.2
    assert records[7]["val_loss"] is not None and records[-1]["val_loss"] < records[7]["val_loss"]
    final = Checkpointer(uri=f"file://{staged}/ckpt").load()
    assert (final.consumed_samples, final.meta["world_size"], final.meta["runtime"]) == (
        TOTAL_SAMPLES,
        4,
        "xla",
    )


def test_the_eager_trainer_resumes_an_xla_checkpoint_and_back(staged, demo_data_uri, tmp_path):
    """Eager (4 processes, fsdp) resumes the 2-device XLA checkpoint of stage 0; XLA (4 devices) resumes
    an eager checkpoint of stage 0 (2 processes): both train the final stage as XLA did from its own."""
    xla_final = metrics(staged / "out")[8:]
    eager_root, xla_root = tmp_path / "eager", tmp_path / "xla"
    eager_plan = write_plan(eager_root, two_stage_config(demo_data_uri, eager_root, runtime="eager"))
    shutil.copytree(staged / "ckpt-after-stage-0", eager_root / "ckpt")
    (eager_root / "out").mkdir()
    shutil.copy(staged / "out" / "metrics.jsonl", eager_root / "out" / "metrics.jsonl")
    run_eager(eager_plan, "final", eager_root / "out", num_ranks=4)
    from_xla = metrics(eager_root / "out")[8:]

    # An eager stage 0, then XLA's final stage from its checkpoint.
    eager_s0 = tmp_path / "eager-s0"
    run_eager(
        write_plan(eager_s0, two_stage_config(demo_data_uri, eager_s0, runtime="eager")),
        "0",
        eager_s0 / "out",
        num_ranks=2,
    )
    xla_plan = write_plan(xla_root, two_stage_config(demo_data_uri, xla_root, runtime="xla"))
    shutil.copytree(eager_s0 / "ckpt", xla_root / "ckpt")
    log = run_xla(xla_plan, "final", xla_root / "out", num_devices=4)
    assert "runtime eager" in log
    from_eager = metrics(xla_root / "out")[8:]

    for ours, eager, xla in zip(xla_final, from_xla, from_eager, strict=True):
        assert eager["consumed_samples"] == xla["consumed_samples"] == ours["consumed_samples"]
        assert eager["loss"] == pytest.approx(ours["loss"], rel=1e-4)
        assert xla["loss"] == pytest.approx(ours["loss"], rel=1e-4)
        assert eager["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-2)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(staged, demo_data_uri, tmp_path):
    """The final stage of a config whose model is wider than the one that wrote stage 0's checkpoint."""
    config = two_stage_config(demo_data_uri, tmp_path, runtime="xla")
    config["model"]["args"]["n_embd"] = 64
    plan = write_plan(tmp_path, config)
    shutil.copytree(staged / "ckpt-after-stage-0", tmp_path / "ckpt")
    result = subprocess.run(
        train_args(plan, "final", tmp_path / "out"),
        env=xla_env(4),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, errors(result.stderr)
    assert "Traceback" not in result.stderr
    # The run's identity in meta.json names the setting before any tensor is read (the tensors' shape check,
    # for a checkpoint written before identities, is tests/unit/test_checkpoint_sharded.py's).
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith('batchpilot: error: model.args: is {"block_size": 32, "n_embd": 64'), lines[0]
    assert (
        "(fix: give this run its own train.checkpoint_uri, or restore model.args to continue run " in lines[0]
    )
