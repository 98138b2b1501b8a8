"""A stage on its own faster micro batch (#36 item 4): planned from an exploration, stage-0 trains at micro batch
4 on 1 node and the final stage at 16 on 2; the final stage resumes from stage-0's checkpoint and trains the same
global batches as a run at 4 throughout, every sample once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.runstate import read_metrics
from helpers import run_batchpilot, synthetic_explore_json, tiny_config

pytestmark = pytest.mark.slow


def planned(root: Path, data_uri: str, *, micro: int | str) -> str:
    config = tiny_config(data_uri=data_uri, checkpoint_uri=f"file://{root}/ckpt")
    config["batch"].update(micro_batch_size=micro, global_batch_size=32, schedule="0:12 192:32")
    config["train"].update(total_samples=512)
    config["explore"] = {"study": False}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    explore = ["--explore", synthetic_explore_json(root)] if micro == "explore" else []
    result = run_batchpilot(
        "plan", "--config", str(root / "config.yaml"), *explore, "--out", str(root / "plan.json"), "--force"
    )
    assert result.returncode == 0, result.stderr
    return str(root / "plan.json")


def train(plan: str, out: Path) -> list[str]:
    logs = []
    for stage in ("0", "final"):
        result = run_batchpilot(
            "launch", "--plan", plan, "--stage", stage, "--output-dir", str(out), "--audit"
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        logs.append(result.stdout)
    return logs


def test_the_final_stage_on_a_larger_micro_batch_resumes_and_trains_the_same_batches(demo_data_uri, tmp_path):
    faster = planned(tmp_path / "faster", demo_data_uri, micro="explore")
    stages = json.loads(Path(faster).read_text())["stages"]
    assert [(s["num_nodes"], s["micro_batch_size"]) for s in stages] == [(1, 4), (2, 16)]
    same = planned(tmp_path / "same", demo_data_uri, micro=4)
    assert [s["micro_batch_size"] for s in json.loads(Path(same).read_text())["stages"]] == [4, 4]
    logs = train(faster, tmp_path / "faster" / "out")
    assert "resumed from step 16 (192 samples)" in logs[1]
    train(same, tmp_path / "same" / "out")
    metrics = read_metrics(tmp_path / "faster" / "out" / "metrics.jsonl")
    reference = read_metrics(tmp_path / "same" / "out" / "metrics.jsonl")
    assert [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in metrics] == [(4, 3)] * 16 + [
        (16, 1)
    ] * 10
    assert [r["consumed_samples"] for r in metrics] == [r["consumed_samples"] for r in reference]
    for a, b in zip(metrics, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    positions = []
    for path in (tmp_path / "faster" / "out" / "audit").glob("positions-rank*.txt"):
        for line in path.read_text().splitlines():
            positions += [int(v) for v in line.split()[2:]]
    assert sorted(positions) == list(range(512))
