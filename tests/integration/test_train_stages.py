"""A 3-stage ramp-up on 1 -> 2 -> 2 local nodes (torchx local_cwd) is the same training as one job, under
DDP and under FSDP (where the 1 -> 2 node change reshards the checkpoint: one process's whole tensors
become two ranks' shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.data.sampling import num_samples, sample_at
from batchpilot.runstate import read_metrics
from helpers import run_batchpilot, tiny_config, write_plan

pytestmark = pytest.mark.slow


def audited_positions(output_dir: Path) -> list[tuple[int, int, list[int]]]:
    """(stage, world_size, positions) per rank per step, from every rank's audit file."""
    rows = []
    for path in sorted((output_dir / "audit").glob("positions-rank*.txt")):
        for line in path.read_text().splitlines():
            stage, world, *positions = (int(v) for v in line.split())
            rows.append((stage, world, positions))
    return rows


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def staged_and_single(demo_data_uri, tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"stages-{request.param}")
    staged = tiny_config(
        data_uri=demo_data_uri, checkpoint_uri=f"file://{root}/staged/ckpt", train__parallelism=request.param
    )
    plan = write_plan(root / "staged", staged)
    logs = []
    for stage in ("0", "1", "2"):
        result = run_batchpilot(
            "launch", "--plan", plan, "--stage", stage,
            "--output-dir", str(root / "staged" / "out"), "--audit",
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        logs.append(result.stdout)
    single = tiny_config(
        data_uri=demo_data_uri, checkpoint_uri=f"file://{root}/single/ckpt", train__parallelism=request.param
    )
    plan = write_plan(root / "single", single)
    result = run_batchpilot(
        "train", "--plan", plan, "--stage", "all",
        "--output-dir", str(root / "single" / "out"), "--audit",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root, logs


def test_stages_run_on_their_planned_node_counts_and_say_when_done(staged_and_single):
    root, logs = staged_and_single
    assert "stage-0 done: samples [0, 320)" in logs[0] and "next: stage-1 on 2 node(s)" in logs[0]
    assert "1 node(s) x 1 process(es)" in logs[0]
    assert "2 node(s) x 1 process(es)" in logs[1] and "resumed from step 20 (320 samples)" in logs[1]
    assert "final done" in logs[2] and "training complete" in logs[2]
    worlds = {(r["stage"], r["world_size"]) for r in read_metrics(root / "staged" / "out" / "metrics.jsonl")}
    assert worlds == {(0, 1), (1, 2), (2, 2)}
    strategy = json.loads((root / "staged" / "plan.json").read_text())["parallelism"]
    assert f"saved by 1 process(es) under {strategy}" in logs[1]
    if strategy == "fsdp":
        assert "fsdp: parameters sharded 2 ways" in logs[1]


def test_each_rank_writes_its_own_checkpoint_files(staged_and_single):
    root, _ = staged_and_single
    ckpt = root / "staged" / "ckpt"
    latest = (ckpt / "latest").read_text().strip()
    meta = json.loads((ckpt / latest / "meta.json").read_text())
    assert meta["format"] == "sharded" and meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng.pt"} <= set(meta["files"])
    for name in meta["files"]:
        assert (ckpt / latest / name).stat().st_size == meta["files"][name]["size_bytes"]


def test_every_sample_is_consumed_exactly_once(staged_and_single):
    root, _ = staged_and_single
    rows = audited_positions(root / "staged" / "out")
    positions = sorted(p for _, _, ps in rows for p in ps)
    assert positions == list(range(2048))
    assert {world for _, world, _ in rows} == {1, 2}
    total = num_samples(num_tokens=read_num_tokens(root), seq_len=32)
    samples = [sample_at(p, num_samples=total, seed=0) for p in positions]
    assert len(set(samples)) == len(samples)  # one epoch: no sample repeated


def read_num_tokens(root: Path) -> int:
    config = (root / "staged" / "config.yaml").read_text()
    uri = next(line.split("uri:")[1].strip() for line in config.splitlines() if "uri:" in line)
    manifest = json.loads((Path(uri.removeprefix("file://")) / "manifest.json").read_text())
    return manifest["splits"]["train"]["num_tokens"]


def test_staged_run_matches_the_run_without_stage_boundaries(staged_and_single):
    root, _ = staged_and_single
    staged = read_metrics(root / "staged" / "out" / "metrics.jsonl")
    single = read_metrics(root / "single" / "out" / "metrics.jsonl")
    assert [r["consumed_samples"] for r in staged] == [r["consumed_samples"] for r in single]
    assert [r["global_batch_size"] for r in staged] == [16] * 20 + [32] * 20 + [64] * 17
    for a, b in zip(staged, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert staged[-1]["loss"] < staged[0]["loss"] - 0.5


def test_relaunching_the_finished_final_stage_has_nothing_to_do(staged_and_single):
    """A finished launch started again (a pipeline retry after its task lost the exit status): at its
    planned size it finds the checkpoint at the stage's end and exits 0 without training a step."""
    root, _ = staged_and_single
    out, ckpt = root / "staged" / "out", root / "staged" / "ckpt"
    metrics, checkpoints = (out / "metrics.jsonl").read_bytes(), files_and_mtimes(ckpt)
    result = run_batchpilot(
        "launch", "--plan", str(root / "staged" / "plan.json"),
        "--stage", "final", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final is already complete (2,048 samples): nothing to do" in result.stdout
    assert "final done" not in result.stdout and "| loss " not in result.stdout
    assert (out / "metrics.jsonl").read_bytes() == metrics  # no step ran
    assert files_and_mtimes(ckpt) == checkpoints  # no checkpoint written, none rewritten


def files_and_mtimes(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in folder.rglob("*")}


def test_a_stage_started_on_another_world_size_is_refused(staged_and_single):
    root, _ = staged_and_single
    result = run_batchpilot(
        "train", "--plan", str(root / "staged" / "plan.json"),
        "--stage", "final", "--output-dir", str(root / "staged" / "out"),
    )  # fmt: skip
    assert result.returncode == 2  # final is planned for 2 processes; this one is alone
    assert "final is planned for 2 node(s) x 1 = 2 processes, this job has 1" in result.stderr
