"""The compiled pipeline on the simulated GKE with `cluster.provisioning: flex-start`: each launch asks for
its nodes with a ProvisioningRequest on a queued-provisioning GPU pool, trains once GKE has granted them
all, and nothing is left asking for or holding nodes at the end.

As in test_gke_simulated.py, kfp.local runs the pipeline's tasks as processes that reach the simulator
through `cluster.container_api_endpoint` and KUBECONFIG, and the simulator's pods run as local processes.
Those pods see no GPU (pod_runner.py), while flex-start is for GPU pools (a CPU pool is refused); so this
test's processes load `flex_start_shim/sitecustomize.py`, which makes `batchpilot.train.accelerators.planned_gpu`
answer False: the trainers and the canary run the GPU plan on the CPU with gloo instead of refusing to start.
What is under test is how the nodes come and go, not the devices (the refusal itself is
tests/integration/test_gpu_refusal_sim.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from test_gke_simulated import RUN_PIPELINE, PipelineRun, bucket, gcs, gke_config  # noqa: F401 (fixtures)

from batchpilot.runstate import load_metrics, read_events

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gke_sim import SimulatedGke, simulated_gke

pytestmark = pytest.mark.slow

SHIM = Path(__file__).resolve().parent / "flex_start_shim" / "sitecustomize.py"


@pytest.fixture
def shim_folder() -> Iterator[Path]:
    """A copy of SHIM in a folder outside /tmp: a simulated pod's /tmp is its own emptyDir, so the pod runner
    maps every /tmp path (a checkout under /tmp included) to the pod's folder, where the shim is not."""
    for parent in (Path("/var/tmp"), Path.home() / ".cache"):
        if parent.is_dir() and os.access(parent, os.W_OK) and not str(parent.resolve()).startswith("/tmp"):
            break
    else:
        pytest.fail("no writable folder outside /tmp (/var/tmp, ~/.cache) for the pods' sitecustomize shim")
    folder = Path(tempfile.mkdtemp(prefix="batchpilot-flex-shim-", dir=parent))
    shutil.copy(SHIM, folder / "sitecustomize.py")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def flex_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shim_folder: Path
) -> Iterator[SimulatedGke]:
    """A queued-provisioning pool `gpu` of g2-standard-8 nodes (one L4 each), autoscaling 0..2, no node;
    nodes of a deleted request go once empty for 0.5 s (the autoscaler's unneeded time, shortened)."""
    paths = [str(shim_folder), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    with simulated_gke(run_pods_in=tmp_path / "pods", scale_down_unneeded_s=0.5) as gke:
        gke.add_pool(
            "gpu", machine_type="g2-standard-8", queued_provisioning=True,
            autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2},
        )  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield gke


@pytest.fixture
def start(flex_cluster: SimulatedGke, tmp_path: Path) -> Iterator[Callable[[dict], PipelineRun]]:
    started: list[subprocess.Popen[bytes]] = []

    def run(config: dict) -> PipelineRun:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        command = [
            sys.executable,
            "-c",
            RUN_PIPELINE,
            str(tmp_path / "config.yaml"),
            str(tmp_path / "run"),
            "0",
        ]
        with (tmp_path / "pipeline.log").open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(process)
        return PipelineRun(flex_cluster, tmp_path / "run", config["train"]["checkpoint_uri"], process)

    yield run
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_the_pipeline_trains_every_launch_on_nodes_its_provisioning_request_brought(
    flex_cluster,
    start,
    bucket,  # noqa: F811 (the fixture imported above)
):
    gke = flex_cluster
    config = gke_config(bucket)
    config["batch"]["schedule"] = "0:16 320:32 960:64"  # stage-0 on 1 node, stages 1 and final on 2
    config["train"]["total_samples"] = 2048
    # stage-0 paced to 10 s: long enough for the task beside its train task to read its progress and queue
    # stages-1-final's request while it trains (cluster.capacity_ahead, the default)
    config["train"]["min_step_s"] = 0.5
    config["explore"] = {"study": False}  # a fixed micro batch and no study: no explore task
    config["cluster"].update(
        node_pool="gpu", machine_type="g2-standard-8", accelerator_type="nvidia-l4", devices_per_node=1,
        provisioning="flex-start", capacity_timeout_s=60, image="registry.example/batchpilot:0.1.0",
        idle_nodes=0, container_api_endpoint=gke.container.endpoint, capacity_ahead="auto",
    )  # fmt: skip
    run = start(config)
    assert run.finish(timeout_s=240) == 0, run.log[-6000:]
    log = re.sub(r"\x1b\[[0-9;]*m", "", run.log)
    requests = [
        b for m, p, _, b in gke.kube.state.requests if m == "POST" and p.endswith("/provisioningrequests")
    ]
    by_launch = {
        r["metadata"]["labels"]["batchpilot.dev/stage"]: r["spec"]["podSets"][0]["count"] for r in requests
    }
    assert {k: v for k, v in by_launch.items() if k in ("stage-0", "stages-1-final")} == {
        "stage-0": 1,
        "stages-1-final": 2,
    }, by_launch
    assert re.search(r"ProvisioningRequest tiny-stages-1-final-\w+ for 2 node\(s\): Provisioned", log), log[
        -6000:
    ]
    # stages-1-final's request was queued while stage-0 trained (the pool's 2 nodes then still held stage-0's
    # one, so GKE provisioned it once stage-0's request was gone), and its train task adopted it.
    stage_0 = next(
        e for e in read_events(run.checkpoint_uri) if e["kind"] == "launch" and e["launch"] == "stage-0"
    )
    asked = next(
        i for i, (m, p, _, b) in enumerate(gke.kube.state.requests)
        if m == "POST" and p.endswith("/provisioningrequests") and b["metadata"]["name"].startswith("tiny-stages-1-final-")
    )  # fmt: skip
    ended = next(
        i for i, (m, p, _, b) in enumerate(gke.kube.state.requests)
        if m == "DELETE" and "/provisioningrequests/tiny-stage-0-" in p
    )  # fmt: skip
    assert asked < ended, "stages-1-final's request was not queued before stage-0's was deleted"
    assert "stage-0: asked GKE for 2 node(s) ahead: ProvisioningRequest tiny-stages-1-final-" in log
    assert re.search(
        r"tiny-stages-1-final-(\w+): adopting its ProvisioningRequest tiny-stages-1-final-\1", log
    ), log[-6000:]
    assert stage_0["exit_code"] == 0
    # Every trainer ran on a node of the pool, which nothing resized: the nodes came with the requests.
    for body in [b for m, p, _, b in gke.kube.state.requests if m == "POST" and p.endswith("/jobsets")]:
        nodes = run.nodes_of(body["metadata"]["name"])
        assert nodes and all(node.startswith("gke-train-gpu-") for node in nodes), nodes
    assert not [
        r.path for r in gke.container.state.requests if r.path.endswith((":setSize", ":setAutoscaling"))
    ]
    plan = yaml.safe_load((run.output / "plan.json").read_text())
    consumed = [r["consumed_samples"] for r in load_metrics(run.checkpoint_uri)]
    assert consumed[-1] == plan["trained_samples"] and len(consumed) == len(set(consumed))
    # The end: no request, no template, no JobSet; the nodes go once their requests are gone.
    assert not gke.sim.provisioning.requests and not gke.sim.provisioning.templates and not gke.sim.jobsets
    deadline = time.monotonic() + 10
    while gke.sim.pool_size("gpu") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gke.sim.pool_size("gpu") == 0
