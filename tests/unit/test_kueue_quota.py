"""Can a Kueue ClusterQueue ever hold a launch (`cluster/kueue.py` `quota_shortfall`)? Its flavors' nominal
quota plus what it may borrow, per resource, against the launch's requests (ClusterQueue and ResourceFlavor
fields as kueue.x-k8s.io/v1beta2 defines them, Kueue v0.19.2 apis/kueue/v1beta2)."""

from __future__ import annotations

from typing import Any

from batchpilot.cluster.kueue import launch_needs, quota_shortfall
from batchpilot.config import ClusterConfig

H100 = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}


def queue(
    *flavors: tuple[str, dict[str, Any]], covered: list[str] | None = None, cohort: str | None = None
) -> dict:
    spec: dict[str, Any] = {"resourceGroups": [{
        "coveredResources": covered or ["cpu", "memory", "nvidia.com/gpu"],
        "flavors": [{"name": name, "resources": [{"name": r, **q} for r, q in quota.items()]} for name, quota in flavors],
    }]}  # fmt: skip
    if cohort:
        spec["cohortName"] = cohort
    return {"metadata": {"name": "team"}, "spec": spec}


def gpus(n: str, **more: str) -> dict[str, dict[str, str]]:
    return {
        "nvidia.com/gpu": {"nominalQuota": n, **more},
        "cpu": {"nominalQuota": "1k"},
        "memory": {"nominalQuota": "4Ti"},
    }


NEEDS = {"nvidia.com/gpu": 32.0, "cpu": 800.0, "memory": 2 * 2**40}


def test_a_flavor_whose_quota_holds_the_launch_passes():
    assert (
        quota_shortfall(
            queue(("h100", gpus("32"))), {"h100": H100}, needs=NEEDS, accelerator_type="nvidia-h100-80gb"
        )
        is None
    )


def test_the_first_flavor_short_and_the_second_holding_passes():
    cq = queue(("small", gpus("8")), ("big", gpus("64")))
    assert (
        quota_shortfall(cq, {"small": H100, "big": H100}, needs=NEEDS, accelerator_type="nvidia-h100-80gb")
        is None
    )


def test_each_short_resource_is_named_with_what_the_launch_asks_and_the_most_it_may_have():
    cq = queue(("h100", {**gpus("16"), "memory": {"nominalQuota": "1Ti"}}))
    found = quota_shortfall(cq, {"h100": H100}, needs=NEEDS, accelerator_type="nvidia-h100-80gb")
    assert found == ("ClusterQueue team can never hold it: flavor h100: nvidia.com/gpu 32 > 16, memory "
                     "2199023255552 > 1099511627776")  # fmt: skip


def test_a_flavor_for_another_gpu_cannot_hold_it():
    found = quota_shortfall(queue(("a100", gpus("64"))), {"a100": {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}},
                            needs=NEEDS, accelerator_type="nvidia-h100-80gb")  # fmt: skip
    assert found == "ClusterQueue team can never hold it: flavor a100 is for nvidia-a100-80gb nodes"


def test_a_resource_no_group_covers_is_named():
    found = quota_shortfall(queue(("h100", gpus("64")), covered=["cpu", "memory"]), {"h100": H100}, needs=NEEDS,
                            accelerator_type="nvidia-h100-80gb")  # fmt: skip
    assert found == "ClusterQueue team can never hold it: no resource group covers nvidia.com/gpu"


def test_borrowing_within_a_cohort_counts_up_to_its_limit_and_without_one_is_unbounded():
    limited = queue(("h100", gpus("16", borrowingLimit="16")), cohort="org")
    assert quota_shortfall(limited, {"h100": H100}, needs=NEEDS, accelerator_type="nvidia-h100-80gb") is None
    short = queue(("h100", gpus("16", borrowingLimit="8")), cohort="org")
    assert "nvidia.com/gpu 32 > 24" in str(
        quota_shortfall(short, {"h100": H100}, needs=NEEDS, accelerator_type=None)
    )
    unbounded = queue(("h100", gpus("0")), cohort="org")
    assert (
        quota_shortfall(unbounded, {"h100": H100}, needs=NEEDS, accelerator_type="nvidia-h100-80gb") is None
    )
    alone = queue(("h100", gpus("16", borrowingLimit="64")))  # no cohort: nothing to borrow from
    assert "nvidia.com/gpu 32 > 16" in str(
        quota_shortfall(alone, {"h100": H100}, needs=NEEDS, accelerator_type=None)
    )


def test_a_launch_asks_for_its_accelerators_and_the_cpus_and_memory_the_config_sizes():
    cluster = ClusterConfig(
        backend="gke", max_nodes=8, devices_per_node=8, accelerator_type="nvidia-h100-80gb"
    )
    assert launch_needs(cluster, nodes=4) == {"nvidia.com/gpu": 32.0}
    sized = cluster.model_copy(update={"cpu_per_node": 200, "memory_per_node_bytes": 10**12})
    assert launch_needs(sized, nodes=2) == {"nvidia.com/gpu": 16.0, "cpu": 400.0, "memory": 2e12}
    tpu = ClusterConfig(backend="gke", max_nodes=4, devices_per_node=4, accelerator_type="tpu-v5p-slice")
    assert launch_needs(tpu, nodes=2) == {"google.com/tpu": 8.0}
