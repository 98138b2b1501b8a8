"""The compiled pipeline: launch groups in order, side-effect tasks uncached, exit handler, no drift."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from batchpilot.kfp.compile import EXAMPLES, compile_file
from helpers import REPO, run_batchpilot


def compile_config(config: Path, output: Path) -> int:
    return compile_file(config, output)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    return {name: compile_and_load(REPO / "configs" / name, folder / name) for name in EXAMPLES}


def compile_and_load(config: Path, output: Path) -> dict:
    compile_config(config, output)
    return next(yaml.safe_load_all(output.read_text()))  # a GKE pipeline adds a platform document


def test_checked_in_pipelines_match_the_source(tmp_path):
    for name in EXAMPLES:
        output = tmp_path / name
        compile_config(REPO / "configs" / name, output)
        checked_in = REPO / "pipelines" / "compiled" / name
        assert output.read_text() == checked_in.read_text(), (
            f"{checked_in} drifted from the source: run `python pipelines/compile.py`"
        )


def test_batchpilot_compile_from_any_folder_matches_pipelines_compile_py(tmp_path):
    """The installed command and the repository's script write the same bytes, a local example and a TPU one
    (each takes two processes of about 10 s here; every example is compiled in-process against the checked-in
    files by `test_checked_in_pipelines_match_the_source`)."""
    import subprocess
    import sys

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("demo.yaml", "llama_5b_tpu.yaml"):
        assert name in EXAMPLES
        config = REPO / "configs" / name
        by_command = elsewhere / f"command-{name}"
        result = run_batchpilot(
            "compile", "--config", str(config), "--output", str(by_command), cwd=elsewhere
        )
        assert result.returncode == 0, result.stderr
        by_script = tmp_path / f"script-{name}"
        script = subprocess.run(
            [sys.executable, str(REPO / "pipelines" / "compile.py"), "--config", str(config), "--output",
             str(by_script)],
            capture_output=True, text=True, cwd=elsewhere, check=False,
        )  # fmt: skip
        assert script.returncode == 0, script.stderr
        assert by_command.read_bytes() == by_script.read_bytes()
        assert by_command.read_bytes() == (REPO / "pipelines" / "compiled" / name).read_bytes()


def test_compiling_twice_gives_the_same_bytes(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    compile_config(REPO / "configs" / "demo.yaml", first)
    compile_config(REPO / "configs" / "demo.yaml", second)
    assert first.read_bytes() == second.read_bytes()


def inner_tasks(spec: dict) -> dict:
    return spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]


def group_tasks(spec: dict, group: str) -> dict:
    """A launch group's tasks, those under its parallel-for and conditions (cluster.capacity_ahead) included,
    each with the dependencies it inherits from the sub-DAGs around it (`dependentTasks`) and the conditions
    it runs under (`conditions`)."""
    found: dict = {}

    def walk(component: str, inherited: list[str], conditions: list[str]) -> None:
        for name, task in spec["components"][component]["dag"]["tasks"].items():
            deps = sorted({*inherited, *task.get("dependentTasks", [])})
            held = [*conditions, *([task["triggerPolicy"]["condition"]] if "triggerPolicy" in task else [])]
            child = task["componentRef"]["name"]
            if "dag" in spec["components"][child]:
                walk(child, deps, held)
            else:
                found[name] = {**task, "dependentTasks": deps, "conditions": held}

    walk(f"comp-{group}", [], [])
    return found


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        # An explored micro batch: one launch slot per stage (node counts follow from the explored size).
        ("demo.yaml", ["launch-0", "launch-1", "launch-2", "launch-3"]),
        # A fixed micro batch: one group per launch, i.e. per node count (NeMo: 8 stages, 5 launches).
        ("nemo_gpt3_5b.yaml", ["stages-0-3", "stage-4", "stage-5", "stage-6", "final"]),
        ("llama_5b.yaml", ["stages-0-3", "stage-4", "stage-5", "stage-6", "final"]),
        # 70B: every stage of the ramp on its own node count (16, 24, ..., 64), hsdp in groups of 4 nodes.
        ("llama_70b.yaml", ["stage-0", "stage-1", "stage-2", "stage-3", "stage-4", "stage-5", "final"]),
        ("maxtext_per_device.yaml", ["stages-0-1", "stage-2", "final"]),
        # TPU: one group per slice shape (2x4, 4x4, 4x8).
        ("llama_5b_tpu.yaml", ["stage-0", "stage-1", "stages-2-final"]),
        # Adaptive: a slot per stage the ramp may have (max_stages 6), decided as the run goes.
        ("demo_adaptive.yaml", [f"launch-{k}" for k in range(6)]),
    ],
)
def test_launch_groups_run_in_order(compiled, name, groups):
    tasks = inner_tasks(compiled[name])
    others = ("prepare-explore-pool", "canary", "explore", "plan", "report")
    assert {n for n in tasks if n not in others} == set(groups)
    assert [tasks[n]["taskInfo"]["name"] for n in groups] == groups
    # The canary runs on the first launch's nodes before it, or before explore when the pipeline explores.
    assert tasks[groups[0]]["dependentTasks"] == (["plan"] if "explore" in tasks else ["canary", "plan"])
    for before, after in itertools.pairwise(groups):
        assert before in tasks[after]["dependentTasks"]
    assert groups[-1] in tasks["report"]["dependentTasks"]
    for k, group_name in enumerate(groups):
        group = group_tasks(compiled[name], group_name)
        assert group["train-stage"]["dependentTasks"] == ["resize-pool"]
        for task in ("resize-pool", "train-stage"):
            assert group[task]["inputs"]["parameters"]["launch_index"]["runtimeValue"]["constant"] == k
        # The next launch's nodes are asked for beside the train task (capacity_ahead: auto) where the nodes
        # come from a resize, in every group but the last.
        ahead = k < len(groups) - 1 and name not in ("demo_adaptive.yaml", "llama_5b_tpu.yaml")
        assert ("bring-next-nodes" in group) == ahead, group_name
        if ahead:
            assert group["bring-next-nodes"]["dependentTasks"] == ["resize-pool"]
            constant = group["bring-next-nodes"]["inputs"]["parameters"]["launch_index"]["runtimeValue"]
            assert constant["constant"] == k
            (train_if,), (next_if,) = (
                group["train-stage"]["conditions"],
                group["bring-next-nodes"]["conditions"],
            )
            assert train_if.endswith("== 'train'") and next_if.endswith("== 'next-nodes'")
    plan_inputs = tasks["plan"]["inputs"]["parameters"]
    assert plan_inputs["num_launch_slots"]["runtimeValue"]["constant"] == len(groups)
    named = "" if name in ("demo.yaml", "demo_adaptive.yaml") else ",".join(groups)
    assert plan_inputs["expected_launches"]["runtimeValue"]["constant"] == named


def test_the_nemo_pipeline_has_five_launch_groups_for_eight_stages(compiled):
    """Issue #13: the 256..1024 stages on 8 nodes are one launch, not four resize-launch-restart cycles."""
    spec = compiled["nemo_gpt3_5b.yaml"]
    groups = [task for task in inner_tasks(spec) if task.startswith(("stage", "final"))]
    assert len(groups) == 5
    assert "8-stage ramp-up" in spec["pipelineInfo"]["description"]


def test_side_effect_tasks_are_not_cached_and_retry(compiled):
    spec = compiled["demo.yaml"]
    tasks = inner_tasks(spec)
    # The plan too: it copies plan.json into the run folder, which a cache hit would skip.
    for name in ("prepare-explore-pool", "canary", "explore", "plan", "launch-0", "launch-3", "report"):
        assert tasks[name]["cachingOptions"] == {}, name
    group = group_tasks(spec, "launch-1")
    assert "retryPolicy" not in group["bring-next-nodes"]  # a resize it could not make is the next launch's
    for name in ("resize-pool", "train-stage"):
        assert group[name]["cachingOptions"] == {}
        assert group[name]["retryPolicy"]["maxRetryCount"] >= 2


def test_exit_handler_scales_the_pool_down_whatever_happens(compiled):
    root = compiled["demo.yaml"]["root"]["dag"]["tasks"]
    scale = root["scale-down"]
    assert scale["dependentTasks"] == ["exit-handler-1"]
    assert scale["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    assert scale["cachingOptions"] == {}


def test_run_time_parameters_are_typed_and_default_to_the_config(compiled):
    parameters = compiled["demo.yaml"]["root"]["inputDefinitions"]["parameters"]
    assert parameters["micro_batch_size"]["parameterType"] == "NUMBER_INTEGER"
    assert parameters["total_samples"]["parameterType"] == "NUMBER_INTEGER"
    config = yaml.safe_load(parameters["config_yaml"]["defaultValue"])
    assert config["name"] == "demo" and config["batch"]["micro_batch_size"] == "explore"
    assert (
        "\n" not in parameters["config_yaml"]["defaultValue"]
    )  # a multi-line default breaks the file header


def test_compile_command_reports_a_bad_config(tmp_path, capsys):
    from batchpilot.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (REPO / "configs" / "demo.yaml").read_text().replace("global_batch_size: 64", "global_batch_size: 0")
    )
    assert main(["compile", "--config", str(bad), "--output", str(tmp_path / "out.yaml")]) == 2
    assert "batch.global_batch_size" in capsys.readouterr().err
    assert not (tmp_path / "out.yaml").exists()


def nemo_documents() -> tuple[dict, dict]:
    documents = list(yaml.safe_load_all((REPO / "pipelines" / "compiled" / "nemo_gpt3_5b.yaml").read_text()))
    return documents[0], documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_gke_explore_task_asks_for_a_gpu_by_its_resource_name_on_the_gpu_pool():
    spec, platform = nemo_documents()
    executor = spec["deploymentSpec"]["executors"]["exec-explore"]["container"]
    accelerator = executor["resources"]["accelerator"]
    # Open-source KFP's driver uses the accelerator type as the container's resource name.
    assert (accelerator["resourceType"], accelerator["resourceCount"]) == ("nvidia.com/gpu", "1")
    explore = platform["exec-explore"]
    assert explore["nodeSelector"]["labels"] == {
        "cloud.google.com/gke-nodepool": "h100-pool",
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
    }
    assert explore["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_gke_tasks_run_the_configs_image_with_a_timeout_each():
    spec, platform = nemo_documents()
    images = {executor["container"]["image"] for executor in spec["deploymentSpec"]["executors"].values()}
    assert images == {"my-registry.example/batchpilot:0.1.0"}  # cluster.image, not batchpilot:<version>
    assert set(platform) == set(spec["deploymentSpec"]["executors"])
    deadlines = {name: int(executor["activeDeadlineSeconds"]) for name, executor in platform.items()}
    assert all(seconds > 0 for seconds in deadlines.values())
    assert deadlines["exec-train-stage"] == 30 * 24 * 3600  # cluster.stage_timeout_s


def test_the_pool_comes_up_before_explore_on_a_pool_that_idles_at_zero(compiled):
    tasks = inner_tasks(compiled["nemo_gpt3_5b.yaml"])
    assert tasks["canary"]["dependentTasks"] == ["prepare-explore-pool"]
    assert tasks["explore"]["dependentTasks"] == ["canary"]
    assert (
        tasks["plan"]["inputs"]["artifacts"]["explore_dir"]["taskOutputArtifact"]["producerTask"] == "explore"
    )


def test_nothing_to_explore_means_no_explore_task(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    config["explore"] = {"study": False}  # micro_batch_size is fixed at 4
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(config))
    tasks = inner_tasks(compile_and_load(path, tmp_path / "fixed-pipeline.yaml"))
    assert "explore" not in tasks and "prepare-explore-pool" not in tasks
    assert "explore_dir" not in tasks["plan"].get("inputs", {}).get("artifacts", {})
    assert tasks["canary"]["dependentTasks"] == ["plan"]
    assert tasks["stages-0-3"]["dependentTasks"] == ["canary", "plan"]


@pytest.mark.parametrize(
    ("image", "error"),
    [
        ("batchpilot:0.1.0", "cluster.image: 'batchpilot:0.1.0' names no registry"),
        ("registry.example/Batchpilot", "is not a container image reference"),
        (None, "cluster.image: is required to compile a gke pipeline"),
    ],
)
def test_a_gke_pipeline_refuses_an_image_a_node_cannot_pull(tmp_path, image, error):
    from batchpilot.config import parse_config
    from batchpilot.errors import BatchpilotError
    from batchpilot.kfp.compile import compile_pipeline

    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    config["cluster"]["image"] = image
    with pytest.raises(BatchpilotError, match=re.escape(error)):
        compile_pipeline(parse_config(config))


def test_an_image_digest_and_the_image_option_are_taken(tmp_path):
    digest = "us-docker.pkg.dev/p/r/batchpilot@sha256:" + "a" * 64
    output = tmp_path / "digest.yaml"
    result = run_batchpilot("compile", "--config", str(REPO / "configs" / "nemo_gpt3_5b.yaml"), "--output",
                            str(output), "--image", digest)  # fmt: skip
    assert result.returncode == 0, result.stderr
    spec = next(yaml.safe_load_all(output.read_text()))
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {digest}


def test_vertex_is_refused_clearly(tmp_path):
    output = tmp_path / "vertex.yaml"
    result = run_batchpilot("compile", "--config", str(REPO / "configs" / "nemo_gpt3_5b.yaml"), "--output",
                            str(output), "--target", "vertex")  # fmt: skip
    assert result.returncode == 2 and not output.exists()
    assert result.stderr.startswith("batchpilot: error: --target: Vertex AI Pipelines is not supported")


def test_local_pipeline_has_no_accelerator_settings():
    documents = list(yaml.safe_load_all((REPO / "pipelines" / "compiled" / "demo.yaml").read_text()))
    assert len(documents) == 1
    assert "accelerator" not in documents[0]["deploymentSpec"]["executors"]["exec-explore"]["container"].get(
        "resources", {}
    )


def _seconds(duration: str) -> int:
    return int(duration.removesuffix("s"))


def test_every_retry_window_fits_all_attempts_at_their_full_timeout():
    """Argo counts backoff.maxDuration from the FIRST attempt's start and refuses any retry past it
    (argo-workflows workflow/controller/operator.go); KFP's default of 3600 s made a launch that failed
    after an hour final. Each attempt may run its whole timeout, so the window is at least
    (retries + 1) x timeout plus the backoffs between them."""
    spec, platform = nemo_documents()
    checked = []
    for component in [spec["root"], *spec["components"].values()]:
        for task in (component.get("dag") or {}).get("tasks", {}).values():
            policy = task.get("retryPolicy")
            if not policy:
                continue
            executor = spec["components"][task["componentRef"]["name"]]["executorLabel"]
            timeout_s = int(platform[executor]["activeDeadlineSeconds"])
            retries, backoff_s = policy["maxRetryCount"], _seconds(policy["backoffDuration"])
            backoffs_s = sum(backoff_s * int(policy["backoffFactor"]) ** k for k in range(retries))
            assert _seconds(policy["backoffMaxDuration"]) >= (retries + 1) * timeout_s + backoffs_s, executor
            checked.append(executor)
    assert "exec-train-stage" in checked and "exec-scale-down" in checked
    train = spec["components"]["comp-final"]["dag"]["tasks"]["train-stage"]["retryPolicy"]
    assert train["backoffMaxDuration"] == f"{3 * 30 * 24 * 3600 + 60 + 120}s"  # 3 x 30 days + backoffs


def test_a_local_pipeline_retries_after_seconds_where_a_cluster_waits_a_minute():
    """On a cluster a retry waits for capacity, a node or a preempted pod (30 s for a resize, 60 s for a
    launch, doubling); on this machine nothing comes back by waiting, so a local pipeline retries after 2 s."""

    def policies(name: str) -> dict[str, dict]:
        spec = next(yaml.safe_load_all((REPO / "pipelines" / "compiled" / name).read_text()))
        return {
            task_name: task["retryPolicy"]
            for component in [spec["root"], *spec["components"].values()]
            for task_name, task in (component.get("dag") or {}).get("tasks", {}).items()
            if task.get("retryPolicy")
        }

    local, cluster = policies("demo.yaml"), policies("nemo_gpt3_5b.yaml")
    assert {policy["backoffDuration"] for policy in local.values()} == {"2s"}
    assert (cluster["train-stage"]["backoffDuration"], cluster["resize-pool"]["backoffDuration"]) == (
        "60s",
        "30s",
    )


def test_gke_task_pods_have_requests_and_are_not_evicted_by_the_autoscaler():
    """Without requests a task pod is BestEffort, the first evicted under node pressure; the annotation
    keeps the cluster autoscaler from removing the node under the train task (issue #20)."""
    spec, platform = nemo_documents()
    for label, executor in spec["deploymentSpec"]["executors"].items():
        resources = executor["container"]["resources"]
        assert resources["resourceCpuRequest"] and resources["resourceMemoryRequest"], label
        annotations = platform[label]["podMetadata"]["annotations"]
        assert annotations == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}, label
    train = spec["deploymentSpec"]["executors"]["exec-train-stage"]["container"]["resources"]
    assert (train["resourceCpuRequest"], train["resourceMemoryRequest"]) == ("250m", "1Gi")
    assert platform["exec-train-stage"]["fieldPathAsEnv"] == [
        {"fieldPath": "metadata.name", "name": "BATCHPILOT_POD_NAME"},
        {"fieldPath": "metadata.namespace", "name": "BATCHPILOT_POD_NAMESPACE"},
    ]
    assert "fieldPathAsEnv" not in platform["exec-plan"]


def test_the_explore_task_schedules_on_every_gpu_machine_it_may_run_on():
    """Explore runs on a node of the trainers' pool: its requests must fit the smallest GPU machine."""
    from kubernetes.utils import parse_quantity

    from batchpilot.cluster.machines import MACHINE_TYPES, gke_allocatable
    from batchpilot.kfp.pipeline import TASK_REQUESTS

    cpu, memory = (parse_quantity(q) for q in TASK_REQUESTS["explore"])
    for name, machine in MACHINE_TYPES.items():
        if machine.gpu_label.startswith("nvidia"):
            allocatable = gke_allocatable(machine)
            assert cpu * 1000 <= allocatable.cpu_millicores and memory <= allocatable.memory_bytes, name


def test_with_capacity_ahead_off_a_launch_group_is_resize_then_train_as_before(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["cluster"]["capacity_ahead"] = "off"
    path = tmp_path / "demo_off.yaml"
    path.write_text(yaml.safe_dump(config))
    spec = compile_and_load(path, tmp_path / "pipeline.yaml")
    for k in range(4):
        tasks = spec["components"][f"comp-launch-{k}"]["dag"]["tasks"]
        assert set(tasks) == {"resize-pool", "train-stage"}
        assert tasks["train-stage"]["dependentTasks"] == ["resize-pool"]
    assert "comp-bring-next-nodes" not in spec["components"]


def test_with_a_kueue_queue_the_explore_task_pod_carries_the_queue_and_priority_labels(tmp_path):
    """#37: explore's task pod goes through the run's Kueue queue (Kueue's pod integration gates a pod with the
    queue-name label until admitted); the other task pods take no GPU and carry no queue label."""
    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    config["cluster"].update(kueue_queue="team-a", priority_class="research")
    path = tmp_path / "queued.yaml"
    path.write_text(yaml.safe_dump(config))
    compile_config(path, tmp_path / "queued-pipeline.yaml")
    documents = list(yaml.safe_load_all((tmp_path / "queued-pipeline.yaml").read_text()))
    platform = documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert platform["exec-explore"]["podMetadata"]["labels"] == {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "research",
    }
    others = [name for name, executor in platform.items() if executor.get("podMetadata", {}).get("labels")]
    assert others == ["exec-explore"]
    _, unqueued = nemo_documents()
    assert not unqueued["exec-explore"]["podMetadata"].get("labels")
