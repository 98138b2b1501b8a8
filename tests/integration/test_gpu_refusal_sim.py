"""Issue #20 on the simulated cluster: a stage launched on an a3-highgpu-8g pool, whose pod runs here as a
local process that sees no GPU (pod_runner.py), fails at once with the trainers' one-line refusal in the
launch's output, instead of training on the CPU while the GPU nodes bill.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gke_sim import simulated_gke

from helpers import gke_a3_config, write_plan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing would be refused"),
]


def test_a_stage_on_a_gpu_pool_ends_with_the_refusal_instead_of_training(tmp_path: Path):
    config = gke_a3_config()
    plan = write_plan(tmp_path / "run", config)
    with simulated_gke(run_pods_in=tmp_path / "pods") as gke:
        gke.add_pool("gpu", machine_type="a3-highgpu-8g", per_zone=1)
        env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "batchpilot", "launch", "--plan", plan, "--stage", "0"],
            env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        elapsed_s = time.monotonic() - started
        (pod,) = gke.sim.pods.values()
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert elapsed_s < 180, out[-3000:]
    assert (
        "batchpilot: error: cluster.accelerator_type: nvidia-h100-80gb needs 8 CUDA device(s) here "
        "(LOCAL_WORLD_SIZE=8 trainer process(es) on this node, one GPU each), found 0" in out
    ), out[-3000:]
    assert "training stage-0" not in out
    assert pod["status"]["phase"] == "Failed"
