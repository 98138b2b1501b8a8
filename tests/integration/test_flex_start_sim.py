"""`batchpilot launch` with `cluster.provisioning: flex-start` on the simulated cluster, whose queued
provisioning follows GKE's documented behaviour (provisioning_controller.py): the launch's
ProvisioningRequest, its JobSet once the request is Provisioned, and the request's end in every case.

The launch runs as a real process with KUBECONFIG on the Kubernetes API stand-in; its trainer pods do not
run processes here (no kubelet): a test ends them as their containers would (`finish_pod`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gke_sim import SimulatedGke, simulated_gke
from test_train_task_sigterm import GracefulKubelet
from workload_controllers import now

from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV
from helpers import gke_a3_config, write_plan

pytestmark = pytest.mark.slow  # real launch processes against the simulated cluster

NS = "batchpilot"
REQUESTS = "/provisioningrequests"


@dataclass
class Flex:
    gke: SimulatedGke
    plan: str
    env: dict[str, str]

    def launch(self, *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "batchpilot", "launch", "--plan", self.plan, "--stage", "0"]
        return subprocess.Popen(
            command,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def posts(self, suffix: str) -> list[dict]:
        return [b for m, p, _, b in list(self.gke.kube.state.requests) if m == "POST" and p.endswith(suffix)]

    def wait_for(self, what: str, condition: Callable[[], bool], process: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert process.poll() is None, (
                f"the launch ended before {what}: {process.communicate()[0][-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {what} after 60s"
            time.sleep(0.05)

    def trainer_pods(self) -> list[tuple[str, str]]:
        return [key for key, pod in list(self.gke.sim.pods.items()) if key[0] == NS]

    def running_nodes(self, process: subprocess.Popen[str]) -> set[str]:
        """The nodes the launch's trainer pods run on, once they all run (earlier jobs' ended pods aside)."""

        def live() -> list[dict]:
            pods = [self.gke.sim.pods.get(k) for k in self.trainer_pods()]
            return [p for p in pods if p is not None and p["status"]["phase"] in ("Pending", "Running")]

        self.wait_for("running trainer pods",
                      lambda: bool(live()) and all(p["status"]["phase"] == "Running" for p in live()), process)  # fmt: skip
        return {p["spec"]["nodeName"] for p in live()}

    def finish_trainers(self, process: subprocess.Popen[str]) -> None:
        """Once the launch's trainer pods run, they end with exit 0 (a stage trained to its end)."""
        self.wait_for(
            "running trainer pods",
            lambda: any(self.gke.sim.pods[k]["status"]["phase"] == "Running" for k in self.trainer_pods()),
            process,
        )
        for key in self.trainer_pods():
            self.gke.sim.finish_pod(*key, exit_code=0)


def run(process: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(
            f"the launch did not end in {timeout_s:g}s: {process.communicate()[0][-3000:]}"
        ) from None
    return process.returncode, out


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("batchpilot: error:")]


@pytest.fixture
def flex(tmp_path: Path, gcs_server, gcs_bucket: str) -> Iterator[Callable[..., Flex]]:
    """A launch of stage 0 (1 node) with flex-start on pool `gpu` (a3-highgpu-8g, queued provisioning,
    autoscaling up to 2 nodes, no node yet); `cluster` overrides cluster settings. The checkpoints are in
    the GCS emulator (a launch reads what earlier launches recorded there)."""
    with simulated_gke(scale_down_unneeded_s=0.0) as gke:
        gke.add_pool(
            "gpu", machine_type="a3-highgpu-8g", queued_provisioning=True,
            autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2},
        )  # fmt: skip

        def make(sized: bool = True, **cluster: object) -> Flex:
            # `sized`: explicit sizes below the node's allocatable; without them the pods are sized from the
            # machine type as the cluster autoscaler's template of a new node has it (no node to read yet).
            sizes = {"cpu_per_node": 200, "memory_per_node_bytes": "1700GiB"} if sized else {}
            config = gke_a3_config(provisioning="flex-start", **sizes, **cluster)
            config["train"]["checkpoint_uri"] = f"gs://{gcs_bucket}/ckpt"
            config["data"]["uri"] = f"gs://{gcs_bucket}/data"
            plan = write_plan(tmp_path / "run", config)
            env = {
                "KUBECONFIG": str(gke.write_kubeconfig(tmp_path / "kubeconfig")), "PATH": "/usr/bin",
                "STORAGE_EMULATOR_HOST": gcs_server.endpoint, "GOOGLE_CLOUD_PROJECT": "batchpilot-test",
            }  # fmt: skip
            return Flex(gke, plan, env)

        yield make


def test_a_provisioned_request_brings_every_node_the_jobset_trains_and_the_request_is_deleted(flex):
    launch = flex()
    process = launch.launch()
    launch.finish_trainers(process)
    code, out = run(process)
    assert code == 0, out[-3000:]
    (request,) = launch.posts(REQUESTS)
    (template,) = launch.posts("/podtemplates")
    (jobset,) = launch.posts("/jobsets")
    name = jobset["metadata"]["name"]
    assert request["metadata"]["name"] == template["metadata"]["name"] == name
    assert request["spec"]["podSets"] == [{"count": 1, "podTemplateRef": {"name": name}}]
    # The JobSet came after GKE provisioned the request (the autoscaler's lifecycle, not fire and forget).
    posted = [p for m, p, _, _ in launch.gke.kube.state.requests if m == "POST"]
    assert posted.index(next(p for p in posted if p.endswith("/jobsets"))) > posted.index(
        next(p for p in posted if p.endswith(REQUESTS))
    )
    assert "ProvisioningRequest " + name + " for 1 node(s): Provisioned" in out
    # Its pod ran on the node the request brought, and nothing is left asking for or holding nodes.
    bound = [
        e["message"] for e in launch.gke.sim.events if e["reason"] == "Scheduled" and name in e["message"]
    ]
    assert len(bound) == 1 and " to gke-train-gpu-" in bound[0], bound
    assert not launch.gke.sim.provisioning.requests and not launch.gke.sim.provisioning.templates
    deadline = time.monotonic() + 10  # the node goes once the autoscaler sees it unneeded
    while launch.gke.sim.pool_size("gpu") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [size for pool, size in launch.gke.sim.pool_history if pool == "gpu"] == [0, 1, 0]


def test_pods_sized_from_the_machine_type_fit_the_autoscalers_template_and_the_request_provisions(flex):
    """Sized from the nominal memory (the documented reservations alone), a trainer pod is larger than the
    autoscaler's template node (the kernel's ~29.6 GiB are off it there): the request would never provision."""
    launch = flex(sized=False, capacity_timeout_s=20)
    process = launch.launch()
    launch.finish_trainers(process)
    code, out = run(process)
    assert code == 0, out[-3000:]
    (template,) = launch.posts("/podtemplates")
    (container,) = template["template"]["spec"]["containers"]
    assert (
        container["resources"]["limits"]["memory"] == "1928582M"
    )  # the template, less the DaemonSets' 2 GiB
    assert "ProvisioningRequest " + template["metadata"]["name"] + " for 1 node(s): Provisioned" in out


def test_a_pod_larger_than_the_template_never_provisions(simulated_cluster):
    """The simulator's rule on its own: a PodTemplate sized from the nominal figure stays NotProvisioned."""
    simulated_cluster.add_pool(
        "gpu",
        machine_type="a3-highgpu-8g",
        queued_provisioning=True,
        autoscaling={"enabled": True, "totalMinNodeCount": 0, "totalMaxNodeCount": 2},
    )
    controller = simulated_cluster.sim.provisioning
    nominal = {"cpu": "206", "memory": "1960332M", "nvidia.com/gpu": "8"}
    template = {"template": {"spec": {
        "nodeSelector": {"cloud.google.com/gke-nodepool": "gpu", "cloud.google.com/gke-flex-start": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                        {"key": "cloud.google.com/gke-queued", "operator": "Exists"}],
        "containers": [{"name": "t", "resources": {"requests": nominal, "limits": nominal}}],
    }}}  # fmt: skip
    why = controller.unfit_template(simulated_cluster.sim, "gpu", template)
    assert why is not None and why.startswith(
        "pod didn't trigger scale-up: Insufficient memory on a new node"
    )
    fitting = {**nominal, "memory": "1928582M"}
    template["template"]["spec"]["containers"][0]["resources"] = {"requests": fitting, "limits": fitting}
    assert controller.unfit_template(simulated_cluster.sim, "gpu", template) is None


def test_a_request_that_never_gets_capacity_ends_after_the_timeout_in_one_line_and_is_deleted(flex):
    launch = flex(capacity_timeout_s=3)
    launch.gke.container.state.zone_capacity = {"us-central1-a": 0}  # a stockout: no a3 VM in the zone
    started = time.monotonic()
    code, out = run(launch.launch())
    assert code != 0
    assert 3 <= time.monotonic() - started < 60
    (line,) = error_lines(out)
    assert line.startswith("batchpilot: error: cluster.capacity_timeout_s: ProvisioningRequest tiny-stage-0-")
    assert "for 1 node(s) not provisioned after 3s: Accepted, not Provisioned (NotProvisioned: " in line
    assert "it is deleted (fix: raise cluster.capacity_timeout_s" in line
    assert not launch.posts("/jobsets")  # no trainer pod ever waited on the GPUs
    assert not launch.gke.sim.provisioning.requests and not launch.gke.sim.provisioning.templates
    assert not launch.gke.sim.nodes


def test_a_failed_request_ends_the_launch_at_once_with_gkes_reason(flex):
    launch = flex(capacity_timeout_s=600)
    launch.gke.sim.provisioning.fail_with = ("OutOfResources", "the zones of pool gpu cannot create a3 VMs")
    started = time.monotonic()
    code, out = run(launch.launch())
    assert code != 0 and time.monotonic() - started < 60  # not the 600 s bound
    (line,) = error_lines(out)
    assert line.startswith("batchpilot: error: cluster.provisioning: ProvisioningRequest tiny-stage-0-")
    assert "ended: Failed (OutOfResources: the zones of pool gpu cannot create a3 VMs); it is deleted" in line
    assert not launch.posts("/jobsets")
    assert not launch.gke.sim.provisioning.requests and not launch.gke.sim.provisioning.templates


def test_a_cancelled_launch_deletes_its_waiting_request(flex):
    launch = flex(capacity_timeout_s=600)
    launch.gke.container.state.zone_capacity = {"us-central1-a": 0}  # it waits
    process = launch.launch()
    launch.wait_for("the request", lambda: bool(launch.gke.sim.provisioning.requests), process)
    time.sleep(0.5)  # within the wait
    process.send_signal(signal.SIGTERM)  # no pod of its own to read: a cancel
    code, out = run(process, timeout_s=60)
    assert code == 130, out[-3000:]
    assert "deleting ProvisioningRequest tiny-stage-0-" in out
    assert not launch.gke.sim.provisioning.requests and not launch.gke.sim.provisioning.templates


def evicted_task_pod(gke: SimulatedGke) -> str:
    """A running task pod in `kubeflow`, then marked as the Eviction API marks one before SIGTERM."""
    gke.add_pool("cpu", machine_type="e2-standard-4", per_zone=1)
    pod = {"metadata": {"name": "train-task", "labels": {"app": "train-task"}}, "spec": {
        "nodeSelector": {"cloud.google.com/gke-nodepool": "cpu"},
        "containers": [{"name": "main", "image": "batchpilot:0.1.0"}]}}  # fmt: skip
    gke.sim.create_pod("kubeflow", pod)
    return "train-task"


def mark_evicted(gke: SimulatedGke, name: str) -> None:
    with gke.sim.lock:
        pod = gke.sim.pods[("kubeflow", name)]
        pod["status"]["conditions"].append(
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
             "lastTransitionTime": now()}
        )  # fmt: skip
        gke.sim.delete_pod("kubeflow", name)


def booking_expired(gke: SimulatedGke) -> bool:
    (request,) = gke.sim.provisioning.requests.values()
    return any(
        c["type"] == "BookingExpired" and c["status"] == "True" for c in request["status"]["conditions"]
    )


@pytest.mark.parametrize("expired", [False, True], ids=["booked", "booking-expired"])
def test_an_evicted_task_leaves_its_request_and_the_retry_adopts_it(flex, expired):
    """`booking-expired`: the retry comes after the autoscaler's booking of the request expired (10 minutes after
    Provisioned, provisioning_controller.py); the JobSet's pods hold its nodes, so the request is still adopted,
    not replaced by one that asks GKE for the nodes again."""
    launch = flex()
    gke = launch.gke
    gke.sim.kubelet = GracefulKubelet()  # the evicted task pod stays through its grace period
    if expired:
        gke.sim.provisioning.booking_s = 0.5
    task = evicted_task_pod(gke)
    first = launch.launch(env={POD_NAME_ENV: task, POD_NAMESPACE_ENV: "kubeflow"})
    launch.wait_for("the JobSet", lambda: bool(gke.sim.jobsets), first)
    mark_evicted(gke, task)
    first.send_signal(signal.SIGTERM)
    code, out = run(first, timeout_s=60)
    assert code == 75, out[-3000:]
    assert len(gke.sim.provisioning.requests) == 1  # still holding the node for the retry
    if expired:
        deadline = time.monotonic() + 30
        while not booking_expired(gke):
            assert time.monotonic() < deadline, "the simulator's booking did not expire"
            time.sleep(0.1)
    (jobset,) = gke.sim.jobsets.values()
    seen = len(gke.kube.state.requests)
    retry = launch.launch()
    # The retry follows the JobSet (reads it) once it has adopted it; its trainers end only then.
    followed = f"/jobsets/{jobset['metadata']['name']}"
    launch.wait_for(
        "the retry following the JobSet",
        lambda: any(m == "GET" and p.endswith(followed) for m, p, _, _ in gke.kube.state.requests[seen:]),
        retry,
    )
    launch.finish_trainers(retry)
    code, out = run(retry)
    assert code == 0, out[-3000:]
    assert "adopting its ProvisioningRequest tiny-stage-0-" in out
    assert len(launch.posts(REQUESTS)) == 1 and len(launch.posts("/jobsets")) == 1  # nothing asked twice
    assert not gke.sim.provisioning.requests and not gke.sim.provisioning.templates


CANARY = """
import sys
from batchpilot.cluster.canary import canary_spec, run_canary_job
from batchpilot.logs import configure_console
from batchpilot.plan.rundoc import read_run_document
from batchpilot.workflow.canary import _first_launch, canary_nodes

configure_console()
document = read_run_document(sys.argv[1])
spec = canary_spec(document.config, num_nodes=canary_nodes(document.config, document))
code, failure = run_canary_job(document.config, spec=spec, work_dir=None, first_launch=_first_launch(document))
sys.exit(code)
"""
"""The canary task's job on GKE, as workflow.canary runs it (its storage probes and canary.json are the ranks',
which do not run here)."""


def test_the_canary_runs_on_the_first_launchs_request_and_hands_it_over(flex):
    """A flex-start canary that queued its own request would release those nodes just before the first launch
    queues again: it uses the first launch's request instead, and leaves it (with its nodes) to that launch."""
    launch = flex()
    gke = launch.gke
    canary = subprocess.Popen(
        [sys.executable, "-c", CANARY, launch.plan], env=launch.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    canary_nodes = launch.running_nodes(canary)
    launch.finish_trainers(canary)
    code, out = run(canary)
    assert code == 0, out[-3000:]
    (request,) = gke.sim.provisioning.requests.values()
    name = request["metadata"]["name"]
    assert name.startswith("tiny-stage-0-"), name  # the first launch's, not the canary's own
    assert f"keeping ProvisioningRequest {name} and its 1 node(s) for {name}" in out
    first = launch.launch()
    assert launch.running_nodes(first) == canary_nodes  # the nodes the canary checked are the ones that train
    launch.finish_trainers(first)
    code, out = run(first)
    assert code == 0, out[-3000:]
    assert f"adopting its ProvisioningRequest {name}" in out
    assert len(launch.posts(REQUESTS)) == 1  # GKE was asked once, for the canary and the first launch
