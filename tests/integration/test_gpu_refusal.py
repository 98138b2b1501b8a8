"""Issue #20: a trainer or an explore planned for GKE GPUs, run on this GPU-less machine, refuses at once in
one line naming the GPUs it expected and what it found, instead of training on the CPU while the pool bills.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import yaml

from batchpilot.ports import free_port
from helpers import gke_a3_config, run_batchpilot, write_plan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing would be refused"),
]


def gke_gpu_config() -> dict:
    """The tiny model on a pool of a3-highgpu-8g nodes (8 H100s each); data and checkpoints in GCS (a gke
    config refuses local paths), never reached: the refusal comes first."""
    return gke_a3_config()


def one_line_refusal(result, *, elapsed_s: float, expected: str) -> str:
    """The run's one stderr line, after checking it failed fast, without a traceback, naming `expected`."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert elapsed_s < 30
    (line,) = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert line.startswith(f"batchpilot: error: cluster.accelerator_type: nvidia-h100-80gb needs {expected}")
    assert "found 0 (torch.cuda.is_available() is False, torch.cuda.device_count() is 0): " in line
    return line


def test_a_trainer_planned_for_eight_gpus_refuses_on_a_machine_without_them(tmp_path: Path):
    plan = write_plan(tmp_path / "run", gke_gpu_config())
    out = tmp_path / "out"
    # One process of a one-node stage, as torchrun starts it (LOCAL_WORLD_SIZE = devices_per_node).
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("LD_LIBRARY_PATH", None)
    started = time.monotonic()
    result = run_batchpilot(
        "train", "--plan", plan, "--stage", "0", "--output-dir", str(out), env=env, timeout=60
    )
    line = one_line_refusal(
        result,
        elapsed_s=time.monotonic() - started,
        expected="8 CUDA device(s) here (LOCAL_WORLD_SIZE=8 trainer process(es) on this node, one GPU each)",
    )
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)" in line
        assert line.endswith(
            "(fix: build the image with TORCH_FLAVOR=cuda and a CUDA TORCH_REQUIREMENT (see the Dockerfile))"
        )
    else:
        assert "the NVIDIA driver libraries are not on LD_LIBRARY_PATH" in line
    assert not out.exists()


def test_explore_on_a_gke_gpu_config_refuses_on_a_machine_without_a_gpu(tmp_path: Path):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(gke_gpu_config()))
    out = tmp_path / "explore"
    started = time.monotonic()
    result = run_batchpilot("explore", "--config", str(config_path), "--output-dir", str(out), timeout=60)
    one_line_refusal(
        result,
        elapsed_s=time.monotonic() - started,
        expected="1 CUDA device(s) here (explore's probes measure one GPU)",
    )
    assert not out.exists()
