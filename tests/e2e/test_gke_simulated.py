"""batchpilot on GKE, played by the cluster simulator: the pool is resized, a stage trains through its JobSet.

The simulator (tests/integration/cluster_sim.py and neighbours) takes its rules from Kubernetes, JobSet
and GKE; its pods run as local processes (pod_runner.py), so the JobSet batchpilot renders really runs
`torchrun ... batchpilot train` here.

Not covered yet: the compiled KFP pipeline driven task by task through the simulator (explore, plan,
resize tasks as pods); here the stages are launched with `batchpilot launch` as the train task does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchpilot.cluster.gke import GkeNodePool, PoolRef
from batchpilot.cluster.readiness import PoolNodes
from batchpilot.train.metrics import read_metrics
from helpers import tiny_config, write_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gke_sim import SimulatedGke, simulated_gke

pytestmark = pytest.mark.slow


def gke_config(data_uri: str, checkpoint_uri: str) -> dict:
    # Stage 1 is 120 steps (samples 320 to 4160), long enough to be preempted in the middle.
    config = tiny_config(
        data_uri=data_uri, checkpoint_uri=checkpoint_uri,
        batch__schedule="0:16 320:32 4160:64", train__total_samples=6144,
    )  # fmt: skip
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="cpu",
        image="batchpilot:0.1.0", cpu_per_node=1, memory_per_node_bytes=3 * 2**30,
    )  # fmt: skip
    return config


@dataclass
class Run:
    gke: SimulatedGke
    pool: GkeNodePool
    plan: str
    env: dict[str, str]
    checkpoints: Path

    def launch(self, stage: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "batchpilot", "launch", "--plan", self.plan, "--stage", stage]
        return subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


@pytest.fixture
def run(demo_data_uri: str, tmp_path: Path) -> Iterator[Run]:
    plan = write_plan(tmp_path, gke_config(demo_data_uri, f"file://{tmp_path}/ckpt"))
    with simulated_gke(run_pods_in=tmp_path / "pods", ready_delay_s=0.2) as gke:
        gke.add_pool("cpu", machine_type="e2-standard-4", zones=["us-central1-a", "us-central1-b"])
        pool = GkeNodePool(
            client=gke.container.client(), pool=PoolRef("proj", "us-central1", "train", "cpu"),
            pool_mode="resize", idle_nodes=0,
            nodes=PoolNodes(api_client=gke.kube.api_client(), node_pool="cpu", gpus_per_node=0),
            operation_timeout_s=20, poll_initial_s=0.02, poll_maximum_s=0.05, ready_poll_interval_s=0.05,
        )  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        yield Run(gke, pool, plan, env, tmp_path / "ckpt")


def written_so_far(metrics: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl the trainer is still writing."""
    text = metrics.read_text() if metrics.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def finish(process: subprocess.Popen[str], timeout_s: float = 300) -> tuple[int, str]:
    out, _ = process.communicate(timeout=timeout_s)
    return process.returncode, out


def test_a_stage_trains_through_its_jobset_on_a_pool_resized_for_it(run):
    run.pool.resize(2)
    run.pool.wait_ready(2, timeout_s=10)
    code, out = finish(run.launch("0"))
    assert code == 0, out[-3000:]
    assert "stage-0 done: samples [0, 320)" in out
    (jobset,) = run.gke.sim.jobsets.values()
    assert jobset["status"]["terminalState"] == "Completed"
    (pod,) = run.gke.sim.pods.values()
    assert pod["spec"]["nodeName"] in run.gke.sim.nodes and pod["status"]["phase"] == "Succeeded"
    run.pool.resize(0)
    assert not run.gke.sim.nodes


def test_a_node_preempted_mid_stage_restarts_the_jobset_and_the_stage_resumes_exactly(run):
    run.pool.resize(2)
    run.pool.wait_ready(2, timeout_s=10)
    assert finish(run.launch("0"))[0] == 0
    process = run.launch("1")
    metrics = run.checkpoints / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not any("training stage-1" in run.gke.sim.pod_log(*key) for key in list(run.gke.sim.pods)):
        assert time.monotonic() < deadline and process.poll() is None, "stage 1 never started"
        time.sleep(0.05)
    time.sleep(1.0)  # a few of its 120 steps
    (jobset,) = [j for j in run.gke.sim.jobsets.values() if "terminalState" not in j["status"]]
    victim = max(
        p["spec"]["nodeName"] for p in run.gke.sim.pods.values() if p["status"]["phase"] == "Running"
    )
    run.gke.sim.preempt_node(victim)
    code, out = finish(process)
    assert code == 0, out[-3000:]
    assert jobset["status"]["restarts"] == 1 and jobset["status"]["terminalState"] == "Completed"
    restarted = [key for key, p in run.gke.sim.pods.items()
                 if p["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"]  # fmt: skip
    resumed = [re.search(r"resumed from step (\d+)", run.gke.sim.pod_log(*key)) for key in restarted]
    step = int(next(m for m in resumed if m).group(1))
    assert 20 < step < 140, f"preempted at step {step}, not in the middle of stage 1 (steps 21-140)"
    consumed = [r["consumed_samples"] for r in read_metrics(metrics) if r["stage"] == 1]
    assert consumed == list(range(352, 4161, 32))  # every step of stage 1 once, in order


def test_a_cancelled_launch_leaves_no_jobset_and_scale_down_no_nodes(run):
    run.pool.resize(2)
    run.pool.wait_ready(2, timeout_s=10)
    process = run.launch("0")
    deadline = time.monotonic() + 120
    while not any(p["status"]["phase"] == "Running" for p in run.gke.sim.pods.values()):
        assert time.monotonic() < deadline and process.poll() is None, "the stage never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # how KFP stops a cancelled run's task
    finish(process, timeout_s=60)
    deadline = time.monotonic() + 60
    while run.gke.sim.jobsets or run.gke.sim.pods:
        assert time.monotonic() < deadline, (list(run.gke.sim.jobsets), list(run.gke.sim.pods))
        time.sleep(0.1)
    run.pool.resize(0)
    assert not run.gke.sim.nodes
