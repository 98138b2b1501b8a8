"""Issue #34, a new user's first hour: one run never continues another's checkpoint, and a launch whose
trainers refuse says their one line (exit 2), not torchrun's tracebacks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import no_debris, run_cli, run_process, sigint_as_in_a_terminal

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def tiny_demo(folder: Path, data_uri: str, **train) -> Path:
    """The demo config cut to 480 samples (two launches: stages-0-2 on 1 node, final on 2)."""
    config = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    config["data"]["uri"] = data_uri
    config["batch"]["rampup"]["samples"] = 128
    config["train"].update(
        total_samples=512, warmup_samples=64, checkpoint_uri=f"file://{folder / 'ckpt'}", **train
    )
    path = folder / f"demo-{len(list(folder.glob('demo-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def planned(config: Path, micro: int) -> str:
    out = config.with_suffix(".plan.json")
    outcome = run_cli("plan", "--config", str(config), "--micro-batch-size", str(micro), "--out", str(out))
    assert outcome.code == 0, outcome.stderr
    return str(out)


@pytest.mark.slow
def test_another_plans_launch_on_the_same_checkpoints_is_refused_and_an_old_checkpoint_by_the_trainers(
    tmp_path: Path, demo_data_uri: str
):
    first = planned(tiny_demo(tmp_path, demo_data_uri), 16)
    trained = run_process("launch", "--plan", first, "--stage", "stages-0-2", "--out", str(tmp_path / "o1"))
    assert trained.code == 0, trained.stderr[-3000:]
    meta_path = next((tmp_path / "ckpt").glob("*/meta.json"))
    run = json.loads(meta_path.read_text())["run"]

    # Another LR and micro batch on the same folder: refused before any trainer starts.
    other = planned(tiny_demo(tmp_path, demo_data_uri, lr=6.0e-4), 8)
    refused = run_process("launch", "--plan", other, "--stage", "final", "--out", str(tmp_path / "o2"))
    line = refused.assert_refused("train.lr: is 0.0006 but", f"holds run {run['id']}, trained with 0.0003")
    assert "give this run its own train.checkpoint_uri" in line
    assert "launched" not in refused.stdout + refused.stderr
    assert not (tmp_path / "o2" / "torchx").exists()

    # A checkpoint of an older batchpilot (no run record) with another seed: the trainers refuse, and the
    # launch reports their one line instead of torchrun's ChildFailedError tracebacks.
    for path in (tmp_path / "ckpt").glob("*/meta.json"):
        meta = json.loads(path.read_text())
        meta.pop("run")
        path.write_text(json.dumps(meta))
    seeded = planned(tiny_demo(tmp_path, demo_data_uri, seed=2), 16)
    outcome = run_process("launch", "--plan", seeded, "--stage", "final", "--out", str(tmp_path / "o3"))
    assert "ChildFailedError" not in outcome.stdout + outcome.stderr
    outcome.assert_refused("train.seed: is 2 but the checkpoint was trained with 0")
    assert (
        "a run that recorded no identity" in outcome.stdout + outcome.stderr
    )  # the launch said what it did not check


# --- `run` checks before it spends: every check plan and doctor make, before the canary ---------------------


@pytest.fixture
def run_config(tmp_path: Path, demo_data_uri: str) -> Path:
    return tiny_demo(tmp_path, demo_data_uri)


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (
            ["--micro-batch-size", "-2"],
            ["--micro-batch-size: must be a number of samples per device, got -2"],
        ),
        (["--micro-batch-size", "7"], ["no node count in [1, 2] splits it", "micro_batch_size 4 or 8"]),
        (["--micro-batch-size", "1000000000"], ["batch.micro_batch_size: 1,000,000,000 samples per device"]),
        (["--resume"], ["--resume:", "holds no run to continue", "leave out --resume"]),
    ],
    ids=["negative", "unplaceable", "huge", "resume-nothing"],
)
def test_run_refuses_in_seconds_and_leaves_no_folder(tmp_path: Path, run_config: Path, argv, fragments):
    out = tmp_path / "run"
    with no_debris(tmp_path):
        outcome = run_cli("run", "--config", str(run_config), "--out", str(out), *argv)
    outcome.assert_refused(*fragments)
    assert not out.exists()


def test_run_refuses_gs_data_without_credentials_before_anything_runs(
    tmp_path: Path, run_config: Path, no_google_credentials: Path
):
    config = yaml.safe_load(run_config.read_text())
    config["data"]["uri"] = "gs://some-bucket/data"
    run_config.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    outcome = run_cli("run", "--config", str(run_config), "--out", str(out))
    outcome.assert_refused(
        "credentials: found no Google credentials", "gcloud auth application-default login"
    )
    assert not out.exists()


def test_run_refuses_a_local_config_naming_a_gpu_this_machine_lacks(tmp_path: Path, run_config: Path):
    config = yaml.safe_load(run_config.read_text())
    config["cluster"]["accelerator_type"] = "nvidia-l4"
    run_config.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    outcome = run_cli("run", "--config", str(run_config), "--out", str(out))
    outcome.assert_refused(
        "cluster.accelerator_type: nvidia-l4 needs 1 CUDA device(s) here",
        "leave cluster.accelerator_type out",
    )
    assert not out.exists()


def test_a_local_run_says_where_its_checkpoints_go_and_keeps_a_bucket(tmp_path: Path):
    from batchpilot.config import load_config
    from batchpilot.kfp.local import local_run_config

    demo = load_config(CONFIGS / "demo.yaml")
    config, notes = local_run_config(demo, output=tmp_path / "out")
    assert config.train.checkpoint_uri == f"file://{tmp_path / 'out'}/ckpt"
    assert notes == [
        f"train.checkpoint_uri: file://runs/demo/ckpt -> file://{tmp_path / 'out'}/ckpt (a local run keeps its "
        "checkpoints in its --out folder; a gs:// checkpoint_uri is kept)"
    ]
    bucket = demo.model_copy(
        update={"train": demo.train.model_copy(update={"checkpoint_uri": "gs://b/ckpt"})}
    )
    config, notes = local_run_config(bucket, output=tmp_path / "out", micro_batch_size=16)
    assert config.train.checkpoint_uri == "gs://b/ckpt" and config.batch.micro_batch_size == 16
    assert notes == ["train.checkpoint_uri: gs://b/ckpt (checkpoints go to the configured bucket)"]


@pytest.mark.parametrize(
    ("param", "fragments"),
    [
        ("micro_batch_size=-4", ["--param: micro_batch_size=-4 is negative"]),
        (
            "micro_batch_size=7",
            ["--param: with micro_batch_size=7 the plan step would refuse the run", "stage 7"],
        ),
        ("total_samples=10", ["--param: with total_samples=10 the plan step would refuse the run"]),
    ],
)
def test_submit_checks_the_parameters_it_sends(tmp_path: Path, param: str, fragments: list[str]):
    with no_debris(tmp_path):
        outcome = run_cli(
            "submit", "--config", str(CONFIGS / "nemo_gpt3_5b.yaml"), "--host", "http://127.0.0.1:9", "--dry-run",
            "--param", param,
        )  # fmt: skip
    outcome.assert_refused(*fragments)


def test_twin_submit_passes_a_micro_batch_the_plan_accepts(tmp_path: Path):
    outcome = run_cli(
        "submit", "--config", str(CONFIGS / "nemo_gpt3_5b.yaml"), "--host", "http://127.0.0.1:9", "--dry-run",
        "--param", "micro_batch_size=2",
    )  # fmt: skip
    assert outcome.code == 0, outcome.stderr


@pytest.mark.slow
def test_ctrl_c_on_run_scales_the_pool_down_and_prints_the_command_that_resumes(
    tmp_path: Path, demo_data_uri: str
):
    config_path = tiny_demo(
        tmp_path, demo_data_uri, min_step_s=2.0
    )  # 11 steps: over 20 s of training to interrupt
    config = yaml.safe_load(config_path.read_text())
    config["explore"]["study"] = False  # a given micro batch and no study: no explore task
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "run", "--config", str(config_path), "--out", str(out),
         "--micro-batch-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        # The first checkpoint (the end of stage-0, written by the trainer itself; pipeline.log is buffered):
        # the run is training, with at least 8 paced steps (16 s) to go.
        while not (out / "ckpt" / "latest").is_file():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run never wrote its first checkpoint"
            time.sleep(0.2)
        assert json.loads((out / "pool.json").read_text())["num_nodes"] >= 1
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, (stdout[-2000:], stderr[-2000:])
    last = stderr.strip().splitlines()[-1]
    assert last == (
        f"batchpilot: interrupted; the pool was scaled down; the full log is {out}/pipeline.log; to continue: "
        f"batchpilot run --config {config_path} --out {out} --resume"
    ), stderr[-2000:]
    assert json.loads((out / "pool.json").read_text())["num_nodes"] == 0
    # What ran and where it stopped, in the report of the stopped run.
    assert f"report of the stopped run: {out}/report.html" in stdout
    page = (out / "report.html").read_text()
    assert "failed" in page and "interrupted; the pool was scaled down" in page


def test_run_refuses_a_launch_this_machines_cpus_cannot_host(tmp_path: Path, run_config: Path):
    # A final stage on one local node more than this machine has CPUs (1 process each): before #34 the run
    # trained the stages before it and failed at the final one's resize.
    from batchpilot.cluster.nodepool import available_cpus
    from batchpilot.commands.run import checked_run_config

    cpus = available_cpus()
    config = yaml.safe_load(run_config.read_text())
    config["cluster"]["max_nodes"] = cpus + 1
    config["batch"].update(
        global_batch_size=16 * (cpus + 1), rampup=None, schedule=f"0:16 64:{16 * (cpus + 1)}"
    )
    run_config.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    outcome = run_cli("run", "--config", str(run_config), "--out", str(out), "--micro-batch-size", "16")
    outcome.assert_refused(
        f"cluster: the largest launch needs {cpus + 1} local process(es), this machine has {cpus}"
    )
    assert not out.exists()
    config["cluster"]["max_nodes"] = cpus  # the twin: what this machine hosts passes every check
    config["batch"].update(global_batch_size=16 * cpus, schedule=f"0:16 64:{16 * cpus}" if cpus > 1 else None)
    run_config.write_text(yaml.safe_dump(config))

    class Args:
        config, micro_batch_size, resume, force = str(run_config), 16, False, False

    checked_run_config(Args(), out)
