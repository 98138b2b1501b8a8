"""batchpilot on GKE, played by the cluster simulator: the pool is resized, the stages train through JobSets.

The simulator (tests/integration/cluster_sim.py and neighbours) takes its rules from Kubernetes, JobSet
and GKE; its pods run as local processes (pod_runner.py), so the JobSet batchpilot renders really runs
`torchrun ... batchpilot train` here.

Two levels:
- the compiled pipeline of a gke config, run by kfp.local (`batchpilot.kfp.local.run_pipeline`): its
  tasks are processes on this machine that reach the simulator through `cluster.container_api_endpoint`
  and KUBECONFIG, as task pods reach GKE; the trainers are the simulator's pods;
- `batchpilot launch`, one stage at a time, as the train task runs it.

Data and checkpoints live in a GCS emulator (fake-gcs-server, tests/integration/gcs_server.py), as a gke
run requires (`gs://`: each pod's emptyDir is its own, #20); the trainer pods reach it through
`cluster.env` (STORAGE_EMULATOR_HOST), since a simulated pod inherits none of the test's environment.

Not covered: the task pods themselves (explore, resize, train as pods the KFP driver creates: see
tests/integration/test_kfp_driver_sim.py), and a retried train task in the pipeline (kfp.local does
retry, but after the compiled 60 s backoff; adopting or replacing the stage's JobSet on a second launch
is in tests/integration/test_cluster_jobset.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from batchpilot.cluster.gke import GkeNodePool, PoolRef
from batchpilot.cluster.readiness import PoolNodes
from batchpilot.kfp import pipeline
from batchpilot.runstate import load_metrics, read_events
from batchpilot.storage import open_storage
from helpers import processes_with, tiny_config, write_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gcs_server import GCSServer, gcs_server_running
from gke_sim import SimulatedGke, simulated_gke

pytestmark = pytest.mark.slow
PROJECT_ID = "batchpilot-test"


@dataclass
class Bucket:
    """A fresh bucket of the session's GCS emulator holding the demo shard set; this test process and its
    children (the launch, the pipeline and its tasks) reach it through STORAGE_EMULATOR_HOST."""

    endpoint: str
    data_uri: str
    checkpoint_uri: str


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    with gcs_server_running(log_path=tmp_path_factory.mktemp("fake-gcs-server") / "server.log") as server:
        yield server


@pytest.fixture
def bucket(gcs: GCSServer, demo_data_uri: str, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT_ID)
    name = f"e2e-{uuid.uuid4().hex[:12]}"
    storage.Client(project=PROJECT_ID, credentials=AnonymousCredentials()).create_bucket(name)
    local, remote = open_storage(demo_data_uri), open_storage(f"gs://{name}/data")
    for item in local.list():
        remote.write(item, local.read(item))
    return Bucket(gcs.endpoint, f"gs://{name}/data", f"gs://{name}/ckpt")


def gke_config(bucket: Bucket) -> dict:
    # Stage 1 is 120 steps (samples 320 to 4160), long enough to be preempted in the middle.
    config = tiny_config(
        data_uri=bucket.data_uri, checkpoint_uri=bucket.checkpoint_uri,
        batch__schedule="0:16 320:32 4160:64", train__total_samples=6144,
    )  # fmt: skip
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="cpu",
        image="batchpilot:0.1.0", cpu_per_node=1, memory_per_node_bytes=3 * 2**30,
        # The trainer pods' way to the emulator (pod_runner.py passes them the container's env only).
        env={"STORAGE_EMULATOR_HOST": bucket.endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT_ID},
        # The pool histories below are of resizes in series; asking ahead is tested on its own (the end).
        capacity_ahead="off",
    )  # fmt: skip
    return config


@dataclass
class Run:
    gke: SimulatedGke
    pool: GkeNodePool
    plan: str
    env: dict[str, str]
    checkpoint_uri: str

    def launch(self, stage: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "batchpilot", "launch", "--plan", self.plan, "--stage", stage]
        return subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


@pytest.fixture
def run(bucket: Bucket, tmp_path: Path) -> Iterator[Run]:
    plan = write_plan(tmp_path, gke_config(bucket))
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
        yield Run(gke, pool, plan, env, bucket.checkpoint_uri)


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
    consumed = [r["consumed_samples"] for r in load_metrics(run.checkpoint_uri) if r["stage"] == 1]
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


# --- the compiled pipeline (kfp.local) -------------------------------------------------------------

RUN_PIPELINE = (
    "import sys; from pathlib import Path; from batchpilot.config import load_config; "
    "from batchpilot.kfp import pipeline; from batchpilot.kfp.local import run_pipeline; "
    "pipeline.STAGE_RETRIES = int(sys.argv[3]); "
    "run_pipeline(load_config(sys.argv[1]), output=Path(sys.argv[2]))"
)


@dataclass
class PipelineRun:
    gke: SimulatedGke
    output: Path
    checkpoint_uri: str
    process: subprocess.Popen[bytes]

    @property
    def log(self) -> str:
        return (self.output.parent / "pipeline.log").read_text(errors="replace")

    def finish(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def jobsets_created(self) -> list[dict]:
        """The body of every JobSet a task created, in order."""
        return [
            body
            for method, path, _, body in list(self.gke.kube.state.requests)
            if method == "POST" and path.endswith("/jobsets")
        ]

    def nodes_of(self, pod_prefix: str) -> set[str]:
        """The nodes the scheduler bound the pods named `pod_prefix...` to (its Scheduled events)."""
        bound = re.compile(rf"^Successfully assigned [^/]+/{re.escape(pod_prefix)}\S* to (\S+)$")
        return {
            match.group(1)
            for event in list(self.gke.sim.events)
            if event["reason"] == "Scheduled" and (match := bound.match(event["message"]))
        }

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, f"the pipeline ended before {what}:\n{self.log[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:g}s:\n{self.log[-4000:]}"
            time.sleep(0.1)


@pytest.fixture
def simulated_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedGke]:
    """One single-zone CPU pool at 0 nodes; KUBECONFIG (inherited by the pipeline and its tasks) on it.

    Nodes are Ready as they register: a later readiness poll would cost the resize task 10 s (waiting
    for NotReady nodes is tested in tests/integration/test_cluster_gke.py)."""
    with simulated_gke(run_pods_in=tmp_path / "pods") as gke:
        gke.add_pool("cpu", machine_type="e2-standard-4", zones=["us-central1-a"], per_zone=0)
        monkeypatch.setenv("KUBECONFIG", str(gke.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield gke


@pytest.fixture
def start_pipeline(simulated_cluster: SimulatedGke, tmp_path: Path) -> Iterator[Callable[..., PipelineRun]]:
    """Starts the compiled pipeline of a config in a process of its own, as `batchpilot run --local` runs
    a local one (that command refuses gke configs, so this calls the library function); a run still
    going at the end of the test is killed with its tasks."""
    started: list[subprocess.Popen[bytes]] = []

    def start(config: dict, *, stage_retries: int = pipeline.STAGE_RETRIES) -> PipelineRun:
        """`stage_retries` replaces the train tasks' retry count in the compiled pipeline."""
        config["cluster"].update(
            image="registry.example/batchpilot:0.1.0", idle_nodes=0,
            container_api_endpoint=simulated_cluster.container.endpoint,
        )  # fmt: skip
        # Trainer pods sized from the ready nodes (an e2-standard-4 takes one), not from the config.
        del config["cluster"]["cpu_per_node"], config["cluster"]["memory_per_node_bytes"]
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-c", RUN_PIPELINE, str(tmp_path / "config.yaml"), str(tmp_path / "run")]
        with (tmp_path / "pipeline.log").open("wb") as log:
            process = subprocess.Popen(
                [*command, str(stage_retries)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(process)
        return PipelineRun(simulated_cluster, tmp_path / "run", config["train"]["checkpoint_uri"], process)

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def stage_pods_training(gke: SimulatedGke, stage: str, *, launch: str | None = None) -> bool:
    """Whether a pod of the JobSet of the stage's launch (default: the stage alone) has logged that it
    trains the stage."""
    for key in list(gke.sim.pods):
        with contextlib.suppress(KeyError):  # the pod went meanwhile
            if key[1].startswith(f"tiny-{launch or stage}-") and f"training {stage}" in gke.sim.pod_log(*key):
                return True
    return False


def test_the_compiled_pipeline_explores_plans_and_trains_every_stage_on_a_pool_resized_for_it(
    simulated_cluster, start_pipeline, bucket, tmp_path
):
    """pool 0 -> 2 -> canary -> explore -> plan -> stages on 1, 2 and 2 nodes as two launches (stage-0 on 1 node,
    then stages 1 and final in one JobSet on 2), a node preempted in the middle of stage 1 (the JobSet
    restarts, the stage resumes exactly) -> report -> scale down to 0."""
    gke = simulated_cluster
    config = gke_config(bucket)
    # The pipeline has an explore task (the noise-scale study at the fixed micro batch), kept short.
    config["explore"] = {
        "activation_checkpointing": [False], "timed_steps": 1, "min_timed_s": 0,
        "accumulation_multipliers": [2], "study_train_steps": 1, "study_measure_batches": 1,
    }  # fmt: skip
    run = start_pipeline(config)
    run.wait_for(
        "stage-1 training",
        lambda: stage_pods_training(gke, "stage-1", launch="stages-1-final"),
        timeout_s=420,
    )
    time.sleep(1.0)  # a few of its 120 steps
    (jobset,) = [j for j in gke.sim.jobsets.values() if "terminalState" not in j["status"]]
    victim = max(p["spec"]["nodeName"] for p in gke.sim.pods.values() if p["status"]["phase"] == "Running")
    gke.sim.preempt_node(victim)
    assert run.finish(timeout_s=420) == 0, run.log[-6000:]
    assert jobset["status"]["restarts"] == 1
    # Launch stages-1-final starts at step 20 and resumes once, from where the preemption stopped stage 1
    # (its trainers' logs: the train task streams only the first attempt's pods); the final stage follows
    # in the same process group, without a resume.
    logs = "".join(
        path.read_text(errors="replace") for path in (tmp_path / "pods").glob("tiny-stages-1-final-*.log")
    )
    resumed = sorted(int(step) for step in re.findall(r"resumed from step (\d+)", logs))
    assert len(resumed) == 2 and resumed[0] == 20 < resumed[1] < 140, resumed

    plan = json.loads((run.output / "plan.json").read_text())
    assert [s["num_nodes"] for s in plan["stages"]] == [1, 2, 2]
    assert (run.output / "explore" / "explore.json").exists()  # explore ran, on the pool brought up for it
    # 0 nodes, 2 for the canary (and explore), then each launch's count (not each stage's), then idle_nodes.
    assert [size for pool, size in gke.sim.pool_history if pool == "cpu"] == [0, 2, 2, 1, 2, 0]
    created = run.jobsets_created()
    launches = [j["metadata"]["labels"]["batchpilot.dev/stage"] for j in created]
    # The canary's JobSet, then one per launch: the preemption restarted it, and the final stage ran in
    # stage 1's job.
    assert launches == ["canary", "stage-0", "stages-1-final"]
    canary = json.loads(open_storage(f"{run.checkpoint_uri}/canary").read("canary.json"))
    assert (canary["num_nodes"], canary["backend"]) == (2, "gloo") and canary["bus_bandwidth_bytes_per_s"] > 0
    for body, num_nodes in zip(created, [2, 1, 2], strict=True):
        nodes = run.nodes_of(body["metadata"]["name"])
        assert len(nodes) == num_nodes, (body["metadata"]["name"], nodes)
        assert all(node.startswith("gke-train-cpu-") for node in nodes), nodes  # the pool's nodes
    records = load_metrics(run.checkpoint_uri)
    assert [r["consumed_samples"] for r in records] == (
        list(range(16, 321, 16)) + list(range(352, 4161, 32)) + list(range(4224, 6145, 64))
    )  # every step of every stage once, in order, through the preemption
    assert records[-1]["consumed_samples"] == plan["trained_samples"]
    assert "Batch-size ramp" in (run.output / "report.html").read_text()  # the report task ran
    # The exit handler: no JobSet, no pod, no node.
    assert not gke.sim.jobsets and not gke.sim.pods and gke.sim.pool_size("cpu") == 0
    # The goodput ledger in the bucket: every resize from its pool task, each launch from its train task, and a
    # trainer event from each launch's main trainer pod (the preempted attempt stopped at a step's end and
    # reported too); the report task read them.
    events = read_events(run.checkpoint_uri)
    assert [(e["before"], e["after"]) for e in events if e["kind"] == "pool"] == [
        (0, 2),
        (2, 2),
        (2, 1),
        (1, 2),
        (2, 0),
    ]
    assert [e["launch"] for e in events if e["kind"] == "launch"] == ["stage-0", "stages-1-final"]
    trainers = [tuple(e["stages"]) for e in events if e["kind"] == "trainer"]
    assert trainers[0] == (0, 0) and set(trainers[1:]) == {(1, 2)}
    assert "<div class='label'>goodput</div>" in (run.output / "report.html").read_text()


def test_a_partial_resize_trains_the_launch_on_the_nodes_that_came(simulated_cluster, start_pipeline, bucket):
    """#21: the zone has room for one e2-standard-4 of the pool (Compute Engine's stockout, which GKE reports
    as GCE_STOCKOUT): the 2-node launch stages-1-final gets 1 node by cluster.capacity_timeout_s and, with
    fewer_nodes: allow, trains on it at its planned global batches; every sample once."""
    gke = simulated_cluster
    gke.container.state.zone_capacity = {"us-central1-a": 1}
    config = gke_config(bucket)
    config["batch"]["schedule"] = "0:16 320:32 960:64"
    config["train"]["total_samples"] = 2048
    config["explore"] = {"study": False}  # a fixed micro batch and no study: no explore task
    config["cluster"].update(fewer_nodes="allow", capacity_timeout_s=12)
    run = start_pipeline(config)
    assert run.finish(timeout_s=420) == 0, run.log[-6000:]
    log = run.log
    assert "stages-1-final: 1 of 2 planned node(s) ready after" in log and "training on 1 node(s)" in log
    document = json.loads((run.output / "plan.json").read_text())  # the run as it went
    assert [(s["num_nodes"], s.get("planned_nodes")) for s in document["stages"]] == [
        (1, None),
        (1, 2),
        (1, 2),
    ]
    (record,) = document["capacity"]
    assert (record["launch"], record["planned_nodes"], record["ready_nodes"], record["nodes"]) == (
        "stages-1-final", 2, 1, 1,
    )  # fmt: skip
    assert "GCE_STOCKOUT" in record["reason"] and record["waited_s"] >= 12
    created = run.jobsets_created()
    # The canary wanted 2 nodes (a stage spans 2) and, allowed, checked the 1 that came.
    assert [j["metadata"]["labels"]["batchpilot.dev/stage"] for j in created] == [
        "canary", "stage-0", "stages-1-final",
    ]  # fmt: skip
    assert [len(run.nodes_of(body["metadata"]["name"])) for body in created] == [1, 1, 1]
    records = load_metrics(run.checkpoint_uri)
    assert [r["consumed_samples"] for r in records] == (
        list(range(16, 321, 16)) + list(range(352, 961, 32)) + list(range(1024, 2049, 64))
    )  # every step once, in order
    assert {(r["world_size"], r["gradient_accumulation_steps"]) for r in records if r["stage"] == 2} == {
        (1, 4)
    }
    assert "Capacity: launches on fewer nodes than planned" in (run.output / "report.html").read_text()
    # The pool was set to what the launch trains on, and the exit handler scaled it to 0.
    assert [size for pool, size in gke.sim.pool_history if pool == "cpu"][-2:] == [1, 0]
    assert not gke.sim.jobsets and not gke.sim.pods and gke.sim.pool_size("cpu") == 0


def test_a_cancelled_pipeline_leaves_no_jobset_and_no_nodes(
    simulated_cluster, start_pipeline, bucket, tmp_path
):
    """KFP cancels a run by stopping its task pods (SIGTERM) and retries none of them; kfp.local has no
    cancel. So the train task's process gets the SIGTERM while its stage's trainers run, in a pipeline
    compiled without train retries (kfp.local honours the retry policy: with it, the stopped task would
    be retried after 60 s and the stage would finish). The task deletes its JobSet and fails; kfp.local
    then runs the exit handler, which scales the pool down, as KFP runs it after a cancel."""
    gke = simulated_cluster
    config = gke_config(bucket)
    config["explore"] = {"study": False}  # a fixed micro batch and no study: no explore task
    config["batch"]["schedule"] = "0:16 1600:32 4160:64"  # stage 0: 100 steps, stopped in the middle
    run = start_pipeline(config, stage_retries=0)
    run.wait_for("stage-0 training", lambda: stage_pods_training(gke, "stage-0"), timeout_s=240)
    (train_task,) = [
        pid
        for pid, argv, _ in processes_with(bucket.checkpoint_uri)
        if argv[1:3] == ["-m", "kfp.dsl.executor_main"] and "train_stage" in argv
    ]
    os.kill(train_task, signal.SIGTERM)
    assert run.finish(timeout_s=240) == 1, run.log[-6000:]  # the run failed: its stage was stopped
    log = run.log
    assert "deleting JobSet(s) tiny-stage-0-" in log and "(interrupted)" in log, log[-6000:]
    assert "Task 'scale-down' finished with status SUCCESS" in re.sub(r"\x1b\[[0-9;]*m", "", log)
    assert not gke.sim.jobsets and not gke.sim.pods and not gke.sim.nodes
    # 2 nodes for the canary (a later stage spans 2), 1 for stage 0, 0 after the exit handler.
    assert [size for pool, size in gke.sim.pool_history if pool == "cpu"] == [0, 2, 1, 0]
    # The trainer had its grace period: it checkpointed where it stopped, before the node went.
    consumed = [r["consumed_samples"] for r in load_metrics(run.checkpoint_uri)]
    assert consumed == list(range(16, consumed[-1] + 1, 16)) and consumed[-1] < 1600, consumed


def test_the_next_launchs_nodes_are_asked_for_while_the_current_launch_trains(
    simulated_cluster, start_pipeline, bucket
):
    """#36 (cluster.capacity_ahead): nodes take 3 s to be Ready (and the pool task sees them at its 10 s
    readiness poll). stage-0 trains on 1 node, paced to 20 s; the pool task beside its train task asks for
    stages-1-final's second node at once (the lead measured at the canary's resize is longer than what is
    left), the node is Ready before stage-0's last step, and stages-1-final's own resize finds both nodes:
    no wait between the launches for nodes.

    #37: the pipeline runs through Kubeflow Trainer (`cluster.launcher: trainjob`, the stand-in in
    tests/integration/trainer_controller.py): the canary and each launch are TrainJobs on the runtime the config
    needs, whose JobSets Trainer builds; the exit handler deletes them."""
    from trainer_controller import TrainerController

    from batchpilot.cluster.launch import trainjob_runtime
    from batchpilot.config import ClusterConfig

    gke = simulated_cluster
    gke.sim.ready_delay_s = 3.0
    config = gke_config(bucket)
    config["cluster"].update(capacity_ahead="auto", launcher="trainjob")
    gke.sim.trainer = TrainerController()
    gke.sim.trainer.add_runtime(trainjob_runtime(ClusterConfig.model_validate(config["cluster"])))
    config["batch"]["schedule"] = "0:16 320:32 384:64"  # stage-0: 20 steps; stage-1 and final: 2 each
    config["train"].update(total_samples=512, min_step_s=1.0)
    config["explore"] = {"study": False}  # a fixed micro batch and no study: no explore task
    run = start_pipeline(config)
    assert run.finish(timeout_s=420) == 0, run.log[-6000:]
    events = read_events(run.checkpoint_uri)
    pools = [e for e in events if e["kind"] == "pool"]
    # the canary's 2 nodes, stage-0's 1, the next launch's 2 asked ahead, its own resize (nothing to do), 0
    assert [(e["before"], e["after"], bool(e.get("early"))) for e in pools] == [
        (0, 2, False), (2, 1, False), (1, 2, True), (2, 2, False), (2, 0, False),
    ]  # fmt: skip
    stage_0 = next(e for e in events if e["kind"] == "launch" and e["launch"] == "stage-0")
    trainer = next(e for e in events if e["kind"] == "trainer" and e["stages"] == [0, 0])
    early, own = pools[2], pools[3]
    assert stage_0["submitted_s"] < early["requested_s"] and early["ready_s"] <= trainer["last_step_s"]
    assert own["ready_s"] - own["requested_s"] < 2.0  # the canary's resize up took 10 s here
    assert pools[0]["ready_s"] - pools[0]["requested_s"] >= 3.0
    assert "stage-0: the pool grew 1 -> 2 node(s) for stages-1-final" in run.log
    assert [size for pool, size in gke.sim.pool_history if pool == "cpu"] == [0, 2, 1, 2, 2, 0]
    assert not gke.sim.jobsets and not gke.sim.pods and gke.sim.pool_size("cpu") == 0
    assert not gke.sim.trainer.trainjobs  # deleted by the exit handler, their JobSets with them
    canary, *launches = gke.sim.trainer.built  # every launch was a TrainJob whose JobSet Trainer built
    assert "canary" in canary and [n.rsplit("-", 1)[0] for n in launches] == [
        "tiny-stage-0",
        "tiny-stages-1-final",
    ]


def test_a_pipeline_in_a_kueue_queue_waits_for_the_quota_another_team_holds_then_trains_every_stage(
    simulated_cluster, start_pipeline, bucket
):
    """#37 (cluster.kueue_queue): the run's JobSets go through a Kueue LocalQueue whose ClusterQueue has 8 CPUs
    (the stand-in in tests/integration/kueue_controller.py). While stage-0 trains on 1 node, another team's
    JobSet takes the rest of the quota; the 2-node launch stages-1-final then waits in the queue, saying how
    much quota it lacks, and is admitted as soon as the other team's job ends; every stage trains."""
    from k8s_rules import pod_requests
    from kubernetes import client
    from kueue_controller import QUEUE_LABEL, KueueController

    gke = simulated_cluster
    kueue = KueueController()
    kueue.add_flavor("cpu")
    kueue.add_cluster_queue("team", quota={"cpu": {"cpu": "8", "memory": "1000Gi"}})
    kueue.add_local_queue("batchpilot", "team-a", cluster_queue="team")
    gke.sim.kueue = kueue
    config = gke_config(bucket)
    config["batch"]["schedule"] = "0:16 320:32 384:64"  # stage-0: 20 steps; stage-1 and final: 2 each
    config["train"].update(total_samples=512, min_step_s=0.5)
    config["explore"] = {"study": False}  # a fixed micro batch and no study: no explore task
    config["cluster"].update(kueue_queue="team-a", capacity_timeout_s=300)
    run = start_pipeline(config)
    run.wait_for("stage-0 training", lambda: stage_pods_training(gke, "stage-0"), timeout_s=240)
    with gke.sim.lock:
        (trainer,) = [p for p in gke.sim.pods.values() if p["metadata"]["name"].startswith("tiny-stage-0-")]
        cpus = pod_requests(trainer["spec"])["cpu"]
    # Another team's job holds what stage-0 leaves of the 8 CPUs (its pod waits for a pool of its own).
    pod = {"containers": [{"name": "main", "image": "x", "resources": {"requests": {"cpu": str(float(8 - cpus))}}}],
           "nodeSelector": {"cloud.google.com/gke-nodepool": "other-team-pool"}, "restartPolicy": "Never"}  # fmt: skip
    other = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": "other-team", "labels": {QUEUE_LABEL: "team-a"}},
             "spec": {"replicatedJobs": [{"name": "main", "replicas": 1, "template": {"spec": {
                 "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod}}}}]}}  # fmt: skip
    objects = client.CustomObjectsApi(gke.kube.api_client())
    objects.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "batchpilot", "jobsets", other)
    run.wait_for(
        "stages-1-final waiting for quota",
        lambda: any(
            w["metadata"]["name"].startswith("jobset-tiny-stages-1-final-")
            and "more needed" in str(w["status"].get("conditions"))
            for w in kueue.objects["workloads"].values()
        ),
        timeout_s=240,
    )
    time.sleep(2.0)
    assert not any(
        p["metadata"]["name"].startswith("tiny-stages-1-final-") for p in list(gke.sim.pods.values())
    )
    objects.delete_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", "batchpilot", "jobsets", "other-team"
    )
    assert run.finish(timeout_s=420) == 0, run.log[-6000:]
    log = run.log
    assert "in LocalQueue team-a: QuotaReserved=False (Pending: couldn't assign flavors to pod set batchpilot: " \
           "insufficient unused quota for cpu in flavor cpu" in log  # fmt: skip
    assert [w.split("-")[1:3] for w in kueue.admitted] == [
        ["tiny", "canary"], ["tiny", "stage"], ["other", "team"], ["tiny", "stages"],
    ]  # fmt: skip
    consumed = [r["consumed_samples"] for r in load_metrics(run.checkpoint_uri)]
    assert consumed == [*range(16, 321, 16), 352, 384, 448, 512]  # every step once, in order
