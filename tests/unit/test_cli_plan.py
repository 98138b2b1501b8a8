"""`batchpilot plan` and `batchpilot config` as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main
from helpers import write_manifest

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NEMO = str(CONFIGS / "nemo_gpt3_5b.yaml")


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "batchpilot", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_plan_table_reproduces_the_nemo_node_schedule():
    result = run_cli("plan", "--config", NEMO, "--samples-per-s-per-device", "2.5")
    assert result.returncode == 0, result.stderr
    rows = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    batches_nodes = [(int(row[2]), int(row[5])) for row in rows]
    assert batches_nodes == [
        (256, 8),
        (512, 8),
        (768, 8),
        (1024, 8),
        (1280, 10),
        (1536, 12),
        (1792, 14),
        (2048, 16),
    ]
    assert (
        "global_batch_size 2048 = micro_batch_size 4 x data_parallel_size 128 x gradient_accumulation_steps 4"
        in (result.stdout)
    )
    assert "node-hours" in result.stdout and "saved by resizing per stage" in result.stdout


def test_plan_json_contract(capsys):
    assert main(["plan", "--config", NEMO, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    stage = document["stages"][0]
    for key in (
        "index",
        "global_batch_size",
        "start_sample",
        "end_sample",
        "num_nodes",
        "data_parallel_size",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "lr",
    ):
        assert key in stage
    assert document["config"]["name"] == "gpt3-5b"
    assert [s["num_nodes"] for s in document["stages"]] == [8, 8, 8, 8, 10, 12, 14, 16]
    assert sum(s["num_steps"] for s in document["stages"][:-1]) == 14_470


def test_plan_output_is_deterministic_and_not_overwritten(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", NEMO, "--out", str(out)]) == 0
    first = out.read_bytes()
    assert main(["plan", "--config", NEMO, "--out", str(out)]) == 2
    assert "plan.json exists" in capsys.readouterr().err
    assert out.read_bytes() == first
    assert main(["plan", "--config", NEMO, "--out", str(out), "--force"]) == 0
    assert out.read_bytes() == first


def test_explore_micro_batch_needs_a_value(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo's data.uri, file://runs/demo/data, is relative
    write_manifest(tmp_path / "runs" / "demo" / "data")
    demo = str(CONFIGS / "demo.yaml")
    assert main(["plan", "--config", demo]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "batch.micro_batch_size" in err and "--micro-batch-size" in err
    assert main(["plan", "--config", demo, "--micro-batch-size", "8"]) == 0


def test_plan_takes_micro_batch_and_throughput_from_explore_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_manifest(tmp_path / "runs" / "demo" / "data")
    explore = tmp_path / "explore.json"
    explore.write_text(json.dumps({"recommendation": {"micro_batch_size": 4, "samples_per_s": 10.0}}))
    assert main(["plan", "--config", str(CONFIGS / "demo.yaml"), "--explore", str(explore)]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size 4" in out and "samples/s per device" in out


def write(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def nemo_with(**batch):
    data = yaml.safe_load(Path(NEMO).read_text())
    data["batch"].update(batch)
    return data


BAD_PLANS = [
    (
        {"rampup": [256, 300, "10M"]},
        "batch.rampup: (target 2048 - start 256) is not a multiple of increment 300",
    ),
    (
        {"rampup": [100, 4, "10M"]},
        [
            "batch.rampup: 244 of its 488 stages fit no micro batch on 1-16 nodes of 8 device(s)",
            "batch.rampup: makes 488 stages, more than 64",
        ],
    ),
    ({"micro_batch_size": 3}, "stage 7 (global_batch_size=2048)"),
    ({"schedule": "0:256 1M:2048", "rampup": None}, None),
    ({"schedule": "1M:256 2M:2048", "rampup": None}, "batch.schedule: must start at 0"),
    ({"num_pipeline_microbatches": 3, "pipeline_parallel_size": 2}, "batch: num_pipeline_microbatches (3)"),
]


@pytest.mark.parametrize(("batch", "expected"), BAD_PLANS)
def test_invalid_plans_exit_2_with_one_line(tmp_path, capsys, batch, expected):
    code = main(["plan", "--config", write(tmp_path, nemo_with(**batch))])
    captured = capsys.readouterr()
    if expected is None:
        assert code == 0, captured.err
        return
    assert code == 2
    lines = captured.err.splitlines()
    expected = expected if isinstance(expected, list) else [expected]  # one line per problem
    assert len(lines) == len(expected), captured.err
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(f"batchpilot: error: {start}"), captured.err


def test_total_shorter_than_the_ramp(tmp_path, capsys):
    data = yaml.safe_load(Path(NEMO).read_text())
    data["train"] = {**data["train"], "total_tokens": None, "total_samples": "5M"}
    assert main(["plan", "--config", write(tmp_path, data)]) == 2
    assert "train.total_samples: 5000000 samples end before the ramp-up reaches" in capsys.readouterr().err


def test_invalid_config_in_a_real_process_has_no_traceback(tmp_path):
    data = yaml.safe_load(Path(NEMO).read_text())
    data["batch"]["global_batch_size"] = -1
    data["cluster"]["gpus"] = 8
    result = run_cli("plan", "--config", write(tmp_path, data))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "batchpilot: error: cluster: unknown key 'gpus'; valid keys are: backend, devices_per_node, max_nodes, "
        "min_nodes, "
    )
    assert lines[1] == (
        "batchpilot: error: batch.global_batch_size: Input should be greater than 0 (or 'auto') (got -1)"
    )


def test_config_schema_and_check(capsys, tmp_path):
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Config"
    assert main(["config", "check", NEMO]) == 0
    assert "8 stage(s) valid" in capsys.readouterr().out
    assert main(["config", "check", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def nemo_with_train(tmp_path, **train):
    data = yaml.safe_load(Path(NEMO).read_text())
    data["train"].update(train)
    return write(tmp_path, data)


def test_nemo_5b_plans_sharded_and_fits_an_h100(capsys):
    """auto: ddp's full replicas cannot fit 80 GB with this model; the plan shards within a node."""
    assert main(["plan", "--config", NEMO, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["parallelism"] == "hsdp"
    memory = document["memory"]
    assert memory["device_memory_bytes"] == 81559 * 2**20  # an H100 80GB as nvidia-smi reports it
    peak = max(stage["total_bytes"] for stage in memory["stages"])
    assert 20 * 2**30 < peak < memory["device_memory_bytes"]
    assert len(memory["stages"]) == len(document["stages"])


@pytest.mark.parametrize("command", [["plan", "--config"], ["config", "check"], ["compile", "--config"]])
def test_ddp_for_the_5b_model_is_refused_before_anything_runs(tmp_path, capsys, command):
    config = nemo_with_train(tmp_path, parallelism="ddp")
    out = tmp_path / "pipeline.yaml"
    extra = ["--out", str(out)] if command[0] == "compile" else []
    assert main([*command, config, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchpilot: error: train.parallelism: ddp needs ")
    assert "more than the device's 79.6 GiB (fix: use hsdp" in err
    assert not out.exists()


def test_device_memory_override_decides(tmp_path, capsys):
    """A device with 200 GB holds ddp replicas of the 5B model; auto then takes ddp."""
    data = yaml.safe_load(Path(NEMO).read_text())
    data["cluster"]["device_memory_bytes"] = "200GB"
    assert main(["plan", "--config", write(tmp_path, data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallelism"] == "ddp"


def test_pipeline_parallelism_is_refused_until_implemented(tmp_path, capsys):
    assert main(["plan", "--config", write(tmp_path, nemo_with(pipeline_parallel_size=2))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "batchpilot: error: batch.pipeline_parallel_size: is 2, but the trainer implements data and tensor "
        "parallelism"
    )


def test_tensor_parallel_size_under_batch_says_where_it_moved(tmp_path, capsys):
    assert main(["plan", "--config", write(tmp_path, nemo_with(tensor_parallel_size=2))]) == 2
    err = capsys.readouterr().err
    assert "batch: tensor_parallel_size is a train setting: move it to train.tensor_parallel_size" in err
