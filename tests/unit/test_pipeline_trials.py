"""Batch trials in the compiled pipeline (#25): a `trials` task group between the plan and the first launch
(pool, warm-up, a parallel-for of branch tasks, decide), whose decided plan every later task reads; and the
pool the trials hold at once."""

from __future__ import annotations

import pytest
import yaml

from batchpilot.config import config_from_text
from batchpilot.errors import BatchpilotError
from batchpilot.workflow.plan import plan
from batchpilot.workflow.trials import trials_pool_nodes
from helpers import REPO, gke_a3_config, run_batchpilot, tiny_config, write_manifest


def demo_with_trials(**trials) -> dict:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["trials"] = {"enabled": True, "tokens": 32_768, **trials}
    return config


def compile_spec(config: dict, tmp_path) -> list[dict]:
    """`batchpilot compile` of `config` in a real process; the compiled file's documents."""
    path, output = tmp_path / "config.yaml", tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_batchpilot("compile", "--config", str(path), "--output", str(output))
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(output.read_text()))


@pytest.fixture(scope="module")
def demo_spec(tmp_path_factory) -> dict:
    return compile_spec(demo_with_trials(parallelism=3), tmp_path_factory.mktemp("demo"))[0]


def reads_the_trials_output(parameter: dict) -> bool:
    return parameter == {"taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "trials"}}


def test_the_trials_run_between_the_plan_and_the_first_launch_which_reads_the_decided_plan(demo_spec):
    tasks = demo_spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    trials = tasks["trials"]
    assert trials["taskInfo"]["name"] == "trials"
    assert trials["dependentTasks"] == ["plan"]  # the demo explores: its canary ran before explore
    assert trials["inputs"]["parameters"]["plan_json"]["taskOutputParameter"]["producerTask"] == "plan"
    assert tasks["launch-0"]["dependentTasks"] == ["trials"]
    for name in ("launch-0", "launch-1", "launch-2", "launch-3", "report"):
        assert reads_the_trials_output(tasks[name]["inputs"]["parameters"]["plan_json"]), name


def test_the_branches_are_a_parallel_for_bounded_by_trials_parallelism_then_decide(demo_spec):
    group = demo_spec["components"]["comp-trials"]["dag"]
    tasks = group["tasks"]
    assert tasks["trials-warmup"]["dependentTasks"] == ["prepare-trials-pool"]
    loop = tasks["for-loop-1"]
    assert loop["dependentTasks"] == ["trials-warmup"]
    assert loop["iteratorPolicy"] == {"parallelismLimit": 3}
    # The branch indices come from the warm-up task (the branch count is known once explore has run).
    assert loop["parameterIterator"]["items"] == {"inputParameter": "pipelinechannel--trials-warmup-Output"}
    # The plan reaches the loop as the group's input, not as a task output (see _trials_pipeline).
    assert loop["inputs"]["parameters"]["pipelinechannel--plan_json"] == {
        "componentInputParameter": "plan_json"
    }
    branch = demo_spec["components"]["comp-for-loop-1"]["dag"]["tasks"]["trial-branch"]
    assert branch["inputs"]["parameters"]["branch_index"] == {
        "componentInputParameter": "pipelinechannel--trials-warmup-Output-loop-item"
    }
    assert branch["retryPolicy"]["maxRetryCount"] == 2
    decide = tasks["decide-trials"]
    assert decide["dependentTasks"] == ["for-loop-1"]
    assert decide["inputs"]["parameters"]["results"]["taskOutputParameter"] == {
        "outputParameterKey": "pipelinechannel--trial-branch-Output",
        "producerTask": "for-loop-1",
    }
    assert (
        group["outputs"]["parameters"]["Output"]["valueFromParameter"]["producerSubtask"] == "decide-trials"
    )
    for name in ("prepare-trials-pool", "trials-warmup", "decide-trials"):
        assert tasks[name]["cachingOptions"] == {}, name


def test_a_pipeline_without_trials_has_no_trials_group():
    spec = yaml.safe_load((REPO / "pipelines" / "compiled" / "demo.yaml").read_text())
    assert "trials" not in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert "comp-trials" not in spec["components"]


def test_on_gke_each_branch_task_is_set_like_a_train_task(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "nemo_gpt3_5b.yaml").read_text())
    config["trials"] = {"enabled": True, "tokens": 2**30, "parallelism": 2}
    spec, platform = compile_spec(config, tmp_path)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    resources = spec["deploymentSpec"]["executors"]["exec-trial-branch"]["container"]["resources"]
    assert (resources["resourceCpuRequest"], resources["resourceMemoryRequest"]) == ("250m", "1Gi")
    for name in ("exec-trial-branch", "exec-trials-warmup"):
        assert int(executors[name]["activeDeadlineSeconds"]) == 30 * 24 * 3600  # cluster.stage_timeout_s
        assert executors[name]["fieldPathAsEnv"][0] == {
            "fieldPath": "metadata.name",
            "name": "BATCHPILOT_POD_NAME",
        }
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert tasks["trials"]["dependentTasks"] == ["plan"]
    assert tasks["stages-0-3"]["dependentTasks"] == ["trials"]
    decide = spec["components"]["comp-trials"]["dag"]["tasks"]["decide-trials"]["inputs"]["parameters"]
    # A fixed micro batch: the decided plan must keep the compiled launches.
    assert (
        decide["expected_launches"]["runtimeValue"]["constant"] == "stages-0-3,stage-4,stage-5,stage-6,final"
    )


def planned(config: dict):
    return plan(
        config_from_text(yaml.safe_dump(config)),
        micro_batch_size=config["batch"]["micro_batch_size"],
        announce=False,
    )


def tiny_with_trials(config: dict, **trials) -> dict:
    config["trials"] = {
        "enabled": True,
        "tokens": 256 * 32,
        "batch_sizes": [16, 32],
        "budget_fraction": 0.5,
        **trials,
    }
    return config


def test_the_trials_pool_holds_the_branches_that_run_at_once():
    # Batches 16 and 32 x 3 LR multipliers on 8-GPU nodes at micro batch 2: every branch on one node.
    document = planned(tiny_with_trials(gke_a3_config(), parallelism=2))
    assert [b.num_nodes for b in document.trials.branches] == [1] * 6
    assert trials_pool_nodes(document) == 2
    assert trials_pool_nodes(planned(tiny_with_trials(gke_a3_config(), parallelism=1))) == 1


def test_more_parallel_branches_than_the_pool_can_hold_are_refused():
    with pytest.raises(BatchpilotError) as refused:
        trials_pool_nodes(planned(tiny_with_trials(gke_a3_config(), parallelism=3)))
    assert str(refused.value) == (
        "trials.parallelism: is 3: 3 branches at once need up to 3 node(s) (1 + 1 + 1), more than "
        "cluster.max_nodes 2 (fix: set trials.parallelism to at most 2, or raise cluster.max_nodes)"
    )


def test_a_local_pipeline_runs_two_branches_at_once_as_kfp_local_does(tmp_path):
    local = tiny_config(data_uri=write_manifest(tmp_path / "data"), checkpoint_uri=f"file://{tmp_path}/ckpt")
    assert trials_pool_nodes(planned(tiny_with_trials(local, parallelism=4))) == 2
    local["cluster"].update(max_nodes=1, devices_per_node=2)  # every stage and branch on one 2-process node
    local["batch"]["micro_batch_size"] = 8
    with pytest.raises(BatchpilotError, match=r"is 4: 2 branches at once need up to 2 node\(s\) \(1 \+ 1\)"):
        trials_pool_nodes(planned(tiny_with_trials(local, parallelism=4)))


def test_the_console_times_each_parallel_branch_from_its_own_start(monkeypatch):
    """kfp.local names every iteration of the parallel-for after its task: two branches start (at 0 s and
    1 s), end at 10 s and 12 s, and each end is timed from a start, not the last one's."""
    import io

    from rich.console import Console

    from batchpilot.commands import run as run_command

    clock = iter([0.0, 1.0, 10.0, 12.0])
    monkeypatch.setattr(run_command.time, "monotonic", lambda: next(clock))
    shown = io.StringIO()
    console = run_command.TaskConsole(Console(file=shown, width=200), launch_names=[])
    for line in (
        "Executing task 'trial-branch'",
        "Executing task 'trial-branch'",
        "Task 'trial-branch' finished with status SUCCESS",
        "Task 'trial-branch' finished with status SUCCESS",
    ):
        console(line)
    assert shown.getvalue().splitlines() == [
        "> trial-branch",
        "> trial-branch",
        "  done trial-branch in 10.0 s",
        "  done trial-branch in 11.0 s",
    ]


def test_compile_refuses_parallel_branches_the_pool_cannot_hold(tmp_path):
    config = tiny_with_trials(gke_a3_config(), parallelism=3)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_batchpilot("compile", "--config", str(path), "--out", str(tmp_path / "pipeline.yaml"))
    assert result.returncode == 2
    assert "trials.parallelism: is 3: 3 branches at once need up to 3 node(s)" in result.stderr
    assert not (tmp_path / "pipeline.yaml").exists()


def test_the_console_counts_two_task_records_written_onto_one_line(monkeypatch):
    """Two parallel iterations' threads can write their records onto one line of kfp.local's stream: both
    ends are shown."""
    import io

    from rich.console import Console

    from batchpilot.commands import run as run_command

    clock = iter([0.0, 1.0, 10.0, 12.0])
    monkeypatch.setattr(run_command.time, "monotonic", lambda: next(clock))
    shown = io.StringIO()
    console = run_command.TaskConsole(Console(file=shown, width=200), launch_names=[])
    console("Executing task 'trial-branch'")
    console("Executing task 'trial-branch'")
    console(
        "13:36:05.632 - INFO - Task 'trial-branch' finished with status SUCCESS13:36:05.640 - INFO - Task "
        "'trial-branch' finished with status SUCCESS"
    )
    assert shown.getvalue().splitlines()[2:] == [
        "  done trial-branch in 10.0 s",
        "  done trial-branch in 11.0 s",
    ]
