"""The compiled pipeline: stage groups in order, side-effect tasks uncached, exit handler, no drift."""

from __future__ import annotations

import itertools
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
    """The installed command and the repository's script write the same bytes for every example."""
    import subprocess
    import sys

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in EXAMPLES:
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


@pytest.mark.parametrize(
    ("name", "stages"), [("demo.yaml", 4), ("nemo_gpt3_5b.yaml", 8), ("maxtext_per_device.yaml", 4)]
)
def test_stage_groups_run_in_order(compiled, name, stages):
    tasks = inner_tasks(compiled[name])
    names = [f"stage-{k}" for k in range(stages - 1)] + ["final"]
    assert [tasks[n]["taskInfo"]["name"] for n in names] == names
    assert tasks["stage-0"]["dependentTasks"] == ["plan"]
    for before, after in itertools.pairwise(names):
        assert before in tasks[after]["dependentTasks"]
    assert "final" in tasks["report"]["dependentTasks"]
    for stage in names:
        group = compiled[name]["components"][f"comp-{stage}"]["dag"]["tasks"]
        assert group["train-stage"]["dependentTasks"] == ["resize-pool"]


def test_side_effect_tasks_are_not_cached_and_retry(compiled):
    spec = compiled["demo.yaml"]
    tasks = inner_tasks(spec)
    for name in ("explore", "stage-0", "final", "report"):
        assert tasks[name]["cachingOptions"] == {}, name
    assert tasks["plan"]["cachingOptions"] == {"enableCache": True}
    group = spec["components"]["comp-stage-1"]["dag"]["tasks"]
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


def test_gke_explore_task_lands_on_the_gpu_pool():
    documents = list(yaml.safe_load_all((REPO / "pipelines" / "compiled" / "nemo_gpt3_5b.yaml").read_text()))
    spec, platform = documents[0], documents[1]
    executor = spec["deploymentSpec"]["executors"]["exec-explore"]["container"]
    accelerator = executor["resources"]["accelerator"]
    assert (accelerator["resourceType"], accelerator["resourceCount"]) == ("nvidia-h100-80gb", "1")
    explore = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-explore"]
    assert explore["nodeSelector"]["labels"] == {
        "cloud.google.com/gke-nodepool": "h100-pool",
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
    }
    assert explore["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert executor["image"] == "batchpilot:0.1.0"


def test_local_pipeline_has_no_accelerator_settings():
    documents = list(yaml.safe_load_all((REPO / "pipelines" / "compiled" / "demo.yaml").read_text()))
    assert len(documents) == 1
    assert "accelerator" not in documents[0]["deploymentSpec"]["executors"]["exec-explore"]["container"].get(
        "resources", {}
    )
