"""Issue #20: JobSet names from `planning.names` pass the JobSet webhook's rules for any run and launch."""

from __future__ import annotations

import pytest

from batchpilot.planning.names import (
    JOBSET_NAME_MAX_CHARS,
    REPLICATED_JOB_NAME,
    cluster_problems,
    jobset_name,
    jobset_problems,
)
from batchpilot.planning.stages import MAX_STAGES

RUNS = [
    "5b-llama",
    "my-llama-5b-pretraining",
    "a" * 40,
    "x",
    "9",
    "0" * 40,
    "run-with-a-dash-at-39-characters-long-x",
]
# Every launch name a plan of MAX_STAGES stages can have (planning.launches.launch_name).
LAUNCHES = (
    [f"stage-{k}" for k in range(MAX_STAGES - 1)]
    + ["final"]
    + [f"stages-{a}-{b}" for a in range(MAX_STAGES - 2) for b in range(a + 1, MAX_STAGES - 1)]
    + [f"stages-{a}-final" for a in range(MAX_STAGES - 1)]
)


@pytest.mark.parametrize("run", RUNS)
def test_every_launch_of_any_run_gets_a_distinct_name_whose_pods_the_webhook_admits(run):
    names = [jobset_name(run_name=run, launch_name=launch) for launch in LAUNCHES]
    assert len(set(names)) == len(names)
    for name in names:
        assert len(name) <= JOBSET_NAME_MAX_CHARS and name[0].isalpha()
        # 99,999 pods: more nodes than a GKE cluster can have.
        assert (
            jobset_problems(name=name, subdomain=name, replicated_jobs=[(REPLICATED_JOB_NAME, 1, 99_999)])
            == []
        )


def test_names_are_readable_deterministic_and_say_which_run_and_launch():
    assert jobset_name(run_name="ramp", launch_name="stages-0-3").startswith("ramp-stages-0-3-")
    assert jobset_name(run_name="5b-llama", launch_name="final").startswith("bp-5b-llama-final-")
    long = jobset_name(run_name="my-llama-5b-pretraining", launch_name="stages-0-3")
    assert long.startswith("my-llama-5b-pretra-stages-0-3-") and len(long) == JOBSET_NAME_MAX_CHARS
    assert long == jobset_name(run_name="my-llama-5b-pretraining", launch_name="stages-0-3")
    # Runs cut to the same prefix still differ by their hash.
    assert jobset_name(run_name="a" * 40, launch_name="final") != jobset_name(
        run_name="a" * 39, launch_name="final"
    )


def test_the_old_derivation_fails_the_rules_the_new_one_passes():
    old = "5b-llama-stage-0"  # `<run>-<launch>`, before torchx's random suffix
    refused = jobset_problems(name=old, subdomain=old, replicated_jobs=[(REPLICATED_JOB_NAME, 1, 1)])
    assert [line.split(":")[0] for line in refused] == [
        "spec.network.subdomain '5b-llama-stage-0'",
        "Job name '5b-llama-stage-0-batchpilot-0' (29 characters)",
        "pod name '5b-llama-stage-0-batchpilot-0-0-abcde' (37 characters)",
    ]


def gke_problems(**changes: object) -> list[str]:
    fields: dict = {
        "backend": "gke", "run_name": "ramp", "namespace": "batchpilot", "kueue_queue": None, "node_pool": "h100",
        "accelerator_type": "nvidia-h100-80gb", "machine_type": None, "devices_per_node": 8, "min_nodes": 1,
        "max_nodes": 16, "data_uri": "gs://b/data", "checkpoint_uri": "gs://b/ckpt",
    }  # fmt: skip
    return [str(error) for error in cluster_problems(**(fields | changes))]


def test_a_gke_config_is_checked_and_a_local_one_is_not():
    assert gke_problems() == []
    assert gke_problems(backend="local", checkpoint_uri="file://ckpt", node_pool="Bad") == []
    assert gke_problems(max_nodes=100_000, run_name="a" * 40) == []
    longest = jobset_name(run_name="a" * 40, launch_name=f"stages-{MAX_STAGES - 2}-final")
    assert gke_problems(max_nodes=100_001, run_name="a" * 40) == [
        f"cluster.max_nodes: 100001 nodes make JobSet names the JobSet webhook refuses: pod name '{longest}"
        "-batchpilot-0-100000-abcde' (64 characters): must be no more than 63 characters (fix: set "
        "cluster.max_nodes to at most 100000)"
    ]
    (line,) = gke_problems(
        node_pool="v6e" * 13, accelerator_type="tpu-v6e-slice", devices_per_node=4, max_nodes=8
    )
    assert (
        line.startswith("cluster.node_pool: 'v6e") and "(fix: shorten cluster.node_pool to at most 36" in line
    )


def test_a_priority_class_needs_a_queue_and_a_name_kueue_can_label():
    assert gke_problems(kueue_queue="team-a", priority_class="high") == []
    assert gke_problems(priority_class="high") == [
        "cluster.priority_class: is a Kueue WorkloadPriorityClass and applies only to JobSets in a Kueue queue "
        "(fix: set cluster.kueue_queue to the team's LocalQueue, or remove cluster.priority_class)"
    ]
    refused = gke_problems(kueue_queue="team-a", priority_class="High_Priority")
    assert len(refused) == 1 and refused[0].startswith(
        "cluster.priority_class: 'High_Priority' cannot name a"
    )
    assert gke_problems(kueue_queue="team-a", priority_class="p" * 64)[0].startswith(
        "cluster.priority_class: "
    )
