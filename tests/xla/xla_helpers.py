"""Helpers of the XLA runtime's tests: trainers in real processes on virtual XLA CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from batchpilot.runstate import read_metrics
from helpers import tiny_config, write_plan


def xla_env(num_devices: int) -> dict[str, str]:
    """The environment of a trainer on `num_devices` virtual XLA CPU devices."""
    return {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(num_devices),
        "PYTHONUNBUFFERED": "1",
        # Compiling is most of a test run's time on CPU; less LLVM optimisation halves it. Runs compared
        # bit for bit use the same flags.
        "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    }


def train_args(plan: str, stage: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "batchpilot",
        "train",
        "--plan",
        plan,
        "--stage",
        stage,
        "--output-dir",
        str(out),
        *extra,
    ]


def run_xla(plan: str, stage: str, out: Path, *, num_devices: int, extra: tuple[str, ...] = ()) -> str:
    """Runs `batchpilot train` on XLA in a real process; returns its output (fails with it on an error)."""
    result = subprocess.run(
        train_args(plan, stage, out, *extra),
        env=xla_env(num_devices),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{errors(result.stderr)}"
    )
    return result.stdout + result.stderr


def xla_config(data_uri: str, root: Path, *, runtime: str = "xla", **overrides: object) -> dict:
    """tiny_config on nodes of 2 devices, without explore's study (it does not run on XLA)."""
    config = tiny_config(
        data_uri=data_uri,
        checkpoint_uri=f"file://{root}/ckpt",
        cluster__devices_per_node=2,
        cluster__max_nodes=2,
        train__runtime=runtime,
        train__parallelism="fsdp",
        **overrides,
    )
    config["explore"] = {"study": False}
    return config


def plan_for(root: Path, config: dict) -> str:
    return write_plan(root, config)


def run_eager(plan: str, stage: str, out: Path, *, num_ranks: int) -> str:
    """Runs the eager trainer on `num_ranks` CPU processes (torchrun, gloo) in this venv."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}"]
    command += ["-m", "batchpilot", "train", "--plan", plan, "--stage", stage, "--output-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    result = subprocess.run(
        command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{errors(result.stderr)}"
    )
    return result.stdout + result.stderr


def metrics(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def plan_stages(plan: str) -> list[tuple[int, int, int]]:
    """(num_nodes, start_sample, end_sample) of each stage of a plan."""
    return [
        (s["num_nodes"], s["start_sample"], s["end_sample"])
        for s in json.loads(Path(plan).read_text())["stages"]
    ]


def errors(stderr: str) -> str:
    """stderr without torch_xla's warnings (a few per checkpoint), which would hide the error."""
    noise = ("Warning", "warnings.warn", "sharding_propagation", "storage().size()", "unpadded_indices")
    return "\n".join(line for line in stderr.splitlines() if not any(n in line for n in noise))[-4000:]


def run_script(script: str, *, num_devices: int) -> dict:
    """Runs `script` (Python source) on `num_devices` virtual XLA CPU devices; returns the JSON object its last
    output line prints (fails with its errors on a non-zero exit)."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=xla_env(num_devices),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, errors(result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])
